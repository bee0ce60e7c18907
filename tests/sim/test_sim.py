"""The deterministic simulation in ``make test``: a slice of seeds, replay, and that it can fail.

The slice and the removals' check run as ``python -m tests.sim`` in subprocesses (the slice on
two processes; both outside the suite's coverage tracing, which would multiply their time),
started in the background when the session's collection is complete (``background.py``); each
verdict is what its run prints. Replay determinism is checked within this process and against
the hashes a sweep on two other processes prints.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest

from tests.chaos.removals import REMOVALS, SIM_REMOVALS
from tests.sim.background import RUNS, SLICE, SimRun
from tests.sim.calibration import REVERTS
from tests.sim.seed import SimConfig, Variant, run_seed, schedule_for

ROOT = Path(__file__).resolve().parents[2]
CLOSING = re.compile(r"^(\d+) seeds, (\d+) failed, (\d+) deletes, (\d+) reports, ", re.M)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_slice_of_seeds_passes() -> None:
    done = RUNS["test_a_slice_of_seeds_passes"].result(timeout_s=880)
    match = CLOSING.search(done.stdout)
    assert match is not None, done.stdout[-3000:] + done.stderr[-3000:]
    seeds, failed, deletes, reports = (int(g) for g in match.groups())
    assert (seeds, failed) == (SLICE, 0), done.stdout[-6000:]
    # The seeds did act: deletes in live mode, reports in dry run.
    assert deletes > SLICE and reports > SLICE // 20
    assert done.returncode == 0


def test_a_seed_replays_to_the_same_trace() -> None:
    logging.disable(logging.CRITICAL)
    try:
        first = {s: run_seed(s).trace_hash for s in range(1, 9)}
        again = {s: run_seed(s).trace_hash for s in range(1, 9)}
    finally:
        logging.disable(logging.NOTSET)
    assert first == again
    assert len(set(first.values())) == len(first)  # different seeds, different traces
    done = SimRun(("--seeds", "8", "--start", "1", "--hashes", "--jobs", "2")).result(timeout_s=300)
    printed = dict(re.findall(r"^seed (\d+) trace ([0-9a-f]+)", done.stdout, re.M))
    assert {int(k): v for k, v in printed.items()} == first


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_removed_check_is_caught_within_1000_seeds() -> None:
    # The mutation check on the simulator (make sim-removals), bounded: each removal of
    # tests/chaos/removals.py's SIM_REMOVALS (the removals, the classifier's rules but those
    # held elsewhere, the liveness removals and the trigger's forgotten changes) must make one of
    # the first 1,000 seeds fail (each is caught by seed 817 at the latest,
    # docs/reliability.md); the baseline (the same seeds unchanged pass) is the slice above. A
    # removal whose name no longer exists raises: exit 1. In the background, as the slice.
    done = RUNS["test_every_removed_check_is_caught_within_1000_seeds"].result(timeout_s=580)
    out = done.stdout + done.stderr
    caught = set(re.findall(r"^== (\w+): caught by seed \d+", out, re.M))
    assert caught == set(SIM_REMOVALS), out[-4000:]
    assert done.returncode == 0, out[-4000:]


def test_the_relisting_race_is_found_and_the_fix_holds() -> None:
    # Seed 4414's schedule shrunk to three steps (docs/reliability.md, "Deterministic
    # simulation"): a 410 whose relist keeps failing, a retirement (its notification starts a
    # clock from the relisting cache's stale snapshot), a pod blip the relist then collapses.
    # The seed's configuration without its drop fault (a listener that hears nothing at the
    # start starts no clock from a notification), and its world without the odd sandboxes it
    # draws (the world the schedule was shrunk in).
    schedule = schedule_for(4414, SimConfig())
    steps = [schedule[0], schedule[5], schedule[6]]
    assert [s.kind for s in steps] == ["watch_410", "retire", "pod_blip"]
    variant = dataclasses.replace(Variant.draw(4414), pooler="", odd=0)
    logging.disable(logging.CRITICAL)
    try:
        with REVERTS["relisting_cache"]():
            reverted = run_seed(4414, steps=steps, variant=variant)
        fixed = run_seed(4414, steps=steps, variant=variant)
    finally:
        logging.disable(logging.NOTSET)
    assert any("not continuously reapable" in v for _, v in reverted.violations)
    assert fixed.ok, fixed.violations


def test_a_listener_that_drops_notifications_is_caught_by_the_delivery_proof() -> None:
    # Seed 399's schedule shrunk to two steps (docs/reliability.md, "Deterministic simulation"):
    # the listener's first connection goes through a transaction-mode pooler (the seed's
    # "start" fault: connected, LISTENing, every notification lost on the way); a burst
    # retires every row, then a row blip re-activates one for 6 ms. Without the delivery proof
    # the listener counts as connected and that pod is deleted across the blip it never heard
    # of; with it nothing is deleted until a connection proves delivery.
    # The world without the odd sandboxes the seed draws (the world the schedule was shrunk in).
    variant = dataclasses.replace(Variant.draw(399), odd=0)
    assert variant.pooler == "start"
    schedule = schedule_for(399, SimConfig())
    steps = [schedule[1], schedule[6]]
    assert [s.kind for s in steps] == ["burst", "row_blip"]
    logging.disable(logging.CRITICAL)
    try:
        with REMOVALS["delivery_proof"]():
            removed = run_seed(399, steps=steps, variant=variant)
            # The same run with a listener that does not drop notifications: the drop is what
            # the removal fails on.
            direct = run_seed(399, steps=steps, variant=dataclasses.replace(variant, pooler=""))
        fixed = run_seed(399, steps=steps, keep_trace=True, variant=variant)
    finally:
        logging.disable(logging.NOTSET)
    assert any("not continuously reapable" in v for _, v in removed.violations)
    assert direct.ok, direct.violations
    assert fixed.ok, fixed.violations
    assert fixed.deletes > 0
    assert any("pg listener connected through a transaction pooler" in line for line in fixed.trace)
    assert any(" lost retired_pod_gc_probe_sim " in line for line in fixed.trace)
