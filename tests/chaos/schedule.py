"""The per-seed schedule: what a seed does to its world, and when, drawn from the seed up front.

:func:`make_schedule` draws a seed's steps (what happens, to which pod, with which fault, and the
pause after it) from ``random.Random(seed)`` before the seed starts, so re-running a seed replays
the same schedule; timing is real (the service runs on the real clock), so a replay is faithful
but not bit-exact. :func:`seed_mode` picks the service's mode from the seed alone, and
:class:`CampaignConfig` holds the parameters every seed is drawn, run and judged under. What
each kind of step does is :mod:`tests.chaos.steps`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tests.chaos.model import PodShape


@dataclass(frozen=True, slots=True)
class CampaignConfig:
    """The parameters a campaign's seeds are drawn, run and judged under."""

    threshold_s: float = 1.0
    deletes_per_minute: int = 60
    """Small on purpose: a burst of retirements exceeds the pacer's burst capacity (6)."""
    steps: int = 45
    sandboxes: int = 14
    start_tolerance_s: float = 0.05
    """Clock skew between the service's monotonic clock and the audit's wall clock, and the
    granularity of timer wake-ups: deletes may be judged this much early. (Load only ever makes
    the service later, never earlier.)"""
    pacing_slack_s: float = 1.0
    """Grant → DELETE arrival, for the pacer's envelope only: the token is taken as the DELETE is
    handed to the API client (engine/budget.py), so this is the request's transit through the
    shared loop. The grants themselves keep the envelope exactly (tests/unit/test_budget.py)."""
    recovery_bound_s: float = 8.0
    """After faults stop and the service's links are back (see
    :func:`tests.chaos.checker.links_back_at`): a key's requeue backoff (≤ 5 s · 1.1,
    service/app/service.py), a sync, and the first checks."""
    quiet_s: float = 1.5
    """Disabled mode: how long the quiet phase watches for (forbidden) actions."""


def seed_mode(seed: int) -> str:
    """``live`` mostly; every 8th seed dry run, every 8th (offset 4) disabled."""
    if seed % 8 == 0:
        return "dry_run"
    if seed % 8 == 4:
        return "disabled"
    return "live"


@dataclass(frozen=True, slots=True)
class Step:
    kind: str
    index: int
    shape: PodShape
    state: str
    amount: float
    flag: bool
    pause_s: float


_STEP_WEIGHTS: dict[str, int] = {
    "shape": 14,
    "shape_reapable": 10,
    "pod_blip": 6,
    "ip": 3,
    "condition": 3,
    "recreate": 4,
    "delete_other": 2,
    "create_missing": 5,
    "retire": 12,
    "reactivate": 5,
    "row_blip": 5,
    "new_generation": 3,
    "burst": 6,
    "watch_drop": 3,
    "watch_410": 2,
    "compact": 1,
    "api_error": 3,
    "latency": 2,
    "kill_db": 2,
    "pg_restart": 1,
    "stall_listener": 2,
    "stale_recreate": 3,
    "stall_reactivate": 3,
    "silent_reactivate": 2,
}


_RETIRE_STATES = ("suspended", "replaced", "replaced", "failed", "cancelled", "stopped", "paused")


def make_schedule(seed: int, cfg: CampaignConfig) -> list[Step]:
    rng = random.Random(seed)
    kinds = list(_STEP_WEIGHTS)
    weights = list(_STEP_WEIGHTS.values())
    steps = []
    for _ in range(cfg.steps):
        steps.append(
            Step(
                kind=rng.choices(kinds, weights)[0],
                index=rng.randrange(cfg.sandboxes),
                shape=rng.choice(list(PodShape)),
                state=rng.choice(_RETIRE_STATES),
                amount=rng.random(),
                flag=rng.random() < 0.5,
                pause_s=rng.uniform(0.02, 0.2),
            )
        )
    return steps
