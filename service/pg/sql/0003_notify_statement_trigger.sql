-- retired-pod-gc: the change-notify trigger production must install (version 0003).
--
-- Replaces 0002 in place: 0002's per-row triggers and their function are dropped, and three
-- statement-level triggers take their place. Every statement that inserts or deletes
-- sandbox_k8s_executions rows, or updates rows so that `active` or `execution_state` changes,
-- sends as few NOTIFYs as its changes fit in, on the channel named in the trigger function.
-- `retired-pod-gc migrate` substitutes the configured channel for the default literal
-- 'sandbox_execution_changed' below (six pg_notify calls); applied by hand (psql -f) it uses
-- the default. A literal rather than a trigger argument: the function's queries then have no
-- parameters, so each is planned once per session (a query with parameters is planned again for
-- each of its first runs, which a one-row statement would pay every time).
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
--   * a statement of one row sends its one change alone: at most 11 + 3,445 = 3,456 bytes with
--     the envelope `{"rows":[` + `]}` (11 bytes);
--   * a change longer than 512 bytes (never one of a Kubernetes pod: names are at most 253
--     ASCII characters) goes out alone too: at most 3,456 bytes;
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

-- One change as compact JSON: [op, namespace, pod_name, active, execution_state], the texts cut
-- as 0002 cut them. Texts JSON would not escape are quoted as they are (most of what to_json
-- costs is its per-call type lookup); the others go through to_json; either way the text is
-- the same. Inlined into the queries below (its arguments there are plain columns).
CREATE OR REPLACE FUNCTION retired_pod_gc_change_json(
    op text, namespace text, pod_name text, active boolean, execution_state text
)
RETURNS text
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $fn$
    SELECT CASE
        WHEN (coalesce(namespace, '') || coalesce(pod_name, '') || coalesce(execution_state, ''))
             ~ '[\x01-\x1f"\\]'
        THEN '["' || op || '",'
            || coalesce(to_json(left(namespace, 253))::text, 'null') || ','
            || coalesce(to_json(left(pod_name, 253))::text, 'null') || ','
            || coalesce(active::text, 'null') || ','
            || coalesce(to_json(left(execution_state, 64))::text, 'null') || ']'
        ELSE '["' || op || '",'
            || coalesce('"' || left(namespace, 253) || '"', 'null') || ','
            || coalesce('"' || left(pod_name, 253) || '"', 'null') || ','
            || coalesce(active::text, 'null') || ','
            || coalesce('"' || left(execution_state, 64) || '"', 'null') || ']'
    END
$fn$;

-- The batch a change goes in (see the bound above): `bytes` is the change's length, `packed`
-- the running sum of (length + 1) over the changes up to and including it counting only those
-- of at most 512 bytes, `nth` its position. Inlined into the queries below.
CREATE OR REPLACE FUNCTION retired_pod_gc_change_batch(bytes integer, packed bigint, nth bigint)
RETURNS bigint
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $fn$
    SELECT CASE WHEN bytes <= 512
                -- The offset at which the change starts among the packed ones, in 7000s.
                THEN (packed - bytes - 1) / 7000
                -- A long change alone, in a batch numbered apart from the packed ones.
                ELSE -nth
           END
$fn$;

