-- B7 floor (benchmark only, never installed): the changed rows found (old and new matched by id, active or execution_state
-- compared) and each one's pod name sent as a NOTIFY of its own: no namespace, no grouping, no
-- JSON. The least a trigger that reports which rows changed costs.
-- Measured beside the shipped trigger by `python -m benchmarks.run --only B7 --b7-trigger FILE`
-- (benchmarks/NOTES.md, "B7 trigger share"): its UPDATE trigger alone, as 0003's.
CREATE OR REPLACE FUNCTION retired_pod_gc_notify_executions_changed()
RETURNS trigger
LANGUAGE plpgsql
AS $fn$
BEGIN
    PERFORM pg_notify('sandbox_execution_changed', n.pod_name)
    FROM new_rows AS n
    JOIN old_rows AS o ON o.id = n.id
    WHERE o.active IS DISTINCT FROM n.active
       OR o.execution_state IS DISTINCT FROM n.execution_state;
    RETURN NULL;
END
$fn$;

DROP TRIGGER IF EXISTS retired_pod_gc_executions_updated ON sandbox_k8s_executions;
CREATE TRIGGER retired_pod_gc_executions_updated
    AFTER UPDATE ON sandbox_k8s_executions
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT
    EXECUTE FUNCTION retired_pod_gc_notify_executions_changed();
