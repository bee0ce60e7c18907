"""The Table form of pods: the emulator's answer to ``kubectl get pods`` compared with the real
server's (tests/fixtures/wire/list-pods-table.json, get-pod-table.json), and the real kubectl
printing it (READY, STATUS, RESTARTS, AGE)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devtools.emulator import Emulator, RunningEmulator
from devtools.emulator.sandboxpods import Shape, sandbox_pod
from devtools.emulator.tables import event_row, human_duration, wants_table
from tests.kubectl import KubectlCluster

NS = "sandboxes"
WIRE = Path(__file__).parent.parent / "fixtures" / "wire"
# What `kubectl get pods` sends (the wire sample's note).
KUBECTL_ACCEPT = (
    "application/json;as=Table;v=v1;g=meta.k8s.io,"
    "application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json"
)
T0 = 1_796_300_000.0


def sample(name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((WIRE / name).read_text())["body"]
    return body


class SteppedClock:
    """Wall-clock seconds the test sets (creation timestamps and AGE from the same clock)."""

    def __init__(self) -> None:
        self.now_s = T0

    def __call__(self) -> float:
        return self.now_s


CLOCK = SteppedClock()


@pytest.fixture
def emulator_options() -> dict[str, object]:
    CLOCK.now_s = T0
    return {"bookmark_interval_s": 0.2, "history_size": 10_000, "clock": CLOCK}


def without_ip(pod: dict[str, Any]) -> dict[str, Any]:
    pod["status"].pop("podIP", None)
    pod["status"].pop("podIPs", None)
    return pod


def seed_like_the_sample(emu: Emulator, clock: SteppedClock) -> None:
    """The three pods of the wire sample: a Succeeded one and a ContainerCreating one created a
    second before the request, a Running one with one restart created at the request's second."""
    emu.create_pod(
        without_ip(sandbox_pod(sandbox_id="idle0001", generation=1, shape=Shape.SUCCEEDED)),
        namespace=NS,
    )
    emu.create_pod(
        sandbox_pod(sandbox_id="roll0001", generation=2, shape=Shape.PENDING_STUCK), namespace=NS
    )
    clock.now_s += 1
    live = sandbox_pod(sandbox_id="live0001", generation=1, shape=Shape.RUNNING)
    live["status"]["podIP"] = "10.244.0.7"
    live["status"]["podIPs"] = [{"ip": "10.244.0.7"}]
    live["status"]["containerStatuses"][0]["restartCount"] = 1
    emu.create_pod(live, namespace=NS)


async def get_json(url: str, accept: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, headers={"Accept": accept}) as response,
    ):
        return response.status, json.loads(await response.read())


