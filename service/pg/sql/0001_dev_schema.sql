-- retired-pod-gc: the development/test schema (version 0001).
--
-- Production owns its own schema; this file reproduces the columns the service reads so that
-- development and tests run against the same shapes. Applied only by
-- `retired-pod-gc migrate --with-schema`. Idempotent: every statement is IF NOT EXISTS.
--
-- No CHECK constraints on pod_kind or execution_state on purpose: the service must tolerate
-- values it does not know (they decode to an explicit "unknown" and are never reaped), and
-- the dev schema should not hide such rows from tests.

CREATE TABLE IF NOT EXISTS sandboxes (
    id          text PRIMARY KEY,
    namespace   text NOT NULL,
    managed_by  text NOT NULL
);

CREATE TABLE IF NOT EXISTS sandbox_k8s_executions (
    id                  bigserial PRIMARY KEY,
    sandbox_id          text NOT NULL REFERENCES sandboxes (id),
    generation          integer NOT NULL,
    activation_attempt  integer NOT NULL DEFAULT 0,
    pod_name            text NOT NULL,
    pod_kind            text NOT NULL,          -- 'create' | 'restore'
    execution_state     text NOT NULL,
    active              boolean NOT NULL,
    retired_at          timestamptz,
    CONSTRAINT sandbox_k8s_executions_pod_name_key UNIQUE (pod_name)
);

-- The batched lookup finds each asked key's pod name through the UNIQUE constraint above (its
-- index) and joins sandboxes on the primary key. This one serves the foreign key and
-- per-sandbox reads.
CREATE INDEX IF NOT EXISTS sandbox_k8s_executions_sandbox_id_idx
    ON sandbox_k8s_executions (sandbox_id, generation);
