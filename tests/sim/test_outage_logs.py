"""A ten-minute outage costs a few log lines and a few hundred attempts, not one a key or a retry.

Each scenario of ``tests/sim/outage.py`` — the whole service on the simulator's models, 10,000 or
more reapable pods cached, a database black-holed or an API server refusing every connection for ten
minutes of virtual time, then back — runs in a subprocess of its own (outside the suite's coverage
tracing, which would triple its time; the two at once), and prints every line the ``service``
loggers wrote at the default level from the outage's start on, but the deletes' summary lines (one a
minute at most, counted apart), with the metrics at the end. Judged here: at most 20 lines; every
line of a recurring failure is a change of its cause or its recovery, and says how many failures it
stands for; every other line is a transition that happens once (leadership, the listener's
reconnect); the metrics counted at least the failures the lines name; the dependency that was down
was sent a few hundred requests in those ten minutes, not one a key a backoff step (the engine backs
off from it as one, ``service/kit/gate.py``); and every pod was deleted afterwards, each with its
Event.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from service.engine.gates import DEPENDENCY_BACKOFF_MAX_S
from tests.sim.outage import OUTAGE_S, PODS, PROBE_EVERY_S

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 20
CANDIDATES = 10_000
SCENARIOS = ("database", "database_blackhole", "api")
ENGINE_ATTEMPTS = round(OUTAGE_S / (0.8 * DEPENDENCY_BACKOFF_MAX_S)) + 20
"""The engine's requests to a dependency that is down for :data:`OUTAGE_S`: one probe a backoff
step (at least 80 % of the cap, its jitter), and a few for the steps below the cap and the
requests in flight when it went down."""
MAX_ATTEMPTS = 600
"""Every request to the dependency while it is down: the engine's, the readiness pings (one
each ``PROBE_EVERY_S``), the listener's reconnects, the Lease's renewals (one a retry period),
the watch's restarts."""

ONCE = (
    "notify listener connection lost: %s",
    "notify listener reconnected on channel %s",
    "notifications may have been missed: clearing clocks and resyncing",
    "lost leadership: could not renew within the renew deadline",
    "became leader",
    "active: enqueueing every cached candidate",
    "inactive: clocks cleared; nothing is deleted or reported",
    "pod cache of namespace %s cold: clearing its observation clocks",
    "resourceVersion %s expired; relisting",
    "pod cache synced by %s: %d pods at resourceVersion %s (namespace %s)",
    "%s (logged once; counted in %s)",
)
"""Lines that are not a recurring failure's: a transition each, written once an outage."""


_runs: dict[str, subprocess.Popen[str]] = {}


def _start(whats: list[str]) -> None:
    """Start every scenario of ``whats`` not started yet, side by side."""
    for what in whats:
        if what not in _runs:
            _runs[what] = subprocess.Popen(
                [sys.executable, "-m", "tests.sim.outage", "--json", what],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )


@cache
def outcome(what: str) -> dict[str, Any]:
    out, err = _runs[what].communicate(timeout=600)
    assert _runs[what].returncode == 0, err[-4000:]
    result: dict[str, Any] = json.loads(out)
    return result