def sorted_rows(table: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(table["rows"], key=lambda row: row["cells"][0])


@pytest.mark.anyio
async def test_list_table_matches_the_real_server(emulator: RunningEmulator) -> None:
    seed_like_the_sample(emulator.emulator, CLOCK)
    status, table = await get_json(
        f"{emulator.url}/api/v1/namespaces/{NS}/pods?limit=500", KUBECTL_ACCEPT
    )
    expected = sample("list-pods-table.json")
    assert status == 200
    assert (table["kind"], table["apiVersion"]) == (expected["kind"], expected["apiVersion"])
    assert table["columnDefinitions"] == expected["columnDefinitions"]
    assert set(table["metadata"]) == set(expected["metadata"])
    rows, expected_rows = sorted_rows(table), sorted_rows(expected)
    assert [r["cells"] for r in rows] == [r["cells"] for r in expected_rows]
    assert [r.get("conditions") for r in rows] == [r.get("conditions") for r in expected_rows]
    for row, want in zip(rows, expected_rows, strict=True):
        assert set(row) == set(want)
        assert (row["object"]["kind"], row["object"]["apiVersion"]) == (
            want["object"]["kind"],
            want["object"]["apiVersion"],
        )
        pod = emulator.emulator.get_pod(NS, row["cells"][0])
        assert pod is not None
        assert row["object"]["metadata"] == pod["metadata"]
        assert "spec" not in row["object"] and "status" not in row["object"]


@pytest.mark.anyio
async def test_one_pod_table_matches_the_real_server(emulator: RunningEmulator) -> None:
    seed_like_the_sample(emulator.emulator, CLOCK)
    status, table = await get_json(
        f"{emulator.url}/api/v1/namespaces/{NS}/pods/space-sbx-live0001-g1", KUBECTL_ACCEPT
    )
    expected = sample("get-pod-table.json")
    assert status == 200
    assert table["columnDefinitions"] == expected["columnDefinitions"]
    assert [r["cells"] for r in table["rows"]] == [r["cells"] for r in expected["rows"]]
    pod = emulator.emulator.get_pod(NS, "space-sbx-live0001-g1")
    assert pod is not None
    assert table["metadata"] == {"resourceVersion": pod["metadata"]["resourceVersion"]}


@pytest.mark.anyio
async def test_include_object_and_pages(emulator: RunningEmulator) -> None:
    seed_like_the_sample(emulator.emulator, CLOCK)
    base = f"{emulator.url}/api/v1/namespaces/{NS}/pods"
    _, full = await get_json(f"{base}?includeObject=Object", KUBECTL_ACCEPT)
    assert {r["object"]["kind"] for r in full["rows"]} == {"Pod"}
    assert all("status" in r["object"] for r in full["rows"])
    _, bare = await get_json(f"{base}?includeObject=None", KUBECTL_ACCEPT)
    assert [r["object"] for r in bare["rows"]] == [None, None, None]
    status, bad = await get_json(f"{base}?includeObject=Everything", KUBECTL_ACCEPT)
    assert (status, bad["reason"]) == (400, "BadRequest")

    _, page1 = await get_json(f"{base}?limit=2", KUBECTL_ACCEPT)
    assert len(page1["rows"]) == 2 and page1["metadata"]["remainingItemCount"] == 1
    _, page2 = await get_json(
        f"{base}?limit=2&continue={page1['metadata']['continue']}", KUBECTL_ACCEPT
    )
    names = [r["cells"][0] for r in page1["rows"] + page2["rows"]]
    assert sorted(names) == sorted(p["metadata"]["name"] for p in emulator.emulator.pods(NS))

    status, plain = await get_json(base, "application/json")
    assert (status, plain["kind"]) == (200, "PodList")


@pytest.mark.parametrize(
    ("accept", "table"),
    [
        (KUBECTL_ACCEPT, True),
        ("application/json;as=Table;g=meta.k8s.io;v=v1", True),
        ("application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json", False),
        ("application/json", False),
        ("", False),
    ],
)
def test_wants_table(accept: str, table: bool) -> None:
    assert wants_table(accept) is table


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-5, "<invalid>"),
        (-1, "0s"),
        (0, "0s"),
        (119, "119s"),
        (120, "2m"),
        (190, "3m10s"),
        (70 * 60, "70m"),
        (3 * 3600 + 7 * 60, "3h7m"),
        (8 * 3600, "8h"),
        (47 * 3600, "47h"),
        (49 * 3600, "2d1h"),
        (8 * 24 * 3600 + 2 * 3600, "8d"),
        (367 * 24 * 3600, "367d"),
        ((365 * 2 * 24 + 25) * 3600, "2y1d"),
        ((365 * 8 * 24 + 2) * 3600, "8y"),
    ],
)
def test_age_is_written_as_kubectl_writes_it(seconds: int, text: str) -> None:
    assert human_duration(seconds) == text


def columns(stdout: str) -> tuple[list[str], dict[str, list[str]]]:
    """Header words and each row's cells of kubectl's table output (columns split on 2+ spaces)."""
    lines = stdout.strip().splitlines()
    header = re.split(r"\s{2,}", lines[0].strip())
    rows = {}
    for line in lines[1:]:
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells[1:]
    return header, rows


def test_kubectl_get_pods_shows_ready_status_restarts_age(kubectl_cluster: KubectlCluster) -> None:
    def seed(emu: Emulator) -> None:
        for name, shape in (
            ("stuck", Shape.PENDING_STUCK),
            ("withip", Shape.PENDING_WITH_IP),
            ("live", Shape.RUNNING),
            ("idle", Shape.SUCCEEDED),
            ("failed", Shape.FAILED),
        ):
            pod = sandbox_pod(sandbox_id=name, generation=1, shape=shape)
            if name == "live":
                pod["status"]["containerStatuses"][0]["restartCount"] = 2
            emu.create_pod(pod, namespace=NS)

    kubectl_cluster.call(seed)
    header, rows = columns(kubectl_cluster.run("get", "pods", "-n", NS).stdout)
    assert header == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert {name: cells[:3] for name, cells in rows.items()} == {
        "space-sbx-stuck-g1": ["0/1", "ContainerCreating", "0"],
        "space-sbx-withip-g1": ["0/1", "ContainerCreating", "0"],
        "space-sbx-live-g1": ["1/1", "Running", "2"],
        "space-sbx-idle-g1": ["0/1", "Completed", "0"],
        "space-sbx-failed-g1": ["0/1", "Error", "0"],
    }
    assert all(cells[3].endswith("s") for cells in rows.values()), rows

    header, rows = columns(kubectl_cluster.run("get", "pods", "-n", NS, "-o", "wide").stdout)
    assert header[5:] == ["IP", "NODE", "NOMINATED NODE", "READINESS GATES"]
    assert rows["space-sbx-stuck-g1"][4:] == ["<none>", "node-a", "<none>", "<none>"]
    assert rows["space-sbx-live-g1"][4:6] == ["10.0.0.10", "node-a"]

    # A graceful delete of a node-bound pod leaves it Terminating until its kubelet finishes.
    kubectl_cluster.run("delete", "pod", "space-sbx-live-g1", "-n", NS, "--wait=false")
    _, rows = columns(kubectl_cluster.run("get", "pod", "space-sbx-live-g1", "-n", NS).stdout)
    assert rows["space-sbx-live-g1"][:2] == ["1/1", "Terminating"]


