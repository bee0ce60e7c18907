-- retired-pod-gc: the change-notify trigger production must install (version 0003).
--
-- Replaces 0002 in place: 0002's per-row triggers and their function are dropped, and three
-- statement-level triggers take their place. Every statement that inserts or deletes
-- sandbox_k8s_executions rows, or updates rows so that `active` or `execution_state` changes,
-- sends as few NOTIFYs as its changes fit in, on the channel named in the trigger function.
-- `retired-pod-gc migrate` substitutes the configured channel for the default literal
-- 'sandbox_execution_changed' below (five pg_notify calls); applied by hand (psql -f) it uses
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
-- Each payload is a JSON object holding a batch of changes, grouped by what they share:
--   {"groups": [[op, namespace, active, execution_state, [pod_name, ...]], ...]}
-- each pod name of a group with its group's op, namespace, active and execution_state: the
-- facts 0002 sent per row. op "insert" | "update" | "delete", active true | false | null, the
-- texts possibly null (no sandboxes row) and cut to 253, 253 and 64 characters as in 0002. A
-- delete carries the deleted row's values. A mass retirement has few distinct (op, namespace,
-- active, state), so a payload is mostly pod names (about 21 bytes a change instead of 0003's
-- first form, `{"rows": [[op, namespace, pod_name, active, state], ...]}`, about 60).
-- Which group comes first, and the order of the names, says nothing.
--
-- Why no payload can reach PostgreSQL's limit (a payload of 8000 bytes or more makes pg_notify
-- raise, which would abort the writer's transaction). A payload is `{"groups":[` (11 bytes),
-- pieces separated by commas, `]}` (2 bytes); a piece is one group, or part of one, with some
-- of its names: `[op,namespace,active,state,[name,...]]`.
--   * a piece of one name is at most 3,447 bytes: JSON escaping turns a character into at most
--     6 bytes (\u001f; a character of any server encoding is at most 4 bytes as is), so the
--     namespace and the pod name are each at most 2 + 253 * 6 = 1,520 bytes with their quotes,
--     the state 2 + 64 * 6 = 386, the op 8 ("update" quoted), active 5 (false), plus 4
--     brackets and 4 commas: 1,520 + 1,520 + 386 + 8 + 5 + 8 = 3,447;
--   * a statement of one row sends its one change alone: at most 11 + 3,447 + 2 = 3,460 bytes;
--   * otherwise the changes are grouped and each group's names cut into slices, as many names
--     a slice as should make a piece of about 7,700 bytes if nothing needs escaping. A piece is
--     built, then measured: one longer than 7,986 bytes is not used, its names go as pieces of
--     one name each instead (at most 3,447 bytes, above). So no piece exceeds 7,986 bytes;
--   * pieces are packed in turn: a piece joins the payload being filled only if the payload
--     stays below 8,000 bytes with it and the closing `]}`, else that payload is sent first and
--     the piece starts the next one (alone: 11 + 7,986 + 2 = 7,999 bytes at most). Every
--     payload is checked by its exact length (octet_length, bytes of the server encoding)
--     before pg_notify sees it.
-- tests/integration/test_pg_listener.py sends worst-case rows (long names made of characters
-- JSON escapes to 6 bytes, multibyte text, many rows) through this file and checks it.
--
-- Idempotent: CREATE OR REPLACE FUNCTION, DROP ... IF EXISTS, then the triggers are created
-- again (all in the one transaction `migrate` runs this file in). `migrate` records the file by
-- its checksum: a database migrated with an earlier text of this file gets it applied again, in
-- place, by the next `migrate` (service/pg/migrate.py), so a change here is this step's new
-- version, not a new step.

-- The first form of this file's helpers (one change as JSON text, its batch number).
DROP FUNCTION IF EXISTS retired_pod_gc_change_json(text, text, text, boolean, text);
DROP FUNCTION IF EXISTS retired_pod_gc_change_batch(integer, bigint, bigint);

-- A group's opening, `[op,namespace,active,state,`, the texts cut as 0002 cut them; its names
-- follow as a JSON array, then `]`. Inlined into the queries below.
CREATE OR REPLACE FUNCTION retired_pod_gc_group_head(
    op text, namespace text, active boolean, execution_state text
)
RETURNS text
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $fn$
    SELECT '["' || op || '",'
        || coalesce(to_json(left(namespace, 253))::text, 'null') || ','
        || coalesce(active::text, 'null') || ','
        || coalesce(to_json(left(execution_state, 64))::text, 'null') || ','