-- Each branch is one query for the whole statement: the rows the service must hear of, their
-- namespaces (sandboxes joined once), one JSON text per change, the batches, one pg_notify per
-- batch (PERFORM runs the query to its end). They differ only in where the rows come from:
-- transition tables allow one event per trigger, and a query may name only the transition
-- tables of its own trigger.
CREATE OR REPLACE FUNCTION retired_pod_gc_notify_executions_changed()
RETURNS trigger
LANGUAGE plpgsql
AS $fn$
BEGIN
    -- A statement of one row (a single retirement, a new execution: the common case) is one
    -- change, at most 3,445 bytes, so one payload below 3,456 bytes: it skips the batching,
    -- whose plan (hash join, window aggregates, sort) costs several times the whole query for
    -- one row. For an UPDATE also only when the row kept its id (else the general path reports
    -- the old id as deleted and the new one as inserted).
    IF TG_OP = 'UPDATE' THEN
        IF NOT EXISTS (SELECT FROM new_rows OFFSET 1)
           AND NOT EXISTS (SELECT FROM new_rows AS n, old_rows AS o WHERE o.id <> n.id) THEN
            PERFORM pg_notify('sandbox_execution_changed', '{"rows":['
                || retired_pod_gc_change_json(
                       'update', s.namespace, n.pod_name, n.active, n.execution_state)
                || ']}')
            FROM new_rows AS n
            JOIN old_rows AS o ON o.id = n.id
            LEFT JOIN sandboxes AS s ON s.id = n.sandbox_id
            WHERE o.active IS DISTINCT FROM n.active
               OR o.execution_state IS DISTINCT FROM n.execution_state;
            RETURN NULL;
        END IF;
        PERFORM pg_notify('sandbox_execution_changed', '{"rows":[' || string_agg(b.change, ',') || ']}')
        FROM (
            SELECT j.change,
                   retired_pod_gc_change_batch(
                       j.bytes,
                       sum(CASE WHEN j.bytes <= 512 THEN j.bytes + 1 ELSE 0 END)
                           OVER (ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW),
                       row_number() OVER ()) AS batch
            FROM (
                SELECT c.change, octet_length(c.change) AS bytes
                FROM (
                    SELECT retired_pod_gc_change_json(
                               u.op, s.namespace, u.pod_name, u.active, u.execution_state
                           ) AS change
                    FROM (
                        SELECT CASE WHEN o.id IS NULL THEN 'insert'
                                    WHEN n.id IS NULL THEN 'delete'
                                    ELSE 'update' END AS op,
                               CASE WHEN n.id IS NULL THEN o.sandbox_id
                                    ELSE n.sandbox_id END AS sandbox_id,
                               CASE WHEN n.id IS NULL THEN o.pod_name
                                    ELSE n.pod_name END AS pod_name,
                               CASE WHEN n.id IS NULL THEN o.active
                                    ELSE n.active END AS active,
                               CASE WHEN n.id IS NULL THEN o.execution_state
                                    ELSE n.execution_state END AS execution_state
                        FROM old_rows AS o
                        FULL JOIN new_rows AS n ON n.id = o.id
                        WHERE o.id IS NULL
                           OR n.id IS NULL
                           OR o.active IS DISTINCT FROM n.active
                           OR o.execution_state IS DISTINCT FROM n.execution_state
                        OFFSET 0  -- kept apart: the change's columns stay plain columns
                    ) AS u
                    LEFT JOIN sandboxes AS s ON s.id = u.sandbox_id
                    OFFSET 0  -- kept apart: each change is built once
                ) AS c
            ) AS j
        ) AS b
        GROUP BY b.batch;
    ELSIF TG_OP = 'INSERT' THEN
        IF NOT EXISTS (SELECT FROM new_rows OFFSET 1) THEN
            PERFORM pg_notify('sandbox_execution_changed', '{"rows":['
                || retired_pod_gc_change_json(
                       'insert', s.namespace, n.pod_name, n.active, n.execution_state)
                || ']}')
            FROM new_rows AS n
            LEFT JOIN sandboxes AS s ON s.id = n.sandbox_id;
            RETURN NULL;
        END IF;
        PERFORM pg_notify('sandbox_execution_changed', '{"rows":[' || string_agg(b.change, ',') || ']}')
        FROM (
            SELECT j.change,
                   retired_pod_gc_change_batch(
                       j.bytes,
                       sum(CASE WHEN j.bytes <= 512 THEN j.bytes + 1 ELSE 0 END)
                           OVER (ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW),
                       row_number() OVER ()) AS batch
            FROM (
                SELECT c.change, octet_length(c.change) AS bytes
                FROM (
                    SELECT retired_pod_gc_change_json(
                               'insert', s.namespace, n.pod_name, n.active, n.execution_state
                           ) AS change
                    FROM new_rows AS n
                    LEFT JOIN sandboxes AS s ON s.id = n.sandbox_id
                    OFFSET 0
                ) AS c
            ) AS j
        ) AS b
        GROUP BY b.batch;
    ELSE
        IF NOT EXISTS (SELECT FROM old_rows OFFSET 1) THEN
            PERFORM pg_notify('sandbox_execution_changed', '{"rows":['
                || retired_pod_gc_change_json(
                       'delete', s.namespace, o.pod_name, o.active, o.execution_state)
                || ']}')
            FROM old_rows AS o
            LEFT JOIN sandboxes AS s ON s.id = o.sandbox_id;
            RETURN NULL;
        END IF;
        PERFORM pg_notify('sandbox_execution_changed', '{"rows":[' || string_agg(b.change, ',') || ']}')
        FROM (
            SELECT j.change,
                   retired_pod_gc_change_batch(
                       j.bytes,
                       sum(CASE WHEN j.bytes <= 512 THEN j.bytes + 1 ELSE 0 END)
                           OVER (ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW),
                       row_number() OVER ()) AS batch
            FROM (
                SELECT c.change, octet_length(c.change) AS bytes
                FROM (
                    SELECT retired_pod_gc_change_json(
                               'delete', s.namespace, o.pod_name, o.active, o.execution_state
                           ) AS change
                    FROM old_rows AS o
                    LEFT JOIN sandboxes AS s ON s.id = o.sandbox_id
                    OFFSET 0
                ) AS c
            ) AS j
        ) AS b
        GROUP BY b.batch;
    END IF;
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
    EXECUTE FUNCTION retired_pod_gc_notify_executions_changed();

DROP TRIGGER IF EXISTS retired_pod_gc_executions_updated ON sandbox_k8s_executions;
CREATE TRIGGER retired_pod_gc_executions_updated
    AFTER UPDATE ON sandbox_k8s_executions
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT
    EXECUTE FUNCTION retired_pod_gc_notify_executions_changed();

DROP TRIGGER IF EXISTS retired_pod_gc_executions_deleted ON sandbox_k8s_executions;
CREATE TRIGGER retired_pod_gc_executions_deleted
    AFTER DELETE ON sandbox_k8s_executions
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT
    EXECUTE FUNCTION retired_pod_gc_notify_executions_changed();