def test_kubectl_watch_prints_the_columns_for_every_event(kubectl_cluster: KubectlCluster) -> None:
    kubectl_cluster.call(
        lambda emu: emu.create_pod(sandbox_pod(sandbox_id="a", generation=1), namespace=NS)
    )
    proc = subprocess.Popen(
        [str(kubectl_cluster.kubectl), "get", "pods", "-n", NS, "-w"],
        env=kubectl_cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
        assert re.split(r"\s{2,}", proc.stdout.readline().strip())[:3] == [
            "space-sbx-a-g1",
            "1/1",
            "Running",
        ]
        # The watch starts at the list's resourceVersion: this event reaches it whenever it runs.
        kubectl_cluster.call(
            lambda emu: emu.create_pod(
                sandbox_pod(sandbox_id="b", generation=1, shape=Shape.SUCCEEDED), namespace=NS
            )
        )
        assert re.split(r"\s{2,}", proc.stdout.readline().strip())[:4] == [
            "space-sbx-b-g1",
            "0/1",
            "Completed",
            "0",
        ]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.anyio
async def test_a_table_watch_sends_one_row_tables_and_bookmarks_unchanged(
    emulator: RunningEmulator,
) -> None:
    emulator.emulator.create_pod(sandbox_pod(sandbox_id="a", generation=1), namespace=NS)
    url = (
        f"{emulator.url}/api/v1/namespaces/{NS}/pods?watch=1&resourceVersion=0"
        "&allowWatchBookmarks=true&timeoutSeconds=1"
    )
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, headers={"Accept": KUBECTL_ACCEPT}) as response,
    ):
        events = [json.loads(line) async for line in response.content if line.strip()]
    added = [e for e in events if e["type"] == "ADDED"]
    assert len(added) == 1
    table = added[0]["object"]
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]][:5] == [
        "Name",
        "Ready",
        "Status",
        "Restarts",
        "Age",
    ]
    assert [r["cells"][:3] for r in table["rows"]] == [["space-sbx-a-g1", "1/1", "Running"]]
    assert {e["object"]["kind"] for e in events if e["type"] == "BOOKMARK"} <= {"Pod"}


def test_event_rows_follow_the_event_printer() -> None:
    now = T0 + 90
    single = {
        "metadata": {"name": "space-sbx-a-g1.18eccb7e70eb139a"},
        "involvedObject": {"kind": "Pod", "name": "space-sbx-a-g1"},
        "reason": "RetiredPodDeleted",
        "message": " deleted \n",
        "type": "Normal",
        "firstTimestamp": None,
        "lastTimestamp": None,
        "eventTime": "2026-12-03T12:13:20.123456Z",  # T0
        "reportingComponent": "example.com/retired-pod-gc",
        "reportingInstance": "retired-pod-gc-abc12",
        "source": {},
    }
    assert event_row(single, now_s=now)["cells"] == [
        "90s",
        "Normal",
        "RetiredPodDeleted",
        "pod/space-sbx-a-g1",
        "",
        "example.com/retired-pod-gc, retired-pod-gc-abc12",
        "deleted",
        "90s",
        1,
        "space-sbx-a-g1.18eccb7e70eb139a",
    ]
    series = single | {
        "series": {"count": 4, "lastObservedTime": "2026-12-03T12:14:20.000000Z"},
        "reportingInstance": "",
    }
    cells = event_row(series, now_s=now)["cells"]
    assert (cells[0], cells[5], cells[7], cells[8]) == (
        "30s",
        "example.com/retired-pod-gc",
        "90s",
        4,
    )
