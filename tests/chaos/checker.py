"""Judges one seed against ground truth: safety after every step, liveness in the quiet phase.

:class:`Checker` holds every safety invariant of docs/architecture.md against the emulator's
audit log, PostgreSQL's statement log (:mod:`tests.chaos.pglog`) and the driver's ground truth
(:mod:`tests.chaos.model`, recorded by :class:`tests.chaos.world.World`), incrementally after
each step of the schedule. :func:`quiet_phase` judges liveness once faults are lifted: every pod
that is reapable then must be deleted (reported, in dry run) within ``threshold +
recovery_bound + backlog / pace_rate``, counted from when the service's links are back after the
end of the last fault (including another seed's restart of the shared server). A seed's verdict
is its :class:`SeedResult`. See docs/reliability.md for the tolerances and why they are sound.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import anyio

from devtools.emulator.core import AuditEntry
from devtools.emulator.faults import RequestRecord
from service.kit.ratelimit import capped_shape
from service.kube.informer import BACKOFF_MAX_S as INFORMER_BACKOFF_MAX_S
from service.pg.listener import BACKOFF_MAX_S as LISTENER_BACKOFF_MAX_S
from tests.chaos.model import (
    NAMESPACE,
    PodLife,
    action_window_ok,
    pod_shape_reapable,
    reapable,
)
from tests.chaos.pglog import RESOLUTION_S
from tests.chaos.schedule import CampaignConfig
from tests.chaos.world import World

PODS_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods"


# ------------------------------------------------------------------ safety, after every step


class Checker:
    """Every safety invariant, checked incrementally after each step and at the end."""

    def __init__(
        self,
        *,
        world: World,
        cfg: CampaignConfig,
        mode: str,
        reports: list[tuple[float, str, str]],
    ) -> None:
        self.world = world
        self.cfg = cfg
        self.mode = mode
        self.reports = reports
        self.violations: list[str] = []
        self.delete_times: list[float] = []
        self.deleted_uids: set[str] = set()
        self.reported_uids: set[str] = set()
        self.race_windows: list[float] = []
        """Final re-read start (database) → action (API server arrival or report), seconds."""
        self._audit_seen = 0
        self._reports_seen = 0
        shape = capped_shape(cfg.deletes_per_minute)
        self.capacity, self.rate_per_s = shape if shape is not None else (1, 0.0)

    def _fail(self, where: str, message: str) -> None:
        self.violations.append(f"[{where}] {message}")

    def check(self, where: str) -> None:
        audit = self.world.emu.audit
        new: list[AuditEntry] = audit[self._audit_seen :]
        self._audit_seen = len(audit)
        for entry in new:
            if entry.method == "DELETE" and "/pods/" in entry.path:
                self._check_delete(where, entry)
        reports = self.reports[self._reports_seen :]
        self._reports_seen = len(self.reports)
        for created, key, uid in reports:
            self._check_report(where, created, key, uid)
        self._check_budget(where)

    def _window_ok(self, life: PodLife, t: float, *, deleted: bool) -> tuple[bool, str]:
        """Invariants 1 and 3 for an action on ``life`` at ``t`` (DELETE arrival or report).

        The final re-read's start comes from PostgreSQL's statement log: pod and row must have
        been reapable together at every instant from a threshold before ``t`` up to it. After
        it, a row change is the accepted race (the service bounds how long it lets that last,
        ``FINAL_CHECK_MAX_AGE_S``; the virtual-time unit tests hold it to that); the pod must stay
        reapable up to a DELETE — its resourceVersion precondition pins it to the fresh GET,
        made before the re-read. A report has no precondition: its pod is judged up to the last
        fresh GET (the emulator's record), and as that GET saw it up to the re-read.
        """
        statements = self.world.shared.statements
        assert statements is not None
        reread = statements.last_reread_before(self.world.db_name, life.name, t)
        if reread is None:
            return False, "no final re-read of its row before it (PostgreSQL statement log)"
        self.race_windows.append(t - reread)
        # The log's millisecond resolution: the re-read is taken to have seen a change up to
        # 1 ms before its bind, and a GET up to 1 ms after it may precede it.
        return action_window_ok(
            life,
            self.world.rows.get(life.name),
            since=t - self.cfg.threshold_s + self.cfg.start_tolerance_s,
            reread=reread,
            seen=reread - RESOLUTION_S,
            until=t,
            got=None if deleted else self._last_get_before(life.name, reread + RESOLUTION_S),
            deleted=deleted,
            digits=3,
        )

    def _last_get_before(self, name: str, t: float) -> float | None:
        path = f"{PODS_PATH}/{name}"
        times = [
            r.time_s
            for r in self.world.emu.requests
            if r.method == "GET" and r.path == path and 0 < r.time_s < t
        ]
        return max(times, default=None)

    def _check_delete(self, where: str, entry: AuditEntry) -> None:
        name = entry.path.rsplit("/", 1)[1]
        t = entry.time_s
        self.delete_times.append(t)
        if self.mode != "live":
            self._fail(where, f"{self.mode}: a DELETE was sent for {name} (invariants 5/6)")
        body = entry.body if isinstance(entry.body, dict) else {}
        pre = body.get("preconditions") if isinstance(body.get("preconditions"), dict) else None
        uid = pre.get("uid") if pre else None
        rv = pre.get("resourceVersion") if pre else None
        if not uid or not rv:
            self._fail(where, f"DELETE {name} without uid+resourceVersion preconditions: {body}")
        if entry.status not in (200, 202):
            return  # refused (404/409/injected): nothing was deleted
        life = (
            self.world.lives.get(str(uid))
            if uid
            else self.world.lives.get(self.world.uid_of.get(name, ""))
        )
        if life is None or life.name != name:
            self._fail(where, f"DELETE {name} deleted a pod UID the driver never created ({uid})")
            return
        self.deleted_uids.add(life.uid)
        # The pod side at the DELETE itself: the resourceVersion precondition pins the state.
        i = max(0, bisect.bisect_right(life.times, t) - 1)
        if rv is not None and life.rvs[i] != rv:
            self._fail(
                where,
                f"DELETE {name}: precondition resourceVersion {rv} is not the pod's "
                f"({life.rvs[i]}) at the time (invariant 7)",
            )
        if not pod_shape_reapable(life.states[i]):
            self._fail(where, f"DELETE {name} uid {life.uid}: pod state {life.states[i]} (inv. 2)")
        ok, why = self._window_ok(life, t, deleted=True)
        if not ok:
            self._fail(
                where,
                f"DELETE {name} uid {life.uid} at {t:.3f}: not continuously reapable for the "
                f"threshold {self.cfg.threshold_s}s before it: {why} (invariants 1/3)",
            )
        life.end(t, by_service=True)

    def _check_report(self, where: str, created: float, key: str, uid: str) -> None:
        name = key.rsplit("/", 1)[1]
        if self.mode != "dry_run":
            self._fail(where, f"{self.mode}: a would-reap report for {key} (invariant 6)")
        if uid in self.reported_uids:
            self._fail(where, f"dry run reported uid {uid} ({key}) twice (invariant 5)")
        self.reported_uids.add(uid)
        life = self.world.lives.get(uid)
        if life is None or life.name != name:
            self._fail(where, f"report for {key} names an unknown uid {uid}")
            return
        ok, why = self._window_ok(life, created, deleted=False)
        if not ok:
            self._fail(where, f"dry-run report {key} uid {uid} at {created:.3f}: {why}")

    def _check_budget(self, where: str) -> None:
        times = sorted(self.delete_times)
        cap = self.cfg.deletes_per_minute
        lo = 0
        for hi, t in enumerate(times):
            while times[lo] <= t - 60.0:
                lo += 1
            if hi - lo + 1 > cap:
                self._fail(where, f"{hi - lo + 1} DELETEs within 60 s (cap {cap}, invariant 4)")
                self.delete_times.clear()  # report once
                return
        # The pacer's envelope (budget.py): at most C + r·t grants in any window of length t.
        slack = self.cfg.pacing_slack_s
        for i in range(len(times)):
            for j in range(i + self.capacity, len(times)):
                span = times[j] - times[i]
                if span > 60:
                    break
                allowed = self.capacity + self.rate_per_s * (span + slack)
                if j - i + 1 > allowed:
                    self._fail(
                        where,
                        f"{j - i + 1} DELETEs within {span:.2f}s exceed the budget's pace "
                        f"(burst {self.capacity} + {self.rate_per_s:.2f}/s, invariant 4)",
                    )
                    self.delete_times.clear()
                    return


# ------------------------------------------------------------------ the seed's verdict


@dataclass(frozen=True, slots=True)
class Recovery:
    """The quiet phase of one seed: when the service's links were back, and when its last due
    pod was acted on, in seconds after the faults stopped."""

    links_back_s: float
    done_s: float


@dataclass(slots=True)
class SeedResult:
    seed: int
    mode: str
    violations: list[str] = field(default_factory=list)
    deletes: int = 0
    reports: int = 0
    duration_s: float = 0.0
    stats: Counter[str] = field(default_factory=Counter)
    race_windows: list[float] = field(default_factory=list)
    recovery: Recovery | None = None

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        head = (
            f"seed {self.seed} [{self.mode}] {'ok' if self.ok else 'FAILED'}: "
            f"{self.deletes} deletes, {self.reports} reports, {self.duration_s:.1f}s"
        )
        if self.ok:
            return head
        lines = [head, *(f"  - {v}" for v in self.violations[:8])]
        lines.append(f"  reproduce: {reproduce_commands(self.seed)}")
        return "\n".join(lines)


def reproduce_commands(seed: int) -> str:
    return (
        f"make chaos SEED={seed}   (or: CHAOS_SEED={seed} .venv/bin/pytest "
        f"tests/chaos/test_campaign.py -k campaign)"
    )


# ------------------------------------------------------------------ liveness, in the quiet phase


async def quiet_phase(
    world: World, checker: Checker, cfg: CampaignConfig, mode: str
) -> Recovery | None:
    """Faults have just been lifted (:meth:`World.lift_faults`); every pod reapable now must be
    acted on within the stated bound."""
    t_quiet = time.time()
    due: dict[str, str] = {}
    for name, uid in world.uid_of.items():
        life = world.life(name)
        row = world.rows.get(name)
        if life is not None and row is not None and reapable(life.current, row.current):
            due[uid] = name
    if mode == "disabled":
        await anyio.sleep(cfg.threshold_s + cfg.quiet_s)
        checker.check("quiet")
        return None
    backlog_s = 0.0
    if mode == "live" and checker.rate_per_s > 0:
        backlog_s = max(0, len(due) - checker.capacity + 1) / checker.rate_per_s
    bound_s = cfg.threshold_s + cfg.recovery_bound_s + backlog_s
    # A watch still streaming now (answered with status 0 so far): the informer needs no retry.
    watching = any("watch" in r.query and r.time_s > 0 and r.status == 0 for r in pod_syncs(world))
    informer_back = t_quiet if watching else math.inf
    while True:
        checker.check("quiet")
        done = checker.deleted_uids if mode == "live" else checker.reported_uids
        missing = {uid: name for uid, name in due.items() if uid not in done}
        # Seeds share one PostgreSQL server: a restart by another seed is a fault too, and the
        # bound counts from the end of the last one.
        faults_stopped = max(t_quiet, world.shared.restarted_at)
        if informer_back == math.inf:  # its first request since the faults stopped
            informer_back = min(
                (r.time_s for r in pod_syncs(world) if r.time_s >= t_quiet), default=math.inf
            )
        back_at = links_back_at(world, faults_stopped, informer_back)
        deadline = min(back_at, faults_stopped + RECONNECT_CAP_S) + bound_s
        if not missing or time.time() > deadline:
            break
        await anyio.sleep(0.1)
    recovery = Recovery(links_back_s=back_at - faults_stopped, done_s=time.time() - faults_stopped)
    if missing:
        # Slow or stuck? Watch a while longer, for the report only.
        late: dict[str, float] = {}
        until = time.time() + LIVENESS_GRACE_S
        while len(late) < len(missing) and time.time() < until:
            checker.check("quiet")
            done = checker.deleted_uids if mode == "live" else checker.reported_uids
            for uid, name in missing.items():
                if uid in done and name not in late:
                    late[name] = time.time()
            await anyio.sleep(0.1)
        checker.violations.append(
            f"[liveness] {len(missing)} pod(s) reapable since the faults stopped were not "
            f"{'deleted' if mode == 'live' else 'reported'} within {bound_s:.1f}s of the "
            f"service's links being back (at {back_at - t_quiet:+.2f}s): "
            f"{sorted(missing.values())[:5]}\n"
            + liveness_evidence(world, sorted(missing.values())[:5], t_quiet, late)
        )
    return recovery


LIVENESS_GRACE_S = 30.0


RECONNECT_CAP_S = max(INFORMER_BACKOFF_MAX_S, LISTENER_BACKOFF_MAX_S) + 2.0
"""The service's links are back this long after the faults stopped at the latest: its backoff
caps, plus a connect attempt (DB_CONNECT_TIMEOUT_SECONDS, API_TIMEOUT_SECONDS)."""


def pod_syncs(world: World) -> list[RequestRecord]:
    """The list and watch requests on the pods, as the emulator received them."""
    return [r for r in world.emu.requests if r.method == "GET" and r.path == PODS_PATH]


def links_back_at(world: World, faults_stopped: float, informer_back: float) -> float:
    """When the service's links were back after the faults stopped (``inf`` until then), from
    the proxy's and the emulator's side, not from the service's word: the later of its last
    listener connect since the faults stopped and ``informer_back`` (when its informer was
    listing or watching again). Both wait out a backoff that grew with the faults (an outage's
    length, how many requests failed in a row): a loaded machine lengthens a database restart,
    so a fixed bound from the end of the faults would judge the product's backoff, not its
    liveness. The backoffs have their caps (RECONNECT_CAP_S), so this bound cannot grow
    without limit."""
    connects = [t for t in world.proxy.listener_connected_at if t >= faults_stopped]
    return max(faults_stopped, informer_back, *connects)


def liveness_evidence(
    world: World, names: list[str], t_quiet: float, late: dict[str, float]
) -> str:
    """What the service did around the quiet phase, from the emulator's and the proxy's side
    (times in seconds from the start of the quiet phase; status 0: still streaming)."""

    def at(t: float) -> str:
        return f"{t - t_quiet:+.2f}"

    since = t_quiet - 15.0
    syncs = [
        f"{at(r.time_s)} {'watch' if 'watch' in r.query else 'list'} {r.status}"
        for r in pod_syncs(world)
        if r.time_s >= since
    ]
    lines = [
        f"    restart ended {at(world.shared.restarted_at)}"
        if world.shared.restarted_at
        else "    no restart",
        "    listener connects: "
        + ", ".join(at(t) for t in world.proxy.listener_connected_at if t >= since),
        "    pods list/watch: " + ", ".join(syncs),
    ]
    for name in names:
        path = f"{PODS_PATH}/{name}"
        seen = [
            f"{at(r.time_s)} {r.method} {r.status}"
            for r in world.emu.requests
            if r.path == path and r.time_s >= since
        ]
        after = (
            f"acted on at {at(late[name])}"
            if name in late
            else f"not acted on by {at(t_quiet + LIVENESS_GRACE_S)}"
        )
        lines.append(f"    {name}: {after}; " + ", ".join(seen))
    return "\n".join(lines)
