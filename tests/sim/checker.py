"""Judges one simulated seed from the models' ground truth, as the campaign's checker does.

Safety (docs/architecture.md's invariants), from what the models saw: every DELETE as the API
server model received it (its body, its status, the UID it deleted), every final re-read as the
database model ran it, every GET, every dry-run report; the pods' and rows' timelines
(:mod:`tests.chaos.model`, the same oracle as the campaign's, written independently of the
classifier). Times are exact virtual instants, so the campaign's tolerances for clock skew and
for a commit known only to lie inside an interval are not needed here. The budget's windows are
judged on the times the DELETEs were handed to the client (the grants the budget bounds; each
reaches the server a latency later, or later still when the loop stalled meanwhile), and so is
the final check's age bound (a DELETE sent more than ``FINAL_CHECK_MAX_AGE_S`` after its row's
last re-read reached the database is a violation of invariant 1).

Retired but kept (service/engine/kept.py), judged once the world is still (after the quiet
phase), for every pod unchanged since before the view's last sweep began (and ``settle_s``
more): the view reports it if and only if the model's truth says it is retired and kept.

A silent watch: a stream whose connection died silently (``ApiServer.kill_watches``) leaves the
pod cache deaf; the client must give it up within ``WATCH_SILENCE_SECONDS`` of the last line it
read from it (the service hears of nothing in between, and a pod created meanwhile stays
unseen).

A revoked token (``World.rotate_token``): the service reads its credentials again at the first
401, so no request carries the revoked token when sent later than ``API_TIMEOUT_SECONDS`` after
the transport first read a 401 for it (the periodic re-read, once a minute, would leave a minute
of them), and the replica is not left unready.

Liveness: once the faults are lifted, every pod reapable then must be deleted (reported, in dry
run) within ``threshold + recovery_bound + backlog / pace``, counted from when the service's
links are back (capped by the product's backoff caps), as :func:`tests.chaos.checker.quiet_phase`;
but a pod whose row's last change was written behind the trigger's back, which only the resync
finds (docs/architecture.md: the resync is the backstop for missed notifications).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from service.engine.verify import FINAL_CHECK_MAX_AGE_S
from service.kit.ratelimit import capped_shape
from tests.chaos.checker import RECONNECT_CAP_S
from tests.chaos.model import (
    PodLife,
    action_window_ok,
    pod_shape_reapable,
    reapable,
    retired_kept,
)
from tests.sim.world import World

Violation = tuple[float, str]


class Checker:
    def __init__(
        self,
        world: World,
        *,
        mode: str,
        threshold_s: float,
        deletes_per_minute: int,
        uplink_slack_s: float = 0.0,
    ) -> None:
        self.world = world
        self.mode = mode
        self.threshold_s = threshold_s
        self.cap = deletes_per_minute
        self.slack_s = uplink_slack_s
        shape = capped_shape(deletes_per_minute)
        self.capacity, self.rate_per_s = shape if shape is not None else (1, 0.0)
        self.violations: list[Violation] = []
        self.deleted: dict[str, float] = {}
        self.reported: dict[str, float] = {}

    def _fail(self, t: float, message: str) -> None:
        self.violations.append((t, message))

    # -- safety ----------------------------------------------------------------------------

    def check(self, reports: list[tuple[float, object]]) -> None:
        for d in self.world.server.deletes:
            if d.terminating:
                self._fail(d.time, f"DELETE {d.name} of a terminating pod (invariant 2)")
            self._check_delete(d.time, d.sent, d.name, d.body, d.status, d.uid)
            reread = self._last_reread(d.name, d.sent)
            if reread is not None and d.sent - reread > FINAL_CHECK_MAX_AGE_S + 1e-9:
                self._fail(
                    d.time,
                    f"DELETE {d.name} sent {d.sent - reread:.3f}s after its final re-read "
                    f"(bound {FINAL_CHECK_MAX_AGE_S}s, invariant 1)",
                )
        for t, report in reports:
            pod = report.pod  # type: ignore[attr-defined]
            if report.dry_run:  # type: ignore[attr-defined]
                self._check_report(t, pod.name, pod.uid)
        self._check_budget()

    def _last_reread(self, name: str, t: float) -> float | None:
        times = self.world.db.rereads.get(name, [])
        i = bisect.bisect_right(times, t) - 1
        return times[i] if i >= 0 else None

    def _last_get(self, name: str, t: float) -> float | None:
        best = None
        for g in self.world.server.gets:
            if g.name == name and g.time <= t and g.uid is not None:
                best = g.time
        return best

    def _check_delete(
        self,
        t: float,
        sent: float,
        name: str,
        body: dict[str, object],
        status: int,
        uid: str | None,
    ) -> None:
        if self.mode != "live":
            self._fail(t, f"{self.mode}: a DELETE was sent for {name} (invariants 5/6)")
        pre = body.get("preconditions")
        pre = pre if isinstance(pre, dict) else {}
        if not pre.get("uid") or not pre.get("resourceVersion"):
            self._fail(t, f"DELETE {name} without uid+resourceVersion preconditions (inv. 7)")
        if status != 200 or uid is None:
            return
        life = self.world.lives.get(uid)
        if life is None or life.name != name:
            self._fail(t, f"DELETE {name} deleted a pod UID the world never created ({uid})")
            return
        self.deleted.setdefault(uid, t)
        if pre.get("uid") and pre["uid"] != uid:
            self._fail(t, f"DELETE {name}: deleted uid {uid}, not the precondition's (inv. 2)")
        i = max(0, bisect.bisect_right(life.times, t) - 1)
        if pre.get("resourceVersion") and life.rvs[i] != pre["resourceVersion"]:
            self._fail(t, f"DELETE {name}: precondition rv is not the pod's {life.rvs[i]} (inv. 7)")
        if not pod_shape_reapable(life.states[i]):
            self._fail(
                t, f"DELETE {name} uid {uid}: pod state {life.states[i]} is never reaped (inv. 2)"
            )
        ok, why = self._window(life, t, deleted=True, sent=sent)
        if not ok:
            self._fail(
                t,
                f"DELETE {name} uid {uid}: not continuously reapable for the threshold "
                f"{self.threshold_s}s before it: {why} (invariants 1/3)",
            )

    def _window(
        self, life: PodLife, t: float, *, deleted: bool, sent: float | None = None
    ) -> tuple[bool, str]:
        """Invariants 1 and 3 for an action on ``life`` at ``t`` (as the campaign judges: pod
        and row reapable together from a threshold before the action up to its final re-read;
        the pod also up to a DELETE's arrival, which its resourceVersion precondition pins).

        A DELETE is judged from when it was handed to the client (``sent``: the clock said a
        threshold then, and its final re-read came before it); it may reach the server much
        later (a slow uplink outliving the client's timeout), and a re-read made meanwhile for
        another reconcile is not its own. A row change after its re-read is the accepted race
        (docs/architecture.md, invariant 1)."""
        acted = t if sent is None else sent
        reread = self._last_reread(life.name, acted)
        if reread is None:
            return False, "no final re-read of its row before it"
        return action_window_ok(
            life,
            self.world.rows.get(life.name),
            since=acted - self.threshold_s,
            reread=reread,
            seen=reread,
            until=t,
            got=None if deleted else self._last_get(life.name, reread),
            deleted=deleted,
            digits=6,
        )

    def _check_report(self, t: float, name: str, uid: str) -> None:
        if self.mode != "dry_run":
            self._fail(t, f"{self.mode}: a would-reap report for {name} (invariant 6)")
        if uid in self.reported:
            self._fail(t, f"dry run reported uid {uid} ({name}) twice (invariant 5)")
        self.reported.setdefault(uid, t)
        life = self.world.lives.get(uid)
        if life is None or life.name != name:
            self._fail(t, f"report for {name} names an unknown uid {uid}")
            return
        ok, why = self._window(life, t, deleted=False)
        if not ok:
            self._fail(t, f"dry-run report {name} uid {uid}: {why} (invariants 1/3)")

    def _check_budget(self) -> None:
        # The budget bounds its grants, the times the DELETEs were handed to the client; each
        # reaches the server a latency later (more, if the loop stalled while it was on its way).
        times = sorted(d.sent for d in self.world.server.deletes)
        cap, slack = self.cap, self.slack_s
        lo = 0
        for hi, t in enumerate(times):
            while times[lo] <= t - 60.0 + slack:
                lo += 1
            if hi - lo + 1 > cap:
                self._fail(t, f"{hi - lo + 1} DELETEs within 60 s (cap {cap}, invariant 4)")
                return
        for i in range(len(times)):
            for j in range(i + self.capacity, len(times)):
                span = times[j] - times[i]
                if span > 60:
                    break
                if j - i + 1 > self.capacity + self.rate_per_s * (span + slack):
                    self._fail(
                        times[j],
                        f"{j - i + 1} DELETEs within {span:.3f}s exceed the budget's pace "
                        f"(burst {self.capacity} + {self.rate_per_s:.3f}/s, invariant 4)",
                    )
                    return

    def check_silence(self, bound_s: float, *, end: float) -> None:
        """Every dead stream given up within ``bound_s`` of the last line the client read (the
        stalls of the loop meanwhile added: a starved loop runs its timers late)."""
        for watch in self.world.server.dead:
            given_up = end if watch.closed_at is None else watch.closed_at
            since = watch.last_read_at
            stalled = sum(s for at, s in self.world.loop.stalls if since <= at <= given_up)
            if given_up - since > bound_s + stalled + 1e-6:
                self._fail(
                    given_up,
                    f"the pod cache was deaf for {given_up - since:.3f}s: a watch whose "
                    f"connection died silently at {watch.dead_at:.3f} (its last line read at "
                    f"{since:.3f}) was "
                    + (
                        "still read when the run ended"
                        if watch.closed_at is None or watch.closed_at >= end
                        else "given up only then"
                    )
                    + f" (WATCH_SILENCE_SECONDS={bound_s:g})",
                )

    def check_tokens(
        self, budget_s: float, *, problem: str | None, refusals: int, end: float
    ) -> None:
        """A revoked token is replaced at the first 401: no request carries it when sent more
        than ``budget_s`` (``API_TIMEOUT_SECONDS``: a request's whole budget, a wait for a slot
        and 429 retries included, all sent with the headers it was made with) after the
        transport first read a 401 for it (the loop's stalls meanwhile added). The token file
        always holds a token the server accepts (the world writes it before it revokes the
        old one, and rotations are further apart than a request's budget), so no refusal may
        stand (``refusals``: the transport's ``api_unauthorized_answers``, each a warning and
        an unready replica; docs/operations.md promises a rotation one refused request and no
        warning), nor be left standing at the end (``problem``)."""
        server = self.world.server
        stalls = self.world.loop.stalls
        for sent, authorization, op in server.sent:
            refused_at = server.refusals_read.get(authorization)
            if refused_at is None or sent <= refused_at + budget_s:
                continue
            stalled = sum(s for at, s in stalls if refused_at <= at <= sent)
            if sent - refused_at > budget_s + stalled + 1e-6:
                self._fail(
                    sent,
                    f"a {op} request sent with a revoked token {sent - refused_at:.3f}s after "
                    f"its first 401 (at {refused_at:.3f}; revoked at "
                    f"{server.revoked.get(authorization, float('nan')):.3f}): the token was "
                    f"not read again at the 401 (bound {budget_s:g}s)",
                )
                break
        if refusals:
            self._fail(
                end,
                f"{refusals} refusal(s) of the credentials stood (a warning, the replica "
                "unready) though the token file held a token the server accepts",
            )
        if problem is not None:
            self._fail(end, f"the replica is unready at the end: {problem}")

    # -- liveness --------------------------------------------------------------------------

    def due_now(self) -> dict[str, str]:
        world = self.world
        due: dict[str, str] = {}
        for name, uid in world.uid_of.items():
            life = world.life(name)
            row = world.rows.get(name)
            if name in world.behind_trigger:
                # Made reapable by a write behind the trigger's back: no notification names it,
                # only the resync backstop (a period the quiet phase does not wait out).
                continue
            if life is not None and row is not None and reapable(life.current, row.current):
                due[uid] = name
        return due

    def liveness_bound_s(self, due: int, recovery_bound_s: float) -> float:
        backlog_s = 0.0
        if self.mode == "live" and self.rate_per_s > 0:
            backlog_s = max(0, due - self.capacity + 1) / self.rate_per_s
        return self.threshold_s + recovery_bound_s + backlog_s

    def judge_liveness(
        self,
        due: dict[str, str],
        *,
        t_quiet: float,
        bound_s: float,
        links_back: Callable[[], float],
    ) -> None:
        acted = self.deleted if self.mode == "live" else self.reported
        back_at = links_back()
        deadline = min(back_at, t_quiet + RECONNECT_CAP_S) + bound_s
        late = {uid: name for uid, name in due.items() if uid not in acted or acted[uid] > deadline}
        if late:
            self._fail(
                deadline,
                f"[liveness] {len(late)} pod(s) reapable when the faults stopped (at "
                f"{t_quiet:.3f}) were not {'deleted' if self.mode == 'live' else 'reported'} "
                f"within {bound_s:.1f}s of the links being back (at {back_at:.3f}): "
                + ", ".join(
                    f"{name} ({f'at {acted[uid]:.3f}' if uid in acted else 'never'})"
                    for uid, name in sorted(late.items(), key=lambda kv: kv[1])
                ),
            )

    # -- retired but kept ------------------------------------------------------------------

    def judge_kept(
        self, reported: dict[str, str], *, now: float, sweep_started: float, settle_s: float
    ) -> None:
        """``reported``: pod name to the view's reason; ``sweep_started``: when the view's last
        sweep that answered began. A pod unchanged since ``settle_s`` before it is judged both
        ways: reported only if retired and kept, and reported if it is."""
        world = self.world

        def changed_at(name: str) -> float:
            life = world.life(name)
            row = world.rows.get(name)
            times = [0.0]
            if life is not None and life.times:
                times.append(life.times[-1])
                if life.ended_at is not None:
                    times.append(life.ended_at)
            if row is not None and row.his:
                times.append(row.his[-1])
            return max(times)

        def truth(name: str) -> bool:
            pod = world.server.pods.get(name)
            row_life = world.rows.get(name)
            row = row_life.current if row_life is not None else None
            if pod is None:
                return False
            if pod.terminating:  # a pod being deleted is kept (its own skip reason)
                return row is not None and row.managed and not row.active
            life = world.life(name)
            return retired_kept(life.current if life is not None else None, row)

        for name, reason in sorted(reported.items()):
            if not truth(name) and changed_at(name) + settle_s < sweep_started:
                self._fail(
                    now,
                    f"[kept] {name} reported as retired but kept ({reason}) but it is not: "
                    "its row is active or absent, or it is reapable",
                )
        names = set(world.server.pods) | set(reported)
        for name in sorted(names):
            if name in reported or not truth(name):
                continue
            if changed_at(name) + settle_s < sweep_started:
                self._fail(
                    now,
                    f"[kept] {name} is retired and kept, unchanged since "
                    f"{changed_at(name):.3f}, but the sweep that began at {sweep_started:.3f} "
                    "did not report it",
                )
