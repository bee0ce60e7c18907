-- B13 candidate (benchmark only, never installed): row-level triggers whose WHEN lets only rows
-- inactive on either side through, each such row one NOTIFY of its own (0002's shape of work,
-- 0003's payload). A statement that writes only active rows runs no PL/pgSQL; a mass retirement
-- runs the function and sends a NOTIFY for every row. Measured by
-- `python -m benchmarks.trigger_instructions row_notify=benchmarks/b13_candidates/row_notify.sql`
-- and `python -m benchmarks.writers --trigger row_notify=...` (benchmarks/NOTES.md, B13).

CREATE OR REPLACE FUNCTION b13_row_notify() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
  IF TG_OP = 'DELETE' THEN
    PERFORM pg_notify('sandbox_execution_changed', retired_pod_gc_one_pod('delete', OLD.pod_name, OLD.active, OLD.execution_state));
  ELSE
    PERFORM pg_notify('sandbox_execution_changed', retired_pod_gc_one_pod(lower(TG_OP), NEW.pod_name, NEW.active, NEW.execution_state));
  END IF;
  RETURN NULL;
END $fn$;
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


CREATE TRIGGER b13_row_updated AFTER UPDATE ON sandbox_k8s_executions FOR EACH ROW
  WHEN ((OLD.active IS NOT TRUE OR NEW.active IS NOT TRUE)
        AND (OLD.active IS DISTINCT FROM NEW.active OR OLD.execution_state IS DISTINCT FROM NEW.execution_state))
  EXECUTE FUNCTION b13_row_notify();
CREATE TRIGGER b13_row_inserted AFTER INSERT ON sandbox_k8s_executions FOR EACH ROW
  WHEN (NEW.active IS NOT TRUE) EXECUTE FUNCTION b13_row_notify();
CREATE TRIGGER b13_row_deleted AFTER DELETE ON sandbox_k8s_executions FOR EACH ROW
  WHEN (OLD.active IS NOT TRUE) EXECUTE FUNCTION b13_row_notify();
