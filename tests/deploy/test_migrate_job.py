"""The migrate Job (deploy/migrate): renders with the real kustomize, validates, is hardened as the
Deployment, and its container, run as rendered, installs the trigger in a real PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg
import kubernetes_validate
import pytest

from devtools.pg.throwaway import run_async
from service import config
from service.pg.migrate import TRIGGER_STEP
from tests.deploy.rendering import Obj, render
from tests.deploy.support import (
    DEPLOY,
    ROOT,
    container,
    container_env,
    migrate_job_bounds,
    of_kind,
    only,
)
from tests.pgfixtures import PgServer

MIGRATE = DEPLOY / "migrate"
K8S_VERSIONS = sorted({"1.29.0", "1.36.0", kubernetes_validate.latest_version()})


@pytest.fixture(scope="module")
def migrate_objects() -> list[Obj]:
    return render(MIGRATE)


def pod_spec(obj: Obj) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def test_renders_the_job_its_config_and_its_network_policy(migrate_objects: list[Obj]) -> None:
    assert sorted(o["kind"] for o in migrate_objects) == ["ConfigMap", "Job", "NetworkPolicy"]
    assert {o["metadata"]["namespace"] for o in migrate_objects} == {"retired-pod-gc"}
    job = only(migrate_objects, "Job")
    assert pod_spec(job)["restartPolicy"] == "Never"
    # Never --with-schema: that creates the development schema.
    assert container(job)["args"] == ["migrate"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates(migrate_objects: list[Obj], version: str) -> None:
    for obj in migrate_objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_hardened_as_the_deployment(migrate_objects: list[Obj], base_objects: list[Obj]) -> None:
    job, deployment = only(migrate_objects, "Job"), only(base_objects, "Deployment")
    job_pod, controller_pod = pod_spec(job), pod_spec(deployment)
    migrate, controller = container(job), container(deployment)
    assert job_pod["securityContext"] == controller_pod["securityContext"]
    assert migrate["securityContext"] == controller["securityContext"]
    assert migrate["securityContext"]["readOnlyRootFilesystem"] is True
    assert migrate["image"] == controller["image"]
    assert migrate["imagePullPolicy"] == controller["imagePullPolicy"]
    # It never talks to the API server: no token, no service links.
    assert job_pod["automountServiceAccountToken"] is False
    assert job_pod["enableServiceLinks"] is False
    assert "serviceAccountName" not in job_pod
    resources = migrate["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert set(resources["limits"]) == {"memory"}  # no CPU limit, as the controller
    assert job["spec"]["backoffLimit"] >= 1 and job["spec"]["activeDeadlineSeconds"] > 0
    assert not any(
        "hostPath" in v or "hostNetwork" in v or "hostPID" in v for v in job_pod["volumes"]
    )
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(job_pod)


def test_the_job_outlasts_every_run_it_allows_and_stops_at_a_lock_not_granted(
    migrate_objects: list[Obj],
) -> None:
    """activeDeadlineSeconds never cuts a run short of its own message (the holders named), and
    is no more than a minute above what the runs need; exit 3 fails the Job at once."""
    active_s, needed_s = migrate_job_bounds(migrate_objects)
    assert needed_s <= active_s < needed_s + 60


def test_the_admin_url_comes_from_its_own_secret_as_a_file(
    migrate_objects: list[Obj], base_objects: list[Obj]
) -> None:
    job = only(migrate_objects, "Job")
    env = container_env(job, of_kind(migrate_objects, "ConfigMap"))
    assert config.DATABASE_URL.name not in env
    path = Path(env[config.DATABASE_URL_FILE.name])
    mounts = {m["name"]: m for m in container(job)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(job)["volumes"]}
    (mount,) = [m for m in mounts.values() if Path(m["mountPath"]) == path.parent]
    assert mount["readOnly"] is True
    secret = volumes[mount["name"]]["secret"]
    controller_secret = next(
        v["secret"]["secretName"]
        for v in pod_spec(only(base_objects, "Deployment"))["volumes"]
        if "secret" in v
    )
    assert secret["secretName"] == "retired-pod-gc-database-admin" != controller_secret
    assert secret["items"] == [{"key": "url", "path": path.name}]
    assert secret["defaultMode"] == 0o440
    assert "optional" not in secret
    # No URL anywhere in the rendered objects.
    assert "postgresql://" not in str(migrate_objects)


def test_notify_channel_is_the_deployments(
    migrate_objects: list[Obj], base_objects: list[Obj]
) -> None:
    job_env = container_env(only(migrate_objects, "Job"), of_kind(migrate_objects, "ConfigMap"))
    controller_env = container_env(
        only(base_objects, "Deployment"), of_kind(base_objects, "ConfigMap")
    )
    name = config.NOTIFY_CHANNEL.name
    assert job_env[name] == controller_env[name]


def test_network_policy_selects_the_job_and_allows_only_dns_and_postgresql(
    migrate_objects: list[Obj],
) -> None:
    policy = only(migrate_objects, "NetworkPolicy")
    labels = only(migrate_objects, "Job")["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= labels.items() and "app.kubernetes.io/component" in selector
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert policy["spec"]["ingress"] == []
    ports = {(p["port"], p["protocol"]) for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert ports == {(53, "UDP"), (53, "TCP"), (5432, "TCP")}


async def _tables_only(url: str) -> None:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await conn.execute((DEPLOY / "sql" / "0001_dev_schema.sql").read_text())
    finally:
        await conn.close()


async def _installed(url: str) -> tuple[list[str], list[str]]:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        steps = await conn.fetch("SELECT name FROM retired_pod_gc_migrations ORDER BY name")
        triggers = await conn.fetch(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'sandbox_k8s_executions'::regclass"
            " AND NOT tgisinternal ORDER BY tgname"
        )
    finally:
        await conn.close()
    return [r["name"] for r in steps], [r["tgname"] for r in triggers]


def test_the_rendered_container_installs_the_trigger(
    migrate_objects: list[Obj], pg_server: PgServer, tmp_path: Path
) -> None:
    """The Job's command and environment, as rendered (the Secret file written where the Job
    mounts it), against a database holding only the tables: exit 0, the trigger installed."""
    job = only(migrate_objects, "Job")
    env = container_env(job, of_kind(migrate_objects, "ConfigMap"))
    url = pg_server.create_database("rpg_deploy_migrate_job")
    try:
        run_async(lambda: _tables_only(url))
        url_file = tmp_path / "url"
        url_file.write_text(url + "\n")
        result = subprocess.run(
            [sys.executable, "-m", "service.cli", *container(job)["args"]],
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
            | env
            | {config.DATABASE_URL_FILE.name: str(url_file)},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        steps, triggers = run_async(lambda: _installed(url))
        assert steps == [TRIGGER_STEP]
        assert triggers, "no trigger on sandbox_k8s_executions"
    finally:
        pg_server.drop_database("rpg_deploy_migrate_job")


def test_operations_shows_the_job_and_its_secret(migrate_objects: list[Obj]) -> None:
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    job = only(migrate_objects, "Job")
    secret = next(v["secret"]["secretName"] for v in pod_spec(job)["volumes"] if "secret" in v)
    assert f"generic {secret}" in text
    assert "kubectl apply -k deploy/migrate" in text
    assert f"job/{job['metadata']['name']}" in text
