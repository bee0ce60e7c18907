-- retired-pod-gc: the change-notify trigger production must install (version 0002).
--
-- Every insert and delete of a sandbox_k8s_executions row, and every update that changes
-- `active` or `execution_state`, sends one NOTIFY on the channel given as the trigger argument
-- (TG_ARGV[0]). `retired-pod-gc migrate` substitutes the configured channel for the default
-- literal 'sandbox_execution_changed' below; applied by hand (psql -f) it uses the default.
--
-- NOTIFY is transactional: listeners see the payload only after the writer commits.
-- The payload is a small JSON object:
--   {"op": "insert"|"update"|"delete", "namespace": ..., "pod_name": ...,
--    "active": true|false|null, "execution_state": ...|null}
-- Each text field is cut to a fixed length so the payload stays far below PostgreSQL's
-- 8000-byte NOTIFY limit whatever the row holds (an oversized payload would make pg_notify
-- raise and abort the writer's transaction).
--
-- Idempotent: CREATE OR REPLACE FUNCTION, then the triggers are dropped if present and
-- created again (all in the one transaction `migrate` runs this file in).

CREATE OR REPLACE FUNCTION retired_pod_gc_notify_execution_changed()
RETURNS trigger
LANGUAGE plpgsql
AS $fn$
DECLARE
    row_data   sandbox_k8s_executions%ROWTYPE;
    sandbox_ns text;
BEGIN
    IF TG_OP = 'DELETE' THEN
        row_data := OLD;
    ELSE
        row_data := NEW;
    END IF;
    SELECT s.namespace INTO sandbox_ns FROM sandboxes s WHERE s.id = row_data.sandbox_id;
    PERFORM pg_notify(
        TG_ARGV[0],
        json_build_object(
            'op', lower(TG_OP),
            'namespace', left(sandbox_ns, 253),
            'pod_name', left(row_data.pod_name, 253),
            'active', row_data.active,
            'execution_state', left(row_data.execution_state, 64)
        )::text
    );
    RETURN NULL;
END
$fn$;

DROP TRIGGER IF EXISTS retired_pod_gc_execution_inserted_deleted ON sandbox_k8s_executions;
CREATE TRIGGER retired_pod_gc_execution_inserted_deleted
    AFTER INSERT OR DELETE ON sandbox_k8s_executions
    FOR EACH ROW
    EXECUTE FUNCTION retired_pod_gc_notify_execution_changed('sandbox_execution_changed');

DROP TRIGGER IF EXISTS retired_pod_gc_execution_updated ON sandbox_k8s_executions;
CREATE TRIGGER retired_pod_gc_execution_updated
    AFTER UPDATE OF active, execution_state ON sandbox_k8s_executions
    FOR EACH ROW
    WHEN (OLD.active IS DISTINCT FROM NEW.active
          OR OLD.execution_state IS DISTINCT FROM NEW.execution_state)
    EXECUTE FUNCTION retired_pod_gc_notify_execution_changed('sandbox_execution_changed');
