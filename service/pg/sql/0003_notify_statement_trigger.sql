-- retired-pod-gc: the change-notify trigger production must install (version 0003).
--
-- Replaces 0002 in place: 0002's triggers and their function are dropped. Three triggers send the
-- changes a statement made that can start or stop a clock, in as few NOTIFYs as they fit in, on
-- the channel named in the trigger function.
-- `retired-pod-gc migrate` substitutes the configured channel for the default literal
-- 'sandbox_execution_changed' below (five pg_notify calls); applied by hand (psql -f) it uses
-- the default. A literal rather than a trigger argument: the function's queries then have no
-- parameters, so each is planned once per session (a query with parameters is planned again for
-- each of its first runs, which a one-row statement would pay every time).
--
-- What is sent: exactly the changes that can start or stop an observation clock
-- (docs/architecture.md, "The change notifications"). A clock runs only for a pod whose
-- execution is inactive, so a change is sent when the row is inactive on either side of it:
--   * INSERT of a row whose `active` is not true (false or null): "insert", the new values;
--   * DELETE of a row whose `active` is not true: "delete", the deleted values;
--   * UPDATE of a row inactive before or after it, that changes `active` or `execution_state`:
--     a retirement, a re-activation, a change of state while inactive: "update", the new
--     values. Old and new rows are matched by (`id`, `pod_name`): a row whose id or pod name
--     changed is reported as a delete of the old row and an insert of the new one, each under
--     the rule for its own side.
-- The platform's common writes (inserts of active executions, changes of active ones) send
-- nothing. That matters beyond the trigger's own time: a transaction that sent a NOTIFY takes a
-- database-wide lock at commit and holds it through its commit's WAL flush, so such
-- transactions commit one at a time (docs/operations.md, "What the trigger costs the writers").
--
-- Row level, one call a statement. A statement-level trigger runs for every statement: its call
-- and a first query over the statement's rows cost the platform's one-row writes a fifth of their
-- throughput with many writers at once (benchmarks/NOTES.md, B13). So each event's trigger is FOR
-- EACH ROW with a WHEN that reads only the row's `active`: a statement that wrote only active
-- rows queues no call and runs no PL/pgSQL. Each row the WHEN lets through queues one call, run
-- after the statement. The function reads the whole statement's rows from the transition tables
-- (a row-level trigger may have them too), so the statement's first call sends all of its
-- changes, in batches, and sets a transaction-local counter, `retired_pod_gc.calls_left_<event>_
-- <trigger depth>`, to the number of the statement's other calls; each of those only counts down.
-- The count is exact, so the counter is back at zero when the statement's last call returns and
-- the next statement's first call sends again. Keyed by the event, the calls of one statement
-- that fires two of the triggers (INSERT ... ON CONFLICT DO UPDATE, MERGE), which come
-- interleaved, count apart; keyed by the trigger depth, so do those of a statement run from
-- inside another's trigger; a rolled-back savepoint takes the counter back with its rows. A mass
-- retirement pays one call a row for this (benchmarks/NOTES.md, B13i).
--
-- Why batches: a trigger that builds a payload and calls pg_notify once per changed row makes a
-- mass retirement cost the writer several times the UPDATE itself and sends one NOTIFY per row.
-- Here the rows a statement changed are read from its transition tables once and sent in batches.
--
-- NOTIFY is transactional: listeners see the payloads only after the writer commits.
-- Each payload is a JSON object holding a batch of changes, grouped by what they share:
--   {"pods": [[op, active, execution_state, [pod_name, ...]], ...]}
-- each pod name of a group with its group's op, active and execution_state. op "insert" |
-- "update" | "delete", active true | false | null, the texts possibly null and cut to 64 and
-- 253 characters as in 0002. A delete carries the deleted row's values. Which group comes
-- first, and the order of the names, says nothing. A mass retirement has few distinct (op,
-- active, state), so a payload is mostly pod names (about 21 bytes a change).
--
-- Why no namespace. A payload names pods, not their namespace: the namespace is a column of
-- `sandboxes`, and finding it costs the writer a lookup per changed row in a table that grows
-- with every sandbox ever made, not with the statement (benchmarks/NOTES.md, B7 trigger share).
-- The service knows which namespaces it watches, and `pod_name` is unique: it applies a change
-- to the pod of that name in each of them (service/pg/listener.py), and checks the pod's
-- namespace against the row's when it re-reads the row, as it always does.
--
-- Why no payload can reach PostgreSQL's limit (a payload of 8000 bytes or more makes pg_notify
-- raise, which would abort the writer's transaction). A payload is `{"pods":[` (9 bytes),
-- pieces separated by commas, `]}` (2 bytes); a piece is one group, or part of one, with some
-- of its names: `[op,active,state,[name,...]]`.
--   * a piece of one name is at most 1,926 bytes: JSON escaping turns a character into at most
--     6 bytes (\u001f; a character of any server encoding is at most 4 bytes as is), so the
--     pod name is at most 2 + 253 * 6 = 1,520 bytes with its quotes, the state 2 + 64 * 6 =
--     386, the op 8 ("update" quoted), active 5 (false), plus 4 brackets and 3 commas:
--     1,520 + 386 + 8 + 5 + 7 = 1,926;
--   * a statement of one row sends its one change alone: at most 9 + 1,926 + 2 = 1,937 bytes;
--   * otherwise the changes are grouped and each group's names cut into slices, as many names
--     a slice as should make a piece of about 7,700 bytes if nothing needs escaping. A piece is
--     built, then measured: one longer than 7,988 bytes is not used, its names go as pieces of
--     one name each instead (at most 1,926 bytes, above). So no piece exceeds 7,988 bytes;
--   * pieces are packed in turn: a piece joins the payload being filled only if the payload
--     stays below 8,000 bytes with it and the closing `]}`, else that payload is sent first and
--     the piece starts the next one (alone: 9 + 7,988 + 2 = 7,999 bytes at most). Every
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
    -- The calls of the statement still to come at this trigger depth (see the top of this file).
    calls_left_name text;
    calls_left integer;
    unused text;
