-- retired-pod-gc: least-privilege database roles.
--
-- Run once per database, as a role that owns the two tables (or a superuser), e.g.
--   psql "$ADMIN_URL" -v ON_ERROR_STOP=1 -f deploy/db-role/role.sql
-- then give the login roles passwords out of band (never in this file):
--   psql "$ADMIN_URL" -c "\password retired_pod_gc"
-- Idempotent: roles are created only when missing; grants are repeatable.
--
-- Roles:
--   retired_pod_gc_reader     NOLOGIN  SELECT on sandboxes and sandbox_k8s_executions.
--   retired_pod_gc_canceller  NOLOGIN  UPDATE of (active, execution_state, retired_at) on
--                                      sandbox_k8s_executions: the one write of this project,
--                                      `retired-pod-gc cancel-create`'s fenced retire.
--   retired_pod_gc            LOGIN    The controller (`run`, `scan`, `explain`). Reader only,
--                                      and every transaction is read-only by default.
--   retired_pod_gc_operator   LOGIN    For humans or jobs running `cancel-create`: reader and
--                                      canceller. Not used by the Deployment.
--
-- LISTEN needs no privilege beyond CONNECT. Installing the trigger (`retired-pod-gc migrate`)
-- needs the table owner: run it with the admin URL, never with these roles.
-- Tables are expected in schema `public`; edit the schema name below if yours differ.

DO $roles$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'retired_pod_gc_reader') THEN
        CREATE ROLE retired_pod_gc_reader NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'retired_pod_gc_canceller') THEN
        CREATE ROLE retired_pod_gc_canceller NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'retired_pod_gc') THEN
        CREATE ROLE retired_pod_gc LOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'retired_pod_gc_operator') THEN
        CREATE ROLE retired_pod_gc_operator LOGIN;
    END IF;
    -- CONNECT is granted to PUBLIC by default; granted explicitly so that a database that
    -- revoked it from PUBLIC still works.
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO retired_pod_gc_reader', current_database());
END
$roles$;

-- The controller's login can never write, whatever a bug asks for. The connection limit bounds
-- what the replicas can open: each holds DB_POOL_SIZE (4) pooled connections plus one listener,
-- 3 replicas during a rolling update (maxSurge 1), plus headroom for `scan` / `explain`.
ALTER ROLE retired_pod_gc NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS
    CONNECTION LIMIT 24;
ALTER ROLE retired_pod_gc SET default_transaction_read_only = on;
-- The server gives up on a statement the service has given up on (DB_STATEMENT_TIMEOUT_SECONDS,
-- 5 s by default, is the client's bound). Set on the role, not sent by the client: a pooler such
-- as PgBouncer refuses a statement_timeout startup parameter.
ALTER ROLE retired_pod_gc SET statement_timeout = '5s';
ALTER ROLE retired_pod_gc_operator NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS
    CONNECTION LIMIT 4;

GRANT USAGE ON SCHEMA public TO retired_pod_gc_reader;
GRANT SELECT ON TABLE public.sandboxes, public.sandbox_k8s_executions TO retired_pod_gc_reader;

-- Column-level: the fenced retire sets exactly these three columns. Its WHERE and RETURNING
-- read other columns, which needs SELECT: the operator login also holds the reader role.
GRANT UPDATE (active, execution_state, retired_at) ON TABLE public.sandbox_k8s_executions
    TO retired_pod_gc_canceller;

GRANT retired_pod_gc_reader TO retired_pod_gc;
GRANT retired_pod_gc_reader, retired_pod_gc_canceller TO retired_pod_gc_operator;
