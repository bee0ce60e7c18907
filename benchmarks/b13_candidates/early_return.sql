-- B13 candidate (benchmark only, never installed): statement-level triggers whose function first
-- asks, in one query over the transition tables, whether any row is inactive on either side, and
-- returns when none is. Measured as gated.sql is (benchmarks/NOTES.md, B13).
--
-- The helpers of this file's earlier texts (they built payloads with a namespace).
DROP FUNCTION IF EXISTS retired_pod_gc_change_json(text, text, text, boolean, text);
DROP FUNCTION IF EXISTS retired_pod_gc_change_batch(integer, bigint, bigint);
DROP FUNCTION IF EXISTS retired_pod_gc_one_change(text, text, text, boolean, text);
DROP FUNCTION IF EXISTS retired_pod_gc_group_head(text, text, boolean, text);

-- A group's opening, `[op,active,state,`, the state cut as 0002 cut it; its names follow as a
-- JSON array, then `]`. Inlined into the queries below.
CREATE OR REPLACE FUNCTION retired_pod_gc_pods_head(
    op text, active boolean, execution_state text
)
RETURNS text
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $fn$
    SELECT '["' || op || '",'
        || coalesce(active::text, 'null') || ','
        || coalesce(to_json(left(execution_state, 64))::text, 'null') || ','
$fn$;

-- The payload of one change: its group's opening, then its one name (cut to 253 characters).
CREATE OR REPLACE FUNCTION retired_pod_gc_one_pod(
    op text, pod_name text, active boolean, execution_state text
)
RETURNS text
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $fn$
    SELECT '{"pods":[' || retired_pod_gc_pods_head(op, active, execution_state)
        || '[' || coalesce(to_json(left(pod_name, 253))::text, 'null') || ']]]}'
$fn$;

