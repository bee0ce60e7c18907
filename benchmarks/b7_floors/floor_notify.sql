-- B7 floor (benchmark only, never installed): one NOTIFY of a constant, nothing read: the least a trigger that notifies costs.
-- Measured beside the shipped trigger by `python -m benchmarks.run --only B7 --b7-trigger FILE`
-- (benchmarks/NOTES.md, "B7 trigger share"): its UPDATE trigger alone, as 0003's.
CREATE OR REPLACE FUNCTION retired_pod_gc_notify_executions_changed()
RETURNS trigger
LANGUAGE plpgsql
AS $fn$
BEGIN
    PERFORM pg_notify('sandbox_execution_changed', 'x');
    RETURN NULL;
END
$fn$;

DROP TRIGGER IF EXISTS retired_pod_gc_executions_updated ON sandbox_k8s_executions;
CREATE TRIGGER retired_pod_gc_executions_updated
    AFTER UPDATE ON sandbox_k8s_executions
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT
    EXECUTE FUNCTION retired_pod_gc_notify_executions_changed();