BEGIN
    -- A later call of a statement whose changes an earlier call sent: count it, nothing else.
    -- This path runs once a row of a mass retirement, so it is kept to three assignments (simple
    -- expressions: no query); the first call's variables are declared in the block below it.
    calls_left_name := 'retired_pod_gc.calls_left_' || TG_OP || '_' || pg_trigger_depth();
    calls_left := nullif(current_setting(calls_left_name, true), '');
    IF calls_left > 0 THEN
        unused := set_config(calls_left_name, (calls_left - 1)::text, true);
        RETURN NULL;
    END IF;
    DECLARE
        calls bigint;
        inactive bigint;
        parts refcursor;
        part record;
        pieces text[];
        piece text;
        payload text := '';
        settings_before text[];
    BEGIN
        -- The first call: the statement makes one call for each row its trigger's WHEN let through;
        -- the others only count down. An UPDATE's old and new rows are kept in the same order, one
        -- pair a row, so when neither side alone is inactive in every row they are paired by their
        -- place in the transition tables.
        IF TG_OP = 'UPDATE' THEN
            SELECT count(*), count(*) FILTER (WHERE n.active IS NOT TRUE) INTO calls, inactive
            FROM new_rows AS n;
            IF inactive < calls THEN
                SELECT count(*) FILTER (WHERE o.active IS NOT TRUE) INTO inactive
                FROM old_rows AS o;
            END IF;
            IF inactive < calls THEN
                SELECT count(*) INTO calls
                FROM (SELECT row_number() OVER () AS k, o.active FROM old_rows AS o) AS o
                JOIN (SELECT row_number() OVER () AS k, n.active FROM new_rows AS n) AS n
                    ON n.k = o.k
                WHERE o.active IS NOT TRUE OR n.active IS NOT TRUE;
            END IF;
        ELSIF TG_OP = 'INSERT' THEN
            SELECT count(*) INTO calls FROM new_rows AS n WHERE n.active IS NOT TRUE;
        ELSE
            SELECT count(*) INTO calls FROM old_rows AS o WHERE o.active IS NOT TRUE;
        END IF;
        IF calls > 1 THEN
            unused := set_config(calls_left_name, (calls - 1)::text, true);
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
                IF payload <> ''
                   AND octet_length(payload) + 1 + octet_length(piece) + 2 >= 8000 THEN
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
    END;
END
$fn$;

-- 0002's per-row triggers and their function.
DROP TRIGGER IF EXISTS retired_pod_gc_execution_inserted_deleted ON sandbox_k8s_executions;
DROP TRIGGER IF EXISTS retired_pod_gc_execution_updated ON sandbox_k8s_executions;
DROP FUNCTION IF EXISTS retired_pod_gc_notify_execution_changed();

-- Transition tables allow one event per trigger: three triggers. Each WHEN reads only the row's
-- columns: PostgreSQL parses and compiles it for every statement, cheaply without a function.
DROP TRIGGER IF EXISTS retired_pod_gc_executions_inserted ON sandbox_k8s_executions;
CREATE TRIGGER retired_pod_gc_executions_inserted
    AFTER INSERT ON sandbox_k8s_executions
    REFERENCING NEW TABLE AS new_rows
    FOR EACH ROW
    WHEN (NEW.active IS NOT TRUE)
    EXECUTE FUNCTION retired_pod_gc_notify_executions_changed();

DROP TRIGGER IF EXISTS retired_pod_gc_executions_updated ON sandbox_k8s_executions;
CREATE TRIGGER retired_pod_gc_executions_updated
    AFTER UPDATE ON sandbox_k8s_executions
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH ROW
    WHEN (OLD.active IS NOT TRUE OR NEW.active IS NOT TRUE)
    EXECUTE FUNCTION retired_pod_gc_notify_executions_changed();

DROP TRIGGER IF EXISTS retired_pod_gc_executions_deleted ON sandbox_k8s_executions;
CREATE TRIGGER retired_pod_gc_executions_deleted
    AFTER DELETE ON sandbox_k8s_executions
    REFERENCING OLD TABLE AS old_rows
    FOR EACH ROW
    WHEN (OLD.active IS NOT TRUE)
    EXECUTE FUNCTION retired_pod_gc_notify_executions_changed();