def metric(run: dict[str, Any], name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in run["metrics"].items():
        sample, _, rest = key.partition("{")
        if sample == name and labels.items() <= json.loads("{" + rest).items():
            total += value
    return total


def failures(result: dict[str, Any], failing: str) -> int:
    """The failures the lines of ``failing`` account for (each line's count since the last)."""
    lines = [line for line in result["lines"] if line["failing"] == failing]
    recovered = [line for line in lines if line["cause"] is None]
    return sum(line["failures"] for line in recovered) if recovered else lines[-1]["failures"]


def shown(result: dict[str, Any]) -> str:
    return "\n".join(f"{line['at']:8.1f} {line['json']}" for line in result["lines"])


@pytest.mark.slow
@pytest.mark.timeout(660)
@pytest.mark.parametrize("what", SCENARIOS)
def test_a_ten_minute_outage_costs_a_few_lines(what: str, request: pytest.FixtureRequest) -> None:
    # Every scenario the session runs starts at the first, and they run side by side.
    names = {item.name for item in request.session.items}
    _start([w for w in SCENARIOS if f"{request.node.originalname}[{w}]" in names] + [what])
    result = outcome(what)
    lines = result["lines"]
    assert result["candidates"] >= CANDIDATES
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines:\n{shown(result)[:20000]}"
    assert all(line["level"] in ("info", "warning") for line in lines), shown(result)

    # Each line of a recurring failure is a change of its cause or its recovery, and the first
    # of each is a failure; it works again at the end.
    last: dict[str, str | None] = {}
    for line in lines:
        failing = line["failing"]
        if failing is None:
            continue
        if failing not in last:
            assert line["cause"] is not None, shown(result)
        else:
            assert line["cause"] != last[failing], shown(result)
        assert line["failures"] >= 1
        last[failing] = line["cause"]
    assert last, shown(result)
    assert all(cause is None for cause in last.values()), shown(result)
    # Every other line is a transition, once.
    others = [line["template"] for line in lines if line["failing"] is None]
    assert set(others) <= set(ONCE), shown(result)
    assert len(others) == len(set(others)), shown(result)

    # The metrics counted the failures (at least as many as the lines account for).
    if what.startswith("database"):
        assert {"row lookups fail, clocks cleared", "notify listener"} <= set(last)
        lookup_failed = metric(
            result, "cluster_reconciler_outcome_total", mode="live", verdict="lookup_failed"
        )
        assert lookup_failed >= failures(result, "row lookups fail, clocks cleared")
        assert metric(result, "retired_pod_gc_listener_connect_failures_total") >= failures(
            result, "notify listener"
        )
    else:
        get, lease = "fresh pod GETs fail", "lease retired-pod-gc"
        watch = next(f for f in last if re.fullmatch(r"list/watch of namespace \S+ fails", f))
        assert {get, lease} <= set(last)
        transport = metric(
            result, "retired_pod_gc_api_requests_total", op="get", result="transport"
        )
        assert transport >= failures(result, get) >= 1
        assert metric(
            result, "retired_pod_gc_api_requests_total", op="lease", result="transport"
        ) >= failures(result, lease)
        assert metric(result, "retired_pod_gc_watch_restarts_total", reason="error") >= failures(
            result, watch
        )

    # The dependency was backed off from as one: a few hundred requests in ten minutes, however
    # many keys wait on it (one a key a backoff step was 1.33 million for the database, 115,000
    # GETs for the API server before leadership lapsed).
    attempts = result["attempts"]
    assert sum(attempts.values()) <= MAX_ATTEMPTS, attempts
    if what.startswith("database"):
        pings = OUTAGE_S / PROBE_EVERY_S
        assert attempts.get("statement", 0) <= ENGINE_ATTEMPTS + pings, attempts
        held = metric(result, "retired_pod_gc_dependency_held_total", dependency="database")
    else:
        assert attempts.get("get", 0) + attempts.get("delete", 0) <= ENGINE_ATTEMPTS, attempts
        held = metric(result, "retired_pod_gc_dependency_held_total", dependency="api_server")
    assert held >= CANDIDATES, attempts

    # Nothing was lost uncounted: every pod deleted once the outage was over, each with its
    # Event, but for the Events still waiting to be written when the API server went away: their
    # writes failed (logged) for longer than EVENT_MAX_AGE_S, and they were dropped and counted
    # (`expired`; whether any was waiting at that instant depends on the interleaving).
    assert result["deleted"] == PODS
    expired = metric(result, "retired_pod_gc_events_total", result="expired")
    assert result["events"] + expired == PODS
    if expired:
        assert expired <= failures(result, "Event writes fail"), shown(result)
    # Each delete is named in a summary line (at most one a minute), not a line of its own.
    assert result["summarised"] >= CANDIDATES
    assert result["summary_lines"] <= result["outage_end"] / 60 + 1