$fn$;

-- A piece of one change: its group's opening, then its one name (cut to 253 characters).
CREATE OR REPLACE FUNCTION retired_pod_gc_one_change(
    op text, namespace text, pod_name text, active boolean, execution_state text
)
RETURNS text
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $fn$
    SELECT retired_pod_gc_group_head(op, namespace, active, execution_state)
        || '[' || coalesce(to_json(left(pod_name, 253))::text, 'null') || ']]'
$fn$;

-- Each event has its own query for the rows (transition tables allow one event per trigger,
-- and a query may name only the transition tables of its own trigger); each is one query for
-- the whole statement: the rows the service must hear of, their namespaces (from `sandboxes`,
-- below), grouped by (op, namespace, active, state), each group's names cut into slices, and
-- each slice's piece built (array_to_json escapes a slice's names in C, with one type lookup
-- for the slice). A slice of an array of texts is found by walking the array from its start,
-- so a group's names are first cut into blocks of 16 slices, then each block into its slices:
-- the walking grows with the statement's rows times their number / (16 slices' names), not
-- with that times the number of slices. The loop after them packs the pieces into payloads
-- (see the bound above). The grouping compares texts byte by byte (COLLATE "C": no locale
-- rules, and texts that a nondeterministic collation would call equal stay apart).
--
-- The general query's plan does not rest on its estimates, which are guesses: transition tables
-- have no statistics (the join of old and new rows is estimated at 50 times its rows), a
-- generate_series over computed bounds is taken for 1,000 rows, so the general query of a
-- 10,000-row statement is estimated at 80 billion rows; and a plan is made once per session (on
-- first use, again only after an invalidation) and kept, so it could fit only the statement it
-- was made for. Three settings hold while the general query is planned and run
-- (`set_config(..., true)`, the values found put back after it):
--   * jit off: the query is never compiled with JIT, whatever the server's settings. The planner
--     decides on JIT by estimated cost (jit_above_cost, 100,000 by default); a server built with
--     JIT (PGDG's and Debian's packages, on by default) compiled this query on every run: about
--     300-900 ms of compilation for a query that runs in 10-15 ms. Correcting the estimates would
--     not be enough: the cost grows with the statement's rows, which the writer decides, and an
--     operator may lower jit_above_cost. JIT pays off for long scans evaluating the same
--     expressions over millions of rows; the time here goes to hashing, array building and JSON
--     text, which JIT does not compile.
--   * enable_mergejoin off: an UPDATE's old and new rows are matched by a hash join. For these
--     estimates the planner takes a merge join, which sorts both transition tables first: about
--     a quarter of the trigger's CPU time for a 10,000-row statement, more than the hash join.
--   * enable_sort off: the changes are grouped by hashing them (a handful of groups). For some
--     estimates the planner sorts them all and groups them in order, which costs more.
-- Only the general query: the one-row path's queries are planned for one row (a probe of
-- `sandboxes` by its key, far below any JIT threshold), and a setting on the function itself
-- (`SET jit = off` in CREATE FUNCTION) is set and restored on every call: 2-6 us more for every
-- one-row statement, up to a tenth of the trigger's time there (B7 trigger share). The values
-- are put back in the writer's transaction as they were (a SET LOCAL of the same value); if
-- the query fails, the writer's transaction or savepoint is aborted and takes them with it.
--
-- `sandboxes` is read whole or probed by its key, whichever this statement needs less. The table
-- grows with the sandboxes ever made, not with the executions one statement changes. Reading it
-- whole (a hash of it, then one lookup a change) costs about 0.3 us a sandboxes row; probing
-- its key (an index scan a change) 1.5-2 us a change, growing only with the depth of the index
-- (CPU profiles on Debian's 15, benchmarks/NOTES.md). Each general query has both forms, UNION
-- ALL, each behind a one-time filter (evaluated once a run; the other form does not run): the
-- hash when the statement has more rows than a fifth of the rows `sandboxes` has, the probes
-- otherwise; the two cost about the same at a fifth (measured: 49,000 and 51,000 sandboxes
-- beside a 10,000-row statement). The table's rows are its statistics' count (pg_class.reltuples,
-- kept current by autovacuum's ANALYZE; a table never analyzed, -1, is probed); the statement's
-- rows are counted only up to that fifth (a scan of the transition table that stops there). So
-- the namespaces cost a statement at most about 2 us a change, however many rows `sandboxes`
-- has. `id` is the key of `sandboxes` (the service's own lookups probe it too). The probe's
-- subquery is kept apart (OFFSET 0), else the planner would turn it back into a join and could
-- hash the whole table.
--
-- tests/integration/test_pg_trigger_plans.py checks that no query of the trigger is compiled
-- with JIT on Debian's PostgreSQL 15 with its defaults, that a statement of 1,000 rows beside
-- 20,000 sandboxes probes their key once a change, and that one as large as `sandboxes` reads
-- the table once.
CREATE OR REPLACE FUNCTION retired_pod_gc_notify_executions_changed()
RETURNS trigger
LANGUAGE plpgsql
AS $fn$
DECLARE
    parts refcursor;
    part record;
    pieces text[];
    piece text;
    payload text := '';
    settings_before text[];
BEGIN
    -- A statement of one row (a single retirement, a new execution: the common case) is one
    -- change, one payload below 3,460 bytes: it skips the grouping, whose plan (hash join,
    -- aggregate, slices, a cursor) costs several times the whole query for one row. For an
    -- UPDATE also only when the row kept its id (else the general query reports the old id as
    -- deleted and the new one as inserted).
    IF TG_OP = 'UPDATE' THEN
        IF NOT EXISTS (SELECT FROM new_rows OFFSET 1)
           AND NOT EXISTS (SELECT FROM new_rows AS n, old_rows AS o WHERE o.id <> n.id) THEN
            PERFORM pg_notify('sandbox_execution_changed', '{"groups":['
                || retired_pod_gc_one_change(
                       'update', s.namespace, n.pod_name, n.active, n.execution_state)
                || ']}')
            FROM new_rows AS n
            JOIN old_rows AS o ON o.id = n.id
            LEFT JOIN sandboxes AS s ON s.id = n.sandbox_id
            WHERE o.active IS DISTINCT FROM n.active
               OR o.execution_state IS DISTINCT FROM n.execution_state;
            RETURN NULL;
        END IF;
        settings_before := ARRAY[current_setting('jit'), current_setting('enable_mergejoin'),
                                 current_setting('enable_sort')];
        PERFORM set_config('jit', 'off', true), set_config('enable_mergejoin', 'off', true),
                set_config('enable_sort', 'off', true);
        OPEN parts FOR
            SELECT p.head, p.names, p.head || array_to_json(p.names)::text || ']' AS piece
            FROM (
                SELECT g.head, b.names[i : i + g.k - 1] AS names
                FROM (
                    SELECT retired_pod_gc_group_head(c.op, c.namespace, c.active, c.state)
                               AS head,
                           array_agg(c.pod_name) AS names,
                           greatest(1, (7700 - coalesce(octet_length(c.namespace), 0)
                                             - coalesce(octet_length(c.state), 0))
                                       / (max(octet_length(c.pod_name)) + 3)) AS k
                    FROM (
                        SELECT u.op, s.namespace COLLATE "C" AS namespace, u.active,
                               u.execution_state COLLATE "C" AS state,
                               CASE WHEN octet_length(u.pod_name) <= 253 THEN u.pod_name
                                    ELSE left(u.pod_name, 253) END AS pod_name
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
                        -- hashed whole: the statement has more rows than reltuples / 5 (above)
                        WHERE EXISTS (
                            SELECT FROM new_rows OFFSET (
                                SELECT CASE WHEN t.reltuples >= 0 THEN (t.reltuples / 5)::bigint
                                            ELSE 9223372036854775807 END
                                FROM pg_class AS t WHERE t.oid = 'sandboxes'::regclass))
                        UNION ALL
                        SELECT u.op, s.namespace COLLATE "C" AS namespace, u.active,
                               u.execution_state COLLATE "C" AS state,
                               CASE WHEN octet_length(u.pod_name) <= 253 THEN u.pod_name
                                    ELSE left(u.pod_name, 253) END AS pod_name
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
                        LEFT JOIN LATERAL (
                            SELECT s.namespace FROM sandboxes AS s WHERE s.id = u.sandbox_id
                            OFFSET 0  -- kept apart: one probe a change
                        ) AS s ON true
                        -- else probed by its key
                        WHERE NOT EXISTS (
                            SELECT FROM new_rows OFFSET (
                                SELECT CASE WHEN t.reltuples >= 0 THEN (t.reltuples / 5)::bigint
                                            ELSE 9223372036854775807 END
                                FROM pg_class AS t WHERE t.oid = 'sandboxes'::regclass))
                    ) AS c
                    GROUP BY c.op, c.namespace, c.active, c.state
                ) AS g,
                LATERAL (
                    SELECT g.names[j : j + 16 * g.k - 1] AS names
                    FROM generate_series(1, cardinality(g.names), 16 * g.k) AS j
                    OFFSET 0  -- kept apart: each block is cut once
                ) AS b,
                generate_series(1, cardinality(b.names), g.k) AS i
                OFFSET 0  -- kept apart: each slice is cut once
            ) AS p;
    ELSIF TG_OP = 'INSERT' THEN
        IF NOT EXISTS (SELECT FROM new_rows OFFSET 1) THEN
            PERFORM pg_notify('sandbox_execution_changed', '{"groups":['
                || retired_pod_gc_one_change(
                       'insert', s.namespace, n.pod_name, n.active, n.execution_state)
                || ']}')
            FROM new_rows AS n
            LEFT JOIN sandboxes AS s ON s.id = n.sandbox_id;
            RETURN NULL;
        END IF;
        settings_before := ARRAY[current_setting('jit'), current_setting('enable_mergejoin'),
                                 current_setting('enable_sort')];
        PERFORM set_config('jit', 'off', true), set_config('enable_mergejoin', 'off', true),
                set_config('enable_sort', 'off', true);
        OPEN parts FOR
            SELECT p.head, p.names, p.head || array_to_json(p.names)::text || ']' AS piece
            FROM (
                SELECT g.head, b.names[i : i + g.k - 1] AS names
                FROM (
                    SELECT retired_pod_gc_group_head('insert', c.namespace, c.active, c.state)
                               AS head,
                           array_agg(c.pod_name) AS names,
                           greatest(1, (7700 - coalesce(octet_length(c.namespace), 0)
                                             - coalesce(octet_length(c.state), 0))
                                       / (max(octet_length(c.pod_name)) + 3)) AS k
                    FROM (
                        SELECT s.namespace COLLATE "C" AS namespace, n.active,
                               n.execution_state COLLATE "C" AS state,
                               CASE WHEN octet_length(n.pod_name) <= 253 THEN n.pod_name
                                    ELSE left(n.pod_name, 253) END AS pod_name
                        FROM new_rows AS n
                        LEFT JOIN sandboxes AS s ON s.id = n.sandbox_id
                        -- hashed whole: the statement has more rows than reltuples / 5 (above)
                        WHERE EXISTS (
                            SELECT FROM new_rows OFFSET (
                                SELECT CASE WHEN t.reltuples >= 0 THEN (t.reltuples / 5)::bigint
                                            ELSE 9223372036854775807 END
                                FROM pg_class AS t WHERE t.oid = 'sandboxes'::regclass))
                        UNION ALL
                        SELECT s.namespace COLLATE "C" AS namespace, n.active,
                               n.execution_state COLLATE "C" AS state,
                               CASE WHEN octet_length(n.pod_name) <= 253 THEN n.pod_name
                                    ELSE left(n.pod_name, 253) END AS pod_name
                        FROM new_rows AS n
                        LEFT JOIN LATERAL (
                            SELECT s.namespace FROM sandboxes AS s WHERE s.id = n.sandbox_id
                            OFFSET 0  -- kept apart: one probe a change
                        ) AS s ON true
                        -- else probed by its key
                        WHERE NOT EXISTS (
                            SELECT FROM new_rows OFFSET (
                                SELECT CASE WHEN t.reltuples >= 0 THEN (t.reltuples / 5)::bigint
                                            ELSE 9223372036854775807 END
                                FROM pg_class AS t WHERE t.oid = 'sandboxes'::regclass))
                    ) AS c
                    GROUP BY c.namespace, c.active, c.state
                ) AS g,
                LATERAL (
                    SELECT g.names[j : j + 16 * g.k - 1] AS names
                    FROM generate_series(1, cardinality(g.names), 16 * g.k) AS j
                    OFFSET 0
                ) AS b,
                generate_series(1, cardinality(b.names), g.k) AS i
                OFFSET 0
            ) AS p;
    ELSE
        IF NOT EXISTS (SELECT FROM old_rows OFFSET 1) THEN
            PERFORM pg_notify('sandbox_execution_changed', '{"groups":['
                || retired_pod_gc_one_change(
                       'delete', s.namespace, o.pod_name, o.active, o.execution_state)
                || ']}')
            FROM old_rows AS o
            LEFT JOIN sandboxes AS s ON s.id = o.sandbox_id;
            RETURN NULL;
        END IF;
        settings_before := ARRAY[current_setting('jit'), current_setting('enable_mergejoin'),
                                 current_setting('enable_sort')];
        PERFORM set_config('jit', 'off', true), set_config('enable_mergejoin', 'off', true),
                set_config('enable_sort', 'off', true);
        OPEN parts FOR
            SELECT p.head, p.names, p.head || array_to_json(p.names)::text || ']' AS piece
            FROM (
                SELECT g.head, b.names[i : i + g.k - 1] AS names
                FROM (
                    SELECT retired_pod_gc_group_head('delete', c.namespace, c.active, c.state)
                               AS head,
                           array_agg(c.pod_name) AS names,
                           greatest(1, (7700 - coalesce(octet_length(c.namespace), 0)
                                             - coalesce(octet_length(c.state), 0))
                                       / (max(octet_length(c.pod_name)) + 3)) AS k
                    FROM (
                        SELECT s.namespace COLLATE "C" AS namespace, o.active,
                               o.execution_state COLLATE "C" AS state,
                               CASE WHEN octet_length(o.pod_name) <= 253 THEN o.pod_name
                                    ELSE left(o.pod_name, 253) END AS pod_name
                        FROM old_rows AS o
                        LEFT JOIN sandboxes AS s ON s.id = o.sandbox_id
                        -- hashed whole: the statement has more rows than reltuples / 5 (above)
                        WHERE EXISTS (
                            SELECT FROM old_rows OFFSET (
                                SELECT CASE WHEN t.reltuples >= 0 THEN (t.reltuples / 5)::bigint
                                            ELSE 9223372036854775807 END
                                FROM pg_class AS t WHERE t.oid = 'sandboxes'::regclass))
                        UNION ALL
                        SELECT s.namespace COLLATE "C" AS namespace, o.active,
                               o.execution_state COLLATE "C" AS state,
                               CASE WHEN octet_length(o.pod_name) <= 253 THEN o.pod_name
                                    ELSE left(o.pod_name, 253) END AS pod_name
                        FROM old_rows AS o
                        LEFT JOIN LATERAL (
                            SELECT s.namespace FROM sandboxes AS s WHERE s.id = o.sandbox_id
                            OFFSET 0  -- kept apart: one probe a change
                        ) AS s ON true
                        -- else probed by its key
                        WHERE NOT EXISTS (
                            SELECT FROM old_rows OFFSET (
                                SELECT CASE WHEN t.reltuples >= 0 THEN (t.reltuples / 5)::bigint
                                            ELSE 9223372036854775807 END
                                FROM pg_class AS t WHERE t.oid = 'sandboxes'::regclass))
                    ) AS c
                    GROUP BY c.namespace, c.active, c.state
                ) AS g,
                LATERAL (
                    SELECT g.names[j : j + 16 * g.k - 1] AS names
                    FROM generate_series(1, cardinality(g.names), 16 * g.k) AS j
                    OFFSET 0
                ) AS b,
                generate_series(1, cardinality(b.names), g.k) AS i
                OFFSET 0
            ) AS p;
    END IF;
    -- Packing (the bound above): each piece at most 7,986 bytes, else its names one by one.
    LOOP
        FETCH parts INTO part;
        EXIT WHEN NOT FOUND;
        IF octet_length(part.piece) <= 7986 THEN
            pieces := ARRAY[part.piece];
        ELSE
            pieces := ARRAY(
                SELECT part.head || '[' || coalesce(to_json(name)::text, 'null') || ']]'
                FROM unnest(part.names) AS name);
        END IF;
        FOREACH piece IN ARRAY pieces LOOP
            IF payload <> '' AND octet_length(payload) + 1 + octet_length(piece) + 2 >= 8000 THEN
                PERFORM pg_notify('sandbox_execution_changed', payload || ']}');
                payload := '';
            END IF;
            IF payload = '' THEN
                payload := '{"groups":[' || piece;
            ELSE
                payload := payload || ',' || piece;
            END IF;
        END LOOP;
    END LOOP;
    CLOSE parts;
    PERFORM set_config('jit', settings_before[1], true),
            set_config('enable_mergejoin', settings_before[2], true),
            set_config('enable_sort', settings_before[3], true);
    IF payload <> '' THEN
        PERFORM pg_notify('sandbox_execution_changed', payload || ']}');
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