-- Each event has its own query for the rows (transition tables allow one event per trigger,
-- and a query may name only the transition tables of its own trigger); each is one query for
-- the whole statement: the rows the service must hear of, grouped by (op, active, state), each
-- group's names cut into slices, and each slice's piece built (array_to_json escapes a slice's
-- names in C, with one type lookup for the slice). A slice of an array of texts is found by
-- walking the array from its start, so a group's names are first cut into blocks of 16 slices,
-- then each block into its slices: the walking grows with the statement's rows times their
-- number / (16 slices' names), not with that times the number of slices. The loop after them
-- packs the pieces into payloads (see the bound above). The grouping compares texts byte by
-- byte (COLLATE "C": no locale rules, and texts that a nondeterministic collation would call
-- equal stay apart).
--
-- The general query's plan does not rest on its estimates, which are guesses: transition tables
-- have no statistics (the join of old and new rows is estimated at 50 times its rows), a
-- generate_series over computed bounds is taken for 1,000 rows, so the general query of a
-- 10,000-row statement is estimated at billions of rows; and a plan is made once per session (on
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
-- Only the general query: the one-row path's queries are planned for one row (far below any
-- JIT threshold), and a setting on the function itself (`SET jit = off` in CREATE FUNCTION) is
-- set and restored on every call: 2-6 us more for every one-row statement, up to a tenth of the
-- trigger's time there (B7 trigger share). The values are put back in the writer's transaction
-- as they were (a SET LOCAL of the same value); if the query fails, the writer's transaction or
-- savepoint is aborted and takes them with it.
--
-- tests/integration/test_pg_trigger_plans.py checks that no query of the trigger is compiled
-- with JIT on Debian's PostgreSQL 15 with its defaults, and that none reads `sandboxes`.

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
    -- The early return (see the top of this file): nothing is inactive, nothing to send.
    IF TG_OP = 'UPDATE' THEN
        IF NOT EXISTS (SELECT FROM old_rows AS o WHERE o.active IS NOT TRUE
                       UNION ALL
                       SELECT FROM new_rows AS n WHERE n.active IS NOT TRUE) THEN
            RETURN NULL;
        END IF;
    ELSIF TG_OP = 'INSERT' THEN
        IF NOT EXISTS (SELECT FROM new_rows AS n WHERE n.active IS NOT TRUE) THEN
            RETURN NULL;
        END IF;
    ELSIF NOT EXISTS (SELECT FROM old_rows AS o WHERE o.active IS NOT TRUE) THEN
        RETURN NULL;
    END IF;
    -- A statement of one row (a single retirement: the common case here) is at most one
    -- change, one payload below 1,937 bytes: it skips the grouping, whose plan (hash join,
    -- aggregate, slices, a cursor) costs several times the whole query for one row. For an
    -- UPDATE also only when the row kept its id and pod name (else the general query reports
    -- the old row as deleted and the new one as inserted).
    IF TG_OP = 'UPDATE' THEN
        IF NOT EXISTS (SELECT FROM new_rows OFFSET 1)
           AND NOT EXISTS (SELECT FROM new_rows AS n, old_rows AS o
                           WHERE o.id <> n.id OR o.pod_name IS DISTINCT FROM n.pod_name) THEN
            PERFORM pg_notify('sandbox_execution_changed', retired_pod_gc_one_pod(
                       'update', n.pod_name, n.active, n.execution_state))
            FROM new_rows AS n
            JOIN old_rows AS o ON o.id = n.id
            WHERE (o.active IS NOT TRUE OR n.active IS NOT TRUE)
              AND (o.active IS DISTINCT FROM n.active
                   OR o.execution_state IS DISTINCT FROM n.execution_state);
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
                    SELECT retired_pod_gc_pods_head(c.op, c.active, c.state) AS head,
                           array_agg(c.pod_name) AS names,
                           greatest(1, (7700 - coalesce(octet_length(c.state), 0))
                                       / (max(octet_length(c.pod_name)) + 3)) AS k
                    FROM (
                        SELECT u.op, u.active, u.state COLLATE "C" AS state,
                               CASE WHEN octet_length(u.pod_name) <= 253 THEN u.pod_name
                                    ELSE left(u.pod_name, 253) END AS pod_name
                        FROM (
                            SELECT CASE WHEN o.id IS NULL THEN 'insert'
                                        WHEN n.id IS NULL THEN 'delete'
                                        ELSE 'update' END AS op,
                                   CASE WHEN n.id IS NULL THEN o.active
                                        ELSE n.active END AS active,
                                   CASE WHEN n.id IS NULL THEN o.execution_state
                                        ELSE n.execution_state END AS state,
                                   CASE WHEN n.id IS NULL THEN o.pod_name
                                        ELSE n.pod_name END AS pod_name
                            FROM old_rows AS o
                            FULL JOIN new_rows AS n ON n.id = o.id AND n.pod_name = o.pod_name
                            WHERE CASE WHEN o.id IS NULL THEN n.active IS NOT TRUE
                                       WHEN n.id IS NULL THEN o.active IS NOT TRUE
                                       ELSE (o.active IS NOT TRUE OR n.active IS NOT TRUE)
                                            AND (o.active IS DISTINCT FROM n.active
                                                 OR o.execution_state
                                                    IS DISTINCT FROM n.execution_state)
                                  END
                            OFFSET 0  -- kept apart: each change's columns are worked out once
                        ) AS u
                    ) AS c
                    GROUP BY c.op, c.active, c.state
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
            PERFORM pg_notify('sandbox_execution_changed', retired_pod_gc_one_pod(
                       'insert', n.pod_name, n.active, n.execution_state))
            FROM new_rows AS n
            WHERE n.active IS NOT TRUE;
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
                    SELECT retired_pod_gc_pods_head('insert', c.active, c.state) AS head,
                           array_agg(c.pod_name) AS names,
                           greatest(1, (7700 - coalesce(octet_length(c.state), 0))
                                       / (max(octet_length(c.pod_name)) + 3)) AS k
                    FROM (
                        SELECT n.active, n.execution_state COLLATE "C" AS state,
                               CASE WHEN octet_length(n.pod_name) <= 253 THEN n.pod_name
                                    ELSE left(n.pod_name, 253) END AS pod_name
                        FROM new_rows AS n
                        WHERE n.active IS NOT TRUE
                    ) AS c
                    GROUP BY c.active, c.state
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
            PERFORM pg_notify('sandbox_execution_changed', retired_pod_gc_one_pod(
                       'delete', o.pod_name, o.active, o.execution_state))
            FROM old_rows AS o
            WHERE o.active IS NOT TRUE;
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
                    SELECT retired_pod_gc_pods_head('delete', c.active, c.state) AS head,
                           array_agg(c.pod_name) AS names,
                           greatest(1, (7700 - coalesce(octet_length(c.state), 0))
                                       / (max(octet_length(c.pod_name)) + 3)) AS k
                    FROM (
                        SELECT o.active, o.execution_state COLLATE "C" AS state,
                               CASE WHEN octet_length(o.pod_name) <= 253 THEN o.pod_name
                                    ELSE left(o.pod_name, 253) END AS pod_name
                        FROM old_rows AS o
                        WHERE o.active IS NOT TRUE
                    ) AS c
                    GROUP BY c.active, c.state
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
    -- Packing (the bound above): each piece at most 7,988 bytes, else its names one by one.
    LOOP
        FETCH parts INTO part;
        EXIT WHEN NOT FOUND;
        IF octet_length(part.piece) <= 7988 THEN
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
                payload := '{"pods":[' || piece;
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

