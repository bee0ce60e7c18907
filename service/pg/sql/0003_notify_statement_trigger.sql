-- retired-pod-gc: the change-notify trigger production must install (version 0003).
--
-- Replaces 0002 in place: 0002's per-row triggers and their function are dropped, and three
-- statement-level triggers take their place. Every statement that inserts or deletes
-- sandbox_k8s_executions rows, or updates rows so that `active` or `execution_state` changes,
-- sends as few NOTIFYs as its changes fit in, on the channel given as the trigger argument
-- (TG_ARGV[0]). `retired-pod-gc migrate` substitutes the configured channel for the default
-- literal 'sandbox_execution_changed' below (three trigger arguments); applied by hand
-- (psql -f) it uses the default.
--
-- Why statement level: a FOR EACH ROW trigger runs a query on `sandboxes`, builds a payload and
-- calls pg_notify once per changed row, inside the writer's transaction; a mass retirement
-- then costs the writer several times the UPDATE itself and sends one NOTIFY per row. Here
-- the rows a statement changed are read from its transition tables, joined to `sandboxes`
-- once, and sent in batches.
--
-- Which rows are reported. INSERT: every inserted row. DELETE: every deleted row. UPDATE: an
-- UPDATE trigger with transition tables cannot have a column list (`UPDATE OF ...`), so it
-- fires for every UPDATE; old and new rows are compared by `id` (the primary key of the data
-- contract) and only rows whose `active` or `execution_state` changed are reported. An id
-- present only among the old rows (an UPDATE of the key itself) is reported as a delete, one
-- only among the new rows as an insert.
--
-- NOTIFY is transactional: listeners see the payloads only after the writer commits.
-- Each payload is a JSON object holding a batch of changes, each the facts 0002 sent:
--   {"rows": [[op, namespace, pod_name, active, execution_state], ...]}
-- with op "insert" | "update" | "delete", active true | false | null, the texts possibly null
-- (no sandboxes row) and cut to 253, 253 and 64 characters as in 0002. A delete carries the
-- deleted row's values.
--
-- Why no payload can reach PostgreSQL's limit (a payload of 8000 bytes or more makes pg_notify
-- raise, which would abort the writer's transaction):
--   * one change's JSON text is at most 3,445 bytes: JSON escaping turns a character into at
--     most 6 bytes (\u001f; a character of any server encoding is at most 4 bytes as is), so
--     namespace and pod name are each at most 2 + 253 * 6 = 1,520 bytes with their quotes,
--     the state 2 + 64 * 6 = 386, the op 8 ("update" quoted), active 5 (false), plus 2
--     brackets and 4 commas: 1,520 + 1,520 + 386 + 8 + 5 + 6 = 3,445;
--   * a change longer than 512 bytes (never one of a Kubernetes pod: names are at most 253
--     ASCII characters) goes out alone: at most 11 + 3,445 = 3,456 bytes with the envelope
--     `{"rows":[` + `]}` (11 bytes);
--   * the others are packed in order: each gets the offset at which it starts (the running
--     sum of the preceding packed changes' lengths plus one comma each), and the changes whose
--     offsets fall in [7000 k, 7000 (k + 1)) form batch k. The last of them starts below
--     7000 (k + 1) and is at most 512 bytes long, so a batch's changes and commas span less
--     than 7,000 + 512 bytes: the payload is below 11 + 7,512 = 7,523 bytes.
-- tests/integration/test_pg_listener.py sends worst-case rows (long names made of characters
-- JSON escapes to 6 bytes, multibyte text, many rows) through this file and checks it.
--
-- Idempotent: CREATE OR REPLACE FUNCTION, DROP ... IF EXISTS, then the triggers are created
-- again (all in the one transaction `migrate` runs this file in).

CREATE OR REPLACE FUNCTION retired_pod_gc_notify_executions_changed()
RETURNS trigger
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    -- The statement's changes, column by column (zipped again by unnest below).
    ops         text[];
    sandbox_ids text[];
    pod_names   text[];
    actives     boolean[];
    states      text[];
BEGIN
    IF TG_OP = 'UPDATE' THEN
        SELECT array_agg(CASE WHEN o.id IS NULL THEN 'insert'
                              WHEN n.id IS NULL THEN 'delete'
                              ELSE 'update' END),
               array_agg(CASE WHEN n.id IS NULL THEN o.sandbox_id ELSE n.sandbox_id END),
               array_agg(CASE WHEN n.id IS NULL THEN o.pod_name ELSE n.pod_name END),
               array_agg(CASE WHEN n.id IS NULL THEN o.active ELSE n.active END),
               array_agg(CASE WHEN n.id IS NULL THEN o.execution_state
                              ELSE n.execution_state END)
          INTO ops, sandbox_ids, pod_names, actives, states
          FROM old_rows AS o
          FULL JOIN new_rows AS n ON n.id = o.id
         WHERE o.id IS NULL
            OR n.id IS NULL
            OR o.active IS DISTINCT FROM n.active
            OR o.execution_state IS DISTINCT FROM n.execution_state;
    ELSIF TG_OP = 'INSERT' THEN
        SELECT array_agg('insert'::text), array_agg(n.sandbox_id), array_agg(n.pod_name),
               array_agg(n.active), array_agg(n.execution_state)
          INTO ops, sandbox_ids, pod_names, actives, states
          FROM new_rows AS n;
    ELSE
        SELECT array_agg('delete'::text), array_agg(o.sandbox_id), array_agg(o.pod_name),
               array_agg(o.active), array_agg(o.execution_state)
          INTO ops, sandbox_ids, pod_names, actives, states
          FROM old_rows AS o;
    END IF;
    IF ops IS NULL THEN
        RETURN NULL;  -- nothing the service reads changed
    END IF;
    -- One query for the whole statement: the namespaces (sandboxes joined once), one JSON text
    -- per change, the batches (see the bound above), one pg_notify per batch. PERFORM runs
    -- the query to its end.
    PERFORM pg_notify(TG_ARGV[0], '{"rows":[' || string_agg(b.change, ',') || ']}')
    FROM (
        SELECT j.change,
               CASE WHEN j.bytes <= 512
                    -- The offset at which this change starts among the packed ones.
                    THEN (sum(CASE WHEN j.bytes <= 512 THEN j.bytes + 1 ELSE 0 END)
                              OVER (ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
                          - j.bytes - 1) / 7000
                    -- A long change alone, in a batch numbered apart from the packed ones.
                    ELSE -row_number() OVER ()
               END AS batch
        FROM (
            SELECT t.change, octet_length(t.change) AS bytes
            FROM (
                SELECT CASE
                    -- Texts JSON would not escape are quoted as they are (most of the cost of
                    -- to_json is its per-call type lookup); the others go through to_json.
                    -- Either way the text is the same.
                    WHEN (coalesce(s.namespace, '') || coalesce(u.pod_name, '')
                          || coalesce(u.execution_state, '')) ~ '[\x01-\x1f"\\]'
                    THEN '["' || u.op || '",'
                        || coalesce(to_json(left(s.namespace, 253))::text, 'null') || ','
                        || coalesce(to_json(left(u.pod_name, 253))::text, 'null') || ','
                        || coalesce(u.active::text, 'null') || ','
                        || coalesce(to_json(left(u.execution_state, 64))::text, 'null') || ']'
                    ELSE '["' || u.op || '",'
                        || coalesce('"' || left(s.namespace, 253) || '"', 'null') || ','
                        || coalesce('"' || left(u.pod_name, 253) || '"', 'null') || ','
                        || coalesce(u.active::text, 'null') || ','
                        || coalesce('"' || left(u.execution_state, 64) || '"', 'null') || ']'
                    END AS change
                FROM unnest(ops, sandbox_ids, pod_names, actives, states)
                         AS u(op, sandbox_id, pod_name, active, execution_state)
                LEFT JOIN sandboxes AS s ON s.id = u.sandbox_id
                -- Not flattened into the queries around it: each change is built once.
                OFFSET 0
            ) AS t
        ) AS j
    ) AS b
    GROUP BY b.batch;
    RETURN NULL;
END
$fn$;

-- 0002's per-row triggers and their function.
DROP TRIGGER IF EXISTS retired_pod_gc_execution_inserted_deleted ON sandbox_k8s_executions;
DROP TRIGGER IF EXISTS retired_pod_gc_execution_updated ON sandbox_k8s_executions;
DROP FUNCTION IF EXISTS retired_pod_gc_notify_execution_changed();

-- Transition tables allow one event per trigger: three triggers.
DROP TRIGGER IF EXISTS retired_pod_gc_executions_inserted ON sandbox_k8s_executions;
CREATE TRIGGER retired_pod_gc_executions_inserted
    AFTER INSERT ON sandbox_k8s_executions
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT
    EXECUTE FUNCTION retired_pod_gc_notify_executions_changed('sandbox_execution_changed');

DROP TRIGGER IF EXISTS retired_pod_gc_executions_updated ON sandbox_k8s_executions;
CREATE TRIGGER retired_pod_gc_executions_updated
    AFTER UPDATE ON sandbox_k8s_executions
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT
    EXECUTE FUNCTION retired_pod_gc_notify_executions_changed('sandbox_execution_changed');

DROP TRIGGER IF EXISTS retired_pod_gc_executions_deleted ON sandbox_k8s_executions;
CREATE TRIGGER retired_pod_gc_executions_deleted
    AFTER DELETE ON sandbox_k8s_executions
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT
    EXECUTE FUNCTION retired_pod_gc_notify_executions_changed('sandbox_execution_changed');
