"""Several sandbox namespaces, end to end: the real ``retired-pod-gc`` process (``scan``,
``explain``, then ``run`` live) against the API emulator enforcing the RBAC of
``deploy/overlays/two-namespaces`` (a Role per namespace, nothing cluster-wide) and a real
PostgreSQL.

Two configured sandbox namespaces and a third one that is not: the retired pods of both are
reaped, one replica with one Lease and one delete budget; the third is never even asked about
(no request names it, no request spans every namespace), although its pods are as retired as the
others and its row changes reach the one listener (as changes of pod names that the configured
namespaces do not hold). A pod whose name's only row belongs to a
sandbox of the *other* configured namespace is never deleted: the row scopes to its own
namespace.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import asyncpg
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.rbac import RbacPolicy
from devtools.emulator.sandboxpods import Shape, pod_name, sandbox_pod
from devtools.pg.devdata import seed_execution, seed_sandbox, set_execution
from tests.deploy.rendering import render
from tests.deploy.support import OVERLAYS

from .harness import (
    LEASE_NAMESPACE,
    ServiceLauncher,
    lease_holder,
    parse_metrics,
    run_cli_async,
    sample,
    wait_until,
)

pytestmark = pytest.mark.anyio

A, B = "sandboxes", "sandboxes-b"
"""The two sandbox namespaces of ``deploy/overlays/two-namespaces``."""
C = "sandboxes-c"
"""A namespace with sandbox pods and rows that is not configured."""
THRESHOLD_S = 2.0
ENV = {"NAMESPACE": "", "NAMESPACES": f"{A},{B}"}


def key(namespace: str, sandbox_id: str) -> str:
    return f"{namespace}/{pod_name(sandbox_id, 1)}"


async def _seed(
    conn: asyncpg.Connection,
    emu: Any,
    *,
    namespace: str,
    sandbox_id: str,
    shape: Shape,
    state: str | None,
    row_namespace: str | None = None,
) -> None:
    """A pod of ``shape`` in ``namespace`` and, unless ``state`` is None, its sandbox (in
    ``row_namespace``, by default the pod's) and execution row (``active`` for ``state=active``)."""
    emu.create_pod(
        sandbox_pod(sandbox_id=sandbox_id, generation=1, shape=shape, namespace=namespace),
        namespace=namespace,
    )
    if state is None:
        return
    await seed_sandbox(conn, sandbox_id, namespace=row_namespace or namespace)
    await seed_execution(
        conn,
        pod_name=pod_name(sandbox_id, 1),
        sandbox_id=sandbox_id,
        execution_state=state,
        active=state == "active",
    )


def _pod_keys(emu: Any) -> set[str]:
    """Every pod that exists and is not terminating, as ``namespace/name``."""
    return {
        f"{ns}/{p['metadata']['name']}"
        for ns in (A, B, C)
        for p in emu.pods(ns)
        if not p["metadata"].get("deletionTimestamp")
    }


async def test_two_namespaces_are_reaped_and_a_third_is_never_touched(
    emulator: RunningEmulator, launcher: ServiceLauncher, pg_url: str
) -> None:
    emu = emulator.emulator
    for ns in (A, B, C, LEASE_NAMESPACE):
        emu.ensure_namespace(ns)
    # The API server now authorizes as the manifests grant: Roles in A, B and the Lease's
    # namespace, no ClusterRole (tests/deploy checks the render has none).
    emu.rbac = RbacPolicy(
        render(OVERLAYS["two-namespaces"]),
        namespace="retired-pod-gc",
        service_account="retired-pod-gc",
    )
    conn = await asyncpg.connect(pg_url)
    try:
        for ns, tag in ((A, "a"), (B, "b"), (C, "c")):
            await _seed(
                conn,
                emu,
                namespace=ns,
                sandbox_id=f"{tag}1",
                shape=Shape.SUCCEEDED,
                state="suspended",
            )
            await _seed(
                conn,
                emu,
                namespace=ns,
                sandbox_id=f"{tag}2",
                shape=Shape.PENDING_STUCK,
                state="replaced",
            )
            await _seed(
                conn,
                emu,
                namespace=ns,
                sandbox_id=f"{tag}run",
                shape=Shape.RUNNING,
                state="active",
            )
            # Terminal, still active: retired only once the service runs (a notification).
            await _seed(
                conn,
                emu,
                namespace=ns,
                sandbox_id=f"{tag}late",
                shape=Shape.SUCCEEDED,
                state="active",
            )
        # One pod name in A and in B; its only row is the sandbox's of B, retired.
        await _seed(conn, emu, namespace=A, sandbox_id="x", shape=Shape.SUCCEEDED, state=None)
        await _seed(
            conn, emu, namespace=B, sandbox_id="x", shape=Shape.SUCCEEDED, state="suspended"
        )
        reaped = {key(ns, s) for ns, t in ((A, "a"), (B, "b")) for s in (f"{t}1", f"{t}2")}
        reaped_late = {key(A, "alate"), key(B, "blate")}
        reaped_all = reaped | reaped_late | {key(B, "x")}
        everything = _pod_keys(emu)
        kept = everything - reaped_all
        assert {key(A, "x"), key(C, "c1"), key(C, "c2"), key(C, "clate")} <= kept

        # scan and explain cover every configured namespace, and only those.
        env = launcher.env(**ENV)
        scanned = await run_cli_async("scan", "--output", "json", env=env)
        assert scanned.code == 0, scanned.stderr
        report = json.loads(scanned.stdout)
        assert report["namespaces"] == [A, B]
        assert report["pods_by_namespace"] == {A: 5, B: 5}
        assert {c["pod"] for c in report["candidates"]} == reaped | {key(B, "x")}
        assert report["skips"]["no_row"] == 1  # A's pod of the shared name: B's row is not its
        explained = await run_cli_async("explain", key(A, "x"), env=env)
        assert explained.code == 0, explained.stderr
        assert "execution row: none in this namespace" in explained.stdout
        refused = await run_cli_async("explain", key(C, "c1"), env=env)
        assert refused.code == 1 and "not a configured sandbox namespace" in refused.stderr

        svc = launcher.start(
            "two-ns", ENABLED=True, DRY_RUN=False, THRESHOLD_SECONDS=THRESHOLD_S, **ENV
        )
        await svc.wait_for("/readyz", 200)
        await wait_until(lambda: lease_holder(emu) == "two-ns", timeout_s=20, what="the lease")
        # Retirements committed while the service runs reach it through the one listener; the
        # one of C too (a payload names pods, not namespaces), as the change of a pod name that
        # neither A nor B holds.
        for ns, tag in ((A, "a"), (B, "b"), (C, "c")):
            await set_execution(
                conn, pod_name(f"{tag}late", 1), active=False, execution_state="suspended"
            )
        await wait_until(lambda: not (_pod_keys(emu) & reaped_all), timeout_s=60, what="every reap")

        def pods_in(keys: set[str], ns: str) -> int:
            return len([k for k in keys if k.startswith(f"{ns}/")])

        def gone(k: str) -> bool:
            ns, name = k.split("/")
            return emu.get_pod(ns, name) is None

        async def settled() -> bool:
            """No clock runs (nothing left is on its way to a delete), every reaped pod is
            gone from the server and from the caches, and every Event is written."""
            text = await svc.metrics()
            return (
                sample(text, "retired_pod_gc_tracked_clocks") == 0
                and sample(text, "retired_pod_gc_notifications_total") >= 3
                and all(gone(k) for k in reaped_all)
                and all(
                    sample(text, "retired_pod_gc_cache_pods", sandbox_namespace=ns)
                    == pods_in(kept, ns)
                    and len(emu.events.events(ns, "reason=RetiredPodDeleted"))
                    == pods_in(reaped_all, ns)
                    for ns in (A, B)
                )
            )

        with anyio.fail_after(30):
            while not await settled():
                await anyio.sleep(0.1)
        text = await svc.metrics()
    finally:
        await conn.close()

    assert _pod_keys(emu) == kept
    deletes = emu.audit_log(method="DELETE")
    deleted = {f"{d.path.split('/')[4]}/{d.path.split('/')[6]}" for d in deletes}
    assert deleted == reaped_all
    assert len(deletes) == len(reaped_all)  # one DELETE each, under one budget
    # The third namespace was never asked about, and nothing spanned every namespace.
    paths = [r.path for r in emu.requests]
    assert not [p for p in paths if f"/namespaces/{C}/" in p or p.endswith(f"/namespaces/{C}")]
    assert "/api/v1/pods" not in paths
    # Everything the service and the CLI asked for was granted by the Roles.
    assert [(r.method, r.path) for r in emu.requests if r.status == 403] == []
    for ns in (A, B):
        assert sample(text, "retired_pod_gc_cache_synced", sandbox_namespace=ns) == 1
        assert sample(
            text, "retired_pod_gc_deletes_total", sandbox_namespace=ns, result="deleted"
        ) == len([k for k in reaped_all if k.startswith(f"{ns}/")])
    labelled = {
        labels.get("sandbox_namespace")
        for name, labels, _ in parse_metrics(text)
        if name.startswith(("retired_pod_gc_cache_", "retired_pod_gc_deletes"))
    }
    assert labelled == {A, B}
    # One Event per delete, each in the pod's own namespace.
    for ns in (A, B):
        regarding = sorted(
            f"{ns}/{e['regarding']['name']}"
            for e in emu.events.events(ns, "reason=RetiredPodDeleted")
        )
        assert regarding == sorted(k for k in reaped_all if k.startswith(f"{ns}/"))
    assert emu.events.events(C) == []
