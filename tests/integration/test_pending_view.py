"""The live view with the whole service in-process (the harness of ``test_engine_safety``) and
the CLI as real processes: ``GET /debug/pending`` and ``retired-pod-gc pending`` list exactly the
pods whose clocks run — not the pod whose row is active, not the kept pod — each due one
threshold after its clock started, and the DELETEs then come no sooner than those due times;
``explain --url`` shows one pod's entry. The view is served on the debug listener
(``DEBUG_BIND_ADDRESS``, loopback by default) and never on the metrics port, which answers 404 for
it. Off (the default), no debug listener is opened, the metrics port answers 404 and the CLI says
how to turn it on.

While ``pending`` runs, single-pod GETs fail (500): the verification cannot pass, so the clocks
keep running however long the processes take to start on a loaded machine; then the fault is
lifted.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.sandboxpods import Shape
from service.app.pending import PATH
from service.config import load
from service.domain import KEEP_ANNOTATION
from tests.e2e.harness import base_env, closed_port, run_cli_async, write_kubeconfig
from tests.integration.test_engine_safety import (
    NS,
    create_pod,
    deletes,
    eventually,
    running_service,
    seed_row,
)

pytestmark = pytest.mark.anyio
THRESHOLD_S = 2.0


async def _get(port: int) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}{PATH}") as response,
    ):
        body = await response.json() if response.status == 200 else await response.text()
        return response.status, body


def _ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


async def test_the_view_and_its_cli_list_exactly_the_running_clocks_and_deletes_match_them(
    tmp_path: Path, emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    due = {}
    for sandbox in ("pv1", "pv2", "pv3"):
        name = await seed_row(pg_conn, sandbox, active=False, state="suspended")
        due[f"{NS}/{name}"] = create_pod(emu, sandbox, Shape.SUCCEEDED)["metadata"]["uid"]
    stuck = await seed_row(pg_conn, "pv4", active=False, state="replaced")
    due[f"{NS}/{stuck}"] = create_pod(emu, "pv4", Shape.PENDING_STUCK)["metadata"]["uid"]
    active = await seed_row(pg_conn, "pv5", active=True, state="active")
    create_pod(emu, "pv5", Shape.SUCCEEDED)
    kept = await seed_row(pg_conn, "pv6", active=False, state="suspended")
    create_pod(emu, "pv6", Shape.SUCCEEDED)
    emu.patch_pod(NS, kept, {"metadata": {"annotations": {KEEP_ANNOTATION: "true"}}})
    env = base_env(
        kubeconfig=write_kubeconfig(tmp_path / "kc.yaml", emulator.url), database_url=pg_url
    )
    # The verification's GET fails until the CLI has looked: every clock keeps running.
    emu.fail_next(
        100_000, code=500, method="GET", path_contains=f"/namespaces/{NS}/pods/space-sbx-"
    )
    async with running_service(
        emulator, pg_url, THRESHOLD_SECONDS=THRESHOLD_S, DEBUG_PENDING=True
    ) as parts:
        port = parts.health.debug_bound_port
        assert port is not None
        await eventually(lambda: len(parts.clocks) == len(due), "every clock")
        status, doc = await _get(port)
        assert status == 200
        assert (doc["mode"], doc["active"], doc["threshold_s"]) == ("live", True, THRESHOLD_S)
        # exactly the running clocks: the service's own state, and the pods expected
        running = {o.key: o for o, _ in parts.clocks.running()}
        listed = {p["key"]: p for p in doc["pods"]}
        assert set(listed) == set(running) == set(due)
        assert doc["count"] == len(due)
        offset_s = time.time() - time.monotonic()
        for key, entry in listed.items():
            assert entry["uid"] == due[key] == running[key].uid
            assert entry["verdict"] == str(running[key].verdict)
            since_s, due_at_s = _ts(entry["observed_since"]), _ts(entry["due_at"])
            assert due_at_s - since_s == pytest.approx(THRESHOLD_S, abs=1e-5)
            assert since_s == pytest.approx(running[key].since_s + offset_s, abs=0.05)
            assert entry["waits_for"] in ("threshold", "verification")
        assert listed[f"{NS}/{stuck}"]["verdict"] == "replaced_never_started"

        url = f"http://127.0.0.1:{port}"
        table = await run_cli_async("pending", "--url", url, env=env)
        as_json = await run_cli_async("pending", "--url", url, "--output", "json", env=env)
        # still the same clocks (the verification cannot pass), and the CLI printed them
        assert {o.key for o, _ in parts.clocks.running()} == set(due)
        emu.clear_faults()

        assert table.code == 0, table.stderr
        # the clocks' table; the retired-but-kept one follows a blank line
        header, _columns, *rows = table.stdout.partition("\n\n")[0].splitlines()
        assert f"{len(due)} pods with a running clock" in header
        by_key = {row.split()[0]: row.split() for row in rows}
        assert set(by_key) == set(due)
        for key, cells in by_key.items():
            assert cells[1] == due[key]
            assert cells[4] == listed[key]["due_at"]
        assert as_json.code == 0, as_json.stderr
        cli_doc = json.loads(as_json.stdout)
        assert {p["key"]: p["due_at"] for p in cli_doc["pods"]} == {
            k: p["due_at"] for k, p in listed.items()
        }

        await eventually(lambda: all(deletes(emu, k.split("/")[1]) for k in due), "the DELETEs")
        await eventually(lambda: len(parts.clocks) == 0, "no clock left")
        status, after = await _get(port)
        assert (status, after["pods"]) == (200, [])
    for key in due:
        name = key.split("/")[1]
        [sent] = [d for d in deletes(emu, name) if d.status == 200]
        assert sent.time_s >= _ts(listed[key]["due_at"])
    assert deletes(emu, active) == [] and deletes(emu, kept) == []


async def test_explain_shows_the_live_clock_of_a_pod_and_none_for_a_kept_one(
    tmp_path: Path, emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    """In a dry run a reported pod's clock keeps running (it is reported once), so what
    ``explain --url`` prints can be compared with the view however long the process takes."""
    emu = emulator.emulator
    stuck = await seed_row(pg_conn, "ex1", active=False, state="replaced")
    uid = create_pod(emu, "ex1", Shape.PENDING_STUCK)["metadata"]["uid"]
    kept = await seed_row(pg_conn, "ex2", active=False, state="suspended")
    create_pod(emu, "ex2", Shape.SUCCEEDED)
    emu.patch_pod(NS, kept, {"metadata": {"annotations": {KEEP_ANNOTATION: "true"}}})
    env = base_env(
        kubeconfig=write_kubeconfig(tmp_path / "kc.yaml", emulator.url), database_url=pg_url
    )
    async with running_service(
        emulator, pg_url, THRESHOLD_SECONDS=1, DRY_RUN=True, DEBUG_PENDING=True
    ) as parts:
        port = parts.health.debug_bound_port
        assert port is not None
        url = f"http://127.0.0.1:{port}"
        await eventually(lambda: parts.clocks.was_reported(uid), "the dry-run report")
        status, doc = await _get(port)
        assert status == 200
        [entry] = doc["pods"]
        assert (entry["key"], entry["waits_for"]) == (f"{NS}/{stuck}", "reported")
        explained = await run_cli_async("explain", f"{NS}/{stuck}", "--url", url, env=env)
        explained_kept = await run_cli_async("explain", f"{NS}/{kept}", "--url", url, env=env)
        not_asked = await run_cli_async("explain", f"{NS}/{stuck}", env=env)
    assert explained.code == 0, explained.stderr
    [live] = [ln for ln in explained.stdout.splitlines() if ln.startswith("live clock")]
    assert live == (
        f"live clock ({url}): uid {uid} replaced_never_started, observed since "
        f"{entry['observed_since']}, due at {entry['due_at']} (in 0.0s), waits for reported"
    )
    assert explained_kept.code == 0, explained_kept.stderr
    assert "decision: skip keep_annotation" in explained_kept.stdout
    assert f"kubectl annotate pod -n {NS} {kept} {KEEP_ANNOTATION}-" in explained_kept.stdout
    assert f"live clock ({url}): none runs for this pod" in explained_kept.stdout
    assert not_asked.code == 0, not_asked.stderr
    assert "live clock: not asked" in not_asked.stdout


async def test_off_by_default_the_path_is_404_and_the_cli_says_how_to_turn_it_on_bad_limits_400(
    tmp_path: Path, emulator: RunningEmulator, pg_url: str
) -> None:
    env = base_env(
        kubeconfig=write_kubeconfig(tmp_path / "kc.yaml", emulator.url), database_url=pg_url
    )
    async with running_service(emulator, pg_url) as parts:
        port = parts.health.bound_port
        assert port is not None
        assert parts.health.debug_bound_port is None, "no debug listener when it is off"
        status, _ = await _get(port)
        assert status == 404
        off = await run_cli_async("pending", "--url", f"http://127.0.0.1:{port}", env=env)
        explained = await run_cli_async(
            "explain", f"{NS}/space-sbx-nope-g1", "--url", f"http://127.0.0.1:{port}", env=env
        )
    async with running_service(emulator, pg_url, DEBUG_PENDING=True) as parts:
        port = parts.health.debug_bound_port
        assert port is not None
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}{PATH}?limit=-1") as response,
        ):
            assert response.status == 400
            assert "limit" in await response.text()
    unreachable = await run_cli_async(
        "pending", "--url", f"http://127.0.0.1:{closed_port()}", env=env
    )
    assert off.code == 1
    assert "DEBUG_PENDING=true" in off.stderr and "Traceback" not in off.stderr
    assert len(off.stderr.strip().splitlines()) == 1
    assert explained.code == 0, explained.stderr
    assert "live clock: unknown" in explained.stdout and "404" in explained.stdout
    assert unreachable.code == 1
    assert "could not reach" in unreachable.stderr and "Traceback" not in unreachable.stderr


async def test_on_the_view_is_served_on_the_debug_listener_only_never_on_the_metrics_port(
    emulator: RunningEmulator, pg_url: str
) -> None:
    """``DEBUG_PENDING=true``: ``/debug/pending`` answers on ``DEBUG_BIND_ADDRESS`` (whose default
    is the loopback, which only ``kubectl port-forward`` reaches in a pod) and 404 on the metrics
    port, the one the Service and the NetworkPolicy expose; the debug listener serves nothing but
    ``/debug/``."""
    async with running_service(emulator, pg_url, DEBUG_PENDING=True) as parts:
        metrics_port, debug_port = parts.health.bound_port, parts.health.debug_bound_port
        assert metrics_port is not None and debug_port is not None
        assert metrics_port != debug_port
        on_metrics, _ = await _get(metrics_port)
        on_debug, doc = await _get(debug_port)
        async with aiohttp.ClientSession() as http:
            for path, port, expected in (
                ("/metrics", metrics_port, 200),
                ("/healthz", metrics_port, 200),
                ("/debug/", metrics_port, 404),
                ("/metrics", debug_port, 404),
                ("/healthz", debug_port, 404),
            ):
                async with http.get(f"http://127.0.0.1:{port}{path}") as response:
                    assert response.status == expected, (path, port)
    assert on_metrics == 404
    assert on_debug == 200 and doc["pods"] == []
    default = load({}).debug_host, load({}).debug_port
    assert default == ("127.0.0.1", 8081)
