"""A seed's simulated world: the models, the ground truth they record, and the steps that drive it.

The ground truth uses the campaign's timelines (:mod:`tests.chaos.model`): every pod state of a
UID at the virtual instant the API server model made it, every row state at its COMMIT (an exact
instant here: the model *is* the database). The steps are the campaign's kinds
(:mod:`tests.chaos.schedule`, :mod:`tests.chaos.steps`), performed on the models, plus a few
only a simulation can do cheaply: a starved event loop, a lagging watch, a leadership flip; and,
drawn with the seed's configuration, a listener behind a transaction-mode pooler that drops its
notifications (:meth:`World.pooler_fault`), a watch whose connection dies silently
(:meth:`World.silent_fault`), and sandboxes beside the steps' in shapes the steps never make
(:meth:`World.oddities`: a pod that one rule alone keeps from its DELETE).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import random
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from tests.chaos.model import (
    KEEP_ANNOTATION,
    RETIRED_STATES,
    PodLife,
    PodShape,
    PodTruth,
    RowLife,
    RowTruth,
    keeps,
    reactivate,
    retire,
)
from tests.chaos.schedule import _STEP_WEIGHTS, Step
from tests.chaos.steps import (
    ROW_STEPS,
    TARGETED,
    blip_shape,
    burst_changes,
    oldest_reapable,
    recreated_pod,
    row_blip_middle,
    shape_for,
    token_wait,
    token_wait_blip_rows,
    token_wait_pod_changes,
)
from tests.chaos.world import SELECTOR_LABEL, Sandbox
from tests.sim.kube import ApiServer, ServerPod, _Fault
from tests.sim.loop import VirtualLoop
from tests.sim.net import Net
from tests.sim.pg import Database

SIM_STEP_WEIGHTS: dict[str, int] = {
    **_STEP_WEIGHTS,
    "loop_stall": 2,
    "watch_lag": 3,
    "leader_flip": 2,
}
"""The campaign's step kinds and weights, and the simulator's own."""

_RETIRE_STATES = ("suspended", "replaced", "replaced", "failed", "cancelled", "stopped", "paused")

ODDITIES = (
    "kept",
    "keep_false",
    "keep_removed",
    "keep_added",
    "terminating",
    "sandbox_label",
    "generation_label",
    "unlabelled",
    "unknown_kind",
    "restore_pending",
    "row_active",
    "row_inconsistent",
    "no_statuses",
    "unmanaged",
)
"""The shapes of :meth:`World.oddities`: kept by the annotation (a value that keeps; ``false``,
which does not; removed, or added, at an instant of the run), deleted by someone else
(terminating for a grace period), a sandbox or generation label that disagrees with the row,
labels missing or not a number, a pod kind nobody knows (the row's is unknown too), a Pending
restore pod, a row active with a retired state, a row retired with the state ``active`` or an
unknown one, no container statuses, a sandbox not Kubernetes-managed."""

_ROW_GAPS: dict[PodShape, tuple[bool, bool]] = {
    PodShape.PENDING_STUCK: (True, False),
    PodShape.PENDING_WITH_IP: (True, False),
    PodShape.PENDING_NO_CONDITION: (True, True),
    PodShape.PENDING_READY: (True, True),
    PodShape.RUNNING: (False, True),
    PodShape.SUCCEEDED: (False, True),
}
"""The row blips that leave the retired row otherwise than the campaign's, drawn by the step's
shape (which a row blip does not use otherwise, so every seed's draws stay as they were): for
each, whether the row is deleted for the blip instead of re-activated (a blip through another
retired state, :func:`tests.chaos.steps.row_blip_middle`'s, stays one), and whether it comes
back behind the trigger's back (a writer that bypasses it, as ``silent_reactivate``: the row is
frozen after).
A row deleted and inserted again through the trigger stays away for a while (up to 1.7 s: the
reconciles its deletion started find no row), and its return, the insert of an inactive row,
must start the pod's clock again; a return behind the trigger's back comes at once, and is heard
of only through the notification of the blip's first write, which must stop the pod's clock
(docs/architecture.md, invariant 3)."""

_KEEPING = ("true", "yes", "", "True ", "1")
_NOT_KEEPING = ("false", "FALSE", " false ")
_UNLABELLED: tuple[dict[str, str | None], ...] = (
    {"space.sandbox-id": None},
    {"space.generation": None},
    {"space.generation": "g1"},
    {"space.sandbox-id": "", "space.generation": None},
)


_KINDS = list(SIM_STEP_WEIGHTS)
_CUM_WEIGHTS = list(itertools.accumulate(SIM_STEP_WEIGHTS.values()))
_SHAPES = list(PodShape)


def make_schedule(rng: random.Random, steps: int, sandboxes: int) -> list[Step]:
    # Cumulative weights given once: the same draws as ``weights=``, not summed again a step.
    kinds, cum, shapes = _KINDS, _CUM_WEIGHTS, _SHAPES
    out = []
    for _ in range(steps):
        long_pause = rng.random() < 0.15
        out.append(
            Step(
                kind=rng.choices(kinds, cum_weights=cum)[0],
                index=rng.randrange(sandboxes),
                shape=rng.choice(shapes),
                state=rng.choice(_RETIRE_STATES),
                amount=rng.random(),
                flag=rng.random() < 0.5,
                pause_s=rng.uniform(0.5, 1.6) if long_pause else rng.uniform(0.02, 0.25),
            )
        )
    return out


@dataclass
class Hooks:
    """What steps may do to the service itself (set by the engine)."""

    set_leader: Callable[[bool], None] = lambda leader: None


class World:
    def __init__(self, loop: VirtualLoop, net: Net, *, threshold_s: float) -> None:
        self.loop = loop
        self.net = net
        self.trace = net.trace
        self.server = ApiServer(net)
        self.db = Database(net)
        self.server.on_change = self._pod_changed
        self.db.on_commit = self._row_committed
        self.lives: dict[str, PodLife] = {}
        self.uid_of: dict[str, str] = {}
        self.rows: dict[str, RowLife] = {}
        self.sandboxes: list[Sandbox] = []
        self.threshold_s = threshold_s
        self.stats: Counter[str] = Counter()
        self.hooks = Hooks()
        self._pending: list[tuple[asyncio.TimerHandle, Callable[[], None]]] = []
        self.behind_trigger: dict[str, None] = {}
        """The rows whose last change was written behind the trigger's back (no notification
        named it)."""
        self.token_file = ""
        """The service account's token file (the service reads it with ``TokenFile``)."""
        self._tokens = 0

    # -- ground truth ----------------------------------------------------------------------

    def _pod_changed(self, name: str, pod: ServerPod | None) -> None:
        now = self.loop.time()
        if pod is None or pod.terminating:
            uid = self.uid_of.get(name)
            if uid is not None:
                self.lives[uid].end(now, by_service=False)
            return
        life = self.lives.get(pod.uid)
        labels = pod.labels
        generation = labels.get("space.generation", "")
        annotations = pod.annotations
        state = PodTruth(
            pod.shape,
            labels.get("space.sandbox-id") or None,
            int(generation) if generation.isascii() and generation.isdigit() else None,
            labels.get("space.pod-kind", ""),
            keep=annotations is not None and keeps(annotations.get(KEEP_ANNOTATION)),
        )
        if life is None:
            life = self.lives[pod.uid] = PodLife(pod.uid, name)
            self.uid_of[name] = pod.uid
        life.record(now, state, str(pod.rv))

    def _row_committed(self, name: str, row: RowTruth | None) -> None:
        now = self.loop.time()
        self.rows.setdefault(name, RowLife(name)).record(now, now, row)

    def life(self, name: str) -> PodLife | None:
        uid = self.uid_of.get(name)
        life = self.lives.get(uid) if uid else None
        if life is None or life.ended_at is not None:
            return None
        return life

    # -- changes ---------------------------------------------------------------------------

    def create_pod(
        self,
        sb: Sandbox,
        generation: int,
        shape: PodShape,
        kind: str,
        *,
        labels: dict[str, str | None] | None = None,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """A pod of ``sb`` labelled as its sandbox, generation and ``kind`` say (``labels``:
        other values for some of them, ``None`` to leave one out)."""
        name = sb.name(generation)
        self.server.finish_terminating(name)
        if name in self.server.pods:
            self.server.remove(name)
        written: dict[str, str | None] = {
            SELECTOR_LABEL[0]: SELECTOR_LABEL[1],
            "space.sandbox-id": sb.sandbox_id,
            "space.generation": str(generation),
            "space.pod-kind": kind,
            **(labels or {}),
        }
        self.server.create(
            name, {k: v for k, v in written.items() if v is not None}, shape, annotations
        )

    def set_shape(self, life: PodLife, shape: PodShape) -> None:
        self.server.set_shape(life.name, shape)

    def delete_pod(self, life: PodLife) -> None:
        if life.name in self.server.pods:
            self.server.remove(life.name)

    def update_rows(self, changes: Mapping[str, RowTruth | None], *, silent: bool = False) -> None:
        """One transaction writing ``changes`` (``None``: the row deleted); ``silent``: behind
        the trigger's back."""
        if changes:
            self.db.commit(dict(changes), silent=silent)
            for name in changes:
                if silent:
                    self.behind_trigger[name] = None
                else:
                    self.behind_trigger.pop(name, None)

    def later(self, delay_s: float, callback: Callable[[], None]) -> None:
        """``callback`` after ``delay_s``, or when the faults are lifted if that is sooner: the
        end of a fault, or a change of the world (the quiet phase judges a world that no longer
        changes)."""
        self._pending.append((self.net.at(delay_s, callback), callback))

    def populate(self, count: int, rng: random.Random) -> None:
        for i in range(count):
            managed = i != count - 1  # one sandbox is not Kubernetes-managed
            sb = Sandbox(f"s{i}", 1, "restore" if i % 5 == 4 else "create", managed)
            self.sandboxes.append(sb)
            self.db.commit(
                {sb.name(): RowTruth(sb.sandbox_id, 1, sb.kind, "active", True, managed)}
            )
            shape = rng.choice([PodShape.PENDING_STUCK, PodShape.RUNNING, PodShape.SUCCEEDED])
            self.create_pod(sb, 1, shape, sb.kind)

    def oddities(self, count: int, rng: random.Random) -> None:
        """``count`` sandboxes beside the steps' (``o0``, ``o1``, ...), each in one shape of
        :data:`ODDITIES`: a pod and row that would be reapable but for one thing the docs
        promise never to reap. No step is drawn for them (the steps' indexes stop short of them)
        and no burst or row step touches them (``row_frozen``); only a step aimed at the pods
        reapable the longest may pick one that is (its keep annotation ``false``, or removed). A
        shape that changes does so at an instant drawn here, or when the faults are lifted if
        that is sooner (:meth:`later`: the quiet phase judges a world that no longer changes)."""
        for i in range(count):
            odd = rng.choice(ODDITIES)
            kind = "restore" if odd == "restore_pending" else "create"
            sb = Sandbox(f"o{i}", 1, kind, odd != "unmanaged", row_frozen=True)
            self.sandboxes.append(sb)
            name = sb.name()
            pending = kind == "restore" or (odd != "no_statuses" and rng.random() < 0.3)
            shape = (
                PodShape.PENDING_STUCK
                if pending
                else PodShape.SUCCEEDED_NO_STATUSES
                if odd == "no_statuses"
                else rng.choice((PodShape.SUCCEEDED, PodShape.FAILED))
            )
            row = RowTruth(
                sb.sandbox_id,
                1,
                kind,
                "replaced" if pending else rng.choice(sorted(RETIRED_STATES)),
                False,
                sb.managed,
            )
            labels: dict[str, str | None] = {}
            annotations = None
            match odd:
                case "kept":
                    annotations = {KEEP_ANNOTATION: rng.choice(_KEEPING)}
                case "keep_false":
                    annotations = {KEEP_ANNOTATION: rng.choice(_NOT_KEEPING)}
                case "keep_removed":
                    annotations = {KEEP_ANNOTATION: rng.choice(_KEEPING)}
                    self.later(rng.uniform(0.2, 2.5), functools.partial(self._annotate, name, None))
                case "keep_added":
                    value = rng.choice(_KEEPING)
                    self.later(
                        rng.uniform(0.2, 1.5), functools.partial(self._annotate, name, value)
                    )
                case "terminating":
                    at, grace = rng.uniform(0.0, 0.9), rng.uniform(2.0, 8.0)
                    self.later(at, functools.partial(self.server.delete_by_others, name, grace))
                case "sandbox_label":
                    labels = {"space.sandbox-id": "s0"}
                case "generation_label":
                    labels = {"space.generation": "2"}
                case "unlabelled":
                    labels = rng.choice(_UNLABELLED)
                case "unknown_kind":
                    labels = {"space.pod-kind": rng.choice(("clone", None, ""))}
                    row = replace(row, pod_kind=rng.choice(("clone", "snapshot")))
                case "row_active":
                    row = replace(row, active=True)
                case "row_inconsistent":
                    row = replace(row, state=rng.choice(("active", "archived")))
                case "restore_pending" | "no_statuses" | "unmanaged":
                    pass
                case _:
                    raise AssertionError(odd)
            self.trace(f"odd {odd} {name}: row {row}, labels {labels}, annotations {annotations}")
            self.db.commit({name: row})
            self.create_pod(sb, 1, shape, kind, labels=labels, annotations=annotations)

    def _annotate(self, name: str, keep: str | None) -> None:
        """The pod's keep annotation set to ``keep`` (``None``: removed), if the pod is there."""
        pod = self.server.pods.get(name)
        if pod is not None and not pod.terminating:
            self.server.set_annotations(name, None if keep is None else {KEEP_ANNOTATION: keep})

    def pooler_fault(self, kind: str, rng: random.Random) -> None:
        """Arm the seed's transaction-pooler fault (``Variant.pooler``): the listener's
        notifications dropped on the way while its connection stays up and answers. A window
        ends when the faults are lifted, if not before; a connection that drops keeps dropping
        after that (the service has to notice and reconnect)."""
        if kind == "":
            return
        if kind == "start":
            self._pooler_window(rng.uniform(0.5, 3.0))
        elif kind == "window":
            self.net.at(rng.uniform(0.3, 2.5), self._pooler_window, rng.uniform(0.3, 3.0))
        elif kind == "connection":
            self.net.at(rng.uniform(0.3, 2.5), self._drop_notifications)
        else:
            raise AssertionError(kind)

    def _pooler_window(self, length_s: float) -> None:
        """For ``length_s``, the listener's URL leads to a transaction-mode pooler (a switchover
        that moved it there: the listener's connection is cut, and its next ones drop every
        notification)."""
        if not self.net.faults_on:
            return
        db = self.db
        db.pooler_until = self.loop.time() + length_s
        self.trace(f"pg pooler window {length_s:.3f}s")
        db.kill("retired-pod-gc-listener")

        def end() -> None:
            db.pooler_until = 0.0
            self.trace("pg pooler window ends")

        self.later(length_s, end)

    def silent_fault(self, kind: str, rng: random.Random) -> None:
        """Arm the seed's silent-connection fault (``Variant.silent``): at an instant of the
        steps, the open watch's connection dies without a sound (``ApiServer.kill_watches``),
        once or twice, whether or not it has carried a bookmark yet; tried again a moment later
        while none is open. Not once the faults are lifted."""
        if kind == "":
            return
        times = {"once": 1, "twice": 2}[kind]
        self.net.at(rng.uniform(0.5, 4.0), self._kill_watches, times, rng)

    def _kill_watches(self, times: int, rng: random.Random) -> None:
        if not self.net.faults_on:
            return
        if not self.server.kill_watches():
            self.net.at(0.25, self._kill_watches, times, rng)
        elif times > 1:
            self.net.at(rng.uniform(1.0, 4.0), self._kill_watches, times - 1, rng)

    def rotate_token(self, kind: str, rng: random.Random, *, seed: int) -> None:
        """Write the seed's first token into the token file (the server accepts it), and arm the
        seed's rotation (``Variant.rotate``): at an instant of the steps the file gets a new
        token (replaced whole, as the kubelet's atomic writer does) and the old one is revoked,
        at once or a moment later; twice for "twice" (4-6 s apart). Not once the faults are
        lifted."""
        self._seed_token = f"sim-{seed}"
        self.server.accept_token(self._write_token())
        if kind == "":
            return
        lag_s = {"revoked": 0.0, "later": rng.uniform(0.01, 0.5), "twice": 0.0}[kind]
        first_s = rng.uniform(0.5, 4.0)
        self.net.at(first_s, self._rotate, lag_s)
        if kind == "twice":
            # Further apart than a request's budget (API_TIMEOUT_SECONDS, 2 s) and a stall:
            # a request sent again with the first new token is answered before it is revoked.
            self.net.at(first_s + rng.uniform(4.0, 6.0), self._rotate, lag_s)

    def _write_token(self) -> str:
        self._tokens += 1
        token = f"{self._seed_token}-{self._tokens}"
        staged = f"{self.token_file}.new"
        with open(staged, "w", encoding="utf-8") as out:
            out.write(token + "\n")
        os.replace(staged, self.token_file)
        return f"Bearer {token}"

    def _rotate(self, lag_s: float) -> None:
        if not self.net.faults_on:
            return
        old = [t for t in sorted(self.server.tokens)]
        new = self._write_token()
        self.server.accept_token(new)
        self.trace(f"token file rotated: {new[-8:]}, old revoked in {lag_s:.3f}s")
        for token in old:
            if lag_s:
                self.net.at(lag_s, self.server.revoke_token, token)
            else:
                self.server.revoke_token(token)

    def _drop_notifications(self) -> None:
        if self.net.faults_on:
            self.db.drop_notifications()

    def lift_faults(self) -> None:
        self.net.lift()
        self.server.expire_next = 0
        pending, self._pending = self._pending, []
        for timer, callback in pending:
            if not timer.cancelled() and timer.when() > self.loop.time():
                timer.cancel()
                callback()
        self.db.unstall()
        for watch in list(self.server.watches):
            if watch.stalled:
                watch.unstall()

    # -- steps -----------------------------------------------------------------------------

    async def apply(self, step: Step) -> None:
        index = step.index
        if step.kind in TARGETED:
            target = oldest_reapable(self, step.amount)
            index = index if target is None else target
        sb = self.sandboxes[index]
        name = sb.name()
        life = self.life(name)
        row_life = self.rows.get(name)
        row = row_life.current if row_life else None
        server, db, net = self.server, self.db, self.net
        kind = step.kind
        applied = True
        if sb.row_frozen and kind in ROW_STEPS:
            kind = "skip"
        self.trace(f"step {step.kind} {name}")
        match kind:
            case "skip":
                applied = False
                kind = step.kind
            case "shape" | "shape_reapable" | "ip" | "condition":
                if life is None:
                    applied = False
                else:
                    self.set_shape(life, shape_for(step, life))
            case "pod_blip":
                if life is None:
                    applied = False
                else:
                    current = life.states[-1].shape
                    self.set_shape(life, blip_shape(step, life))
                    # Back at once (a latency), or after a while.
                    await asyncio.sleep(net.latency() if step.amount < 0.5 else step.amount / 2)
                    if self.life(name) is life:
                        self.set_shape(life, current)
            case "recreate" | "stale_recreate":
                if kind == "stale_recreate":
                    server.drop_watches(abrupt=True)
                    net.arm("watch", _Fault(status=500), 3)
                    net.arm("list", _Fault(status=500), 3)
                if life is not None:
                    self.delete_pod(life)
                shape, pod_kind = recreated_pod(step, sb.kind)
                self.create_pod(sb, sb.generation, shape, pod_kind)
            case "delete_other":
                if life is None:
                    applied = False
                else:
                    self.delete_pod(life)
            case "create_missing":
                if life is not None:
                    applied = False
                else:
                    self.create_pod(sb, sb.generation, step.shape, sb.kind)
            case "retire":
                if row is None:
                    applied = False
                else:
                    self.update_rows({name: retire(row, step.state)})
            case "reactivate":
                if row is None or row.active:
                    applied = False
                else:
                    self.update_rows({name: reactivate(row)})
            case "row_blip":
                if row is None or row.active:
                    applied = False
                else:
                    middle = row_blip_middle(step, row)
                    gone, behind = _ROW_GAPS.get(step.shape, (False, False))
                    gone = gone and middle.active
                    self.update_rows({name: None if gone else middle})
                    long_gap = gone and not behind
                    await asyncio.sleep(
                        0.2 + 1.5 * step.amount if long_gap else 0.001 + net.latency() * 5
                    )
                    self.update_rows({name: row}, silent=behind)
                    if behind:
                        sb.row_frozen = True
            case "new_generation":
                if row is not None and row.active:
                    self.update_rows({name: retire(row, "replaced")})
                sb.generation += 1
                new_row = RowTruth(
                    sb.sandbox_id, sb.generation, sb.kind, "active", True, sb.managed
                )
                self.update_rows({sb.name(): new_row})
                self.create_pod(sb, sb.generation, PodShape.PENDING_STUCK, sb.kind)
            case "burst":
                await self._burst(step)
            case "watch_drop":
                server.drop_watches(abrupt=step.flag)
            case "watch_410":
                server.expire_next += 1
                server.drop_watches(abrupt=False)
                if step.flag:
                    # ... and the relist that follows fails a few times (it stays relisting).
                    server.fail_after_expire = 1 + int(step.amount * 3)
            case "compact":
                server.compact()
                server.drop_watches(abrupt=step.flag)
            case "api_error":
                code = 429 if step.flag else 500
                op = ["get", "delete", "watch"][int(step.amount * 3)]
                net.arm(
                    op,
                    _Fault(status=code, retry_after="1" if code == 429 else None),
                    1 + int(step.amount * 2),
                )
            case "latency":
                net.arm("get", _Fault(slow_s=0.05 + 0.35 * step.amount), 1 + int(step.amount * 4))
            case "kill_db":
                app = ["retired-pod-gc-listener", "retired-pod-gc", ""][int(step.amount * 3)]
                db.kill(app)
            case "pg_restart":
                db.restart(0.2 + 1.5 * step.amount)
            case "stall_listener":
                db.stall_listeners()
                self.later(0.3 + 0.9 * step.amount, db.unstall)
            case "stall_reactivate":
                if row is None or row.active:
                    applied = False
                else:
                    db.stall_listeners()
                    self.later(0.6 + 0.8 * step.amount, db.unstall)
                    self.update_rows({name: reactivate(row)})
                    if step.flag:
                        await asyncio.sleep(0.1 + 0.3 * step.amount)
                        self.update_rows({name: row})
            case "silent_reactivate":
                if row is None or row.active:
                    applied = False
                else:
                    self.update_rows({name: reactivate(row)}, silent=True)
                    sb.row_frozen = True
            case "loop_stall":
                self.loop.stall(0.05 + 0.6 * step.amount)
                self.trace("loop stalled")
            case "watch_lag":
                stalled = server.stall_watches()

                def unstall() -> None:
                    for watch in stalled:
                        if watch.stalled:
                            watch.unstall()

                self.later(0.2 + 2.0 * step.amount, unstall)
            case "leader_flip":
                self.hooks.set_leader(False)
                self.later(0.05 + step.amount, lambda: self.hooks.set_leader(True))
            case _:
                raise AssertionError(kind)
        self.stats[kind if applied else f"{kind} (n/a)"] += 1

    async def _burst(self, step: Step) -> None:
        wait = token_wait(step)
        if wait is not None:
            self.lift_faults()
            self.net.faults_on = True
        changes = burst_changes(self, None if wait is None else wait[0])
        self.update_rows(changes)
        if wait is not None:
            await self._while_waiting(list(changes), *wait)

    async def _while_waiting(self, names: list[str], variant: str, fraction: float) -> None:
        """The campaign's changes while workers wait for delete tokens (one check each)."""
        await asyncio.sleep(self.threshold_s + 0.3 + 1.2 * fraction)
        lives = [life for life in map(self.life, names) if life is not None]
        left = [life.name for life in lives]
        server, db = self.server, self.db
        self.trace(f"token wait: {variant}")
        if variant in ("lagged", "recreated"):
            self.net.arm("watch", _Fault(status=500), 3)
            server.drop_watches(abrupt=True)
        if not token_wait_pod_changes(self, lives, variant):
            if variant == "stalled":
                db.stall_listeners()
            retired = {name: self.rows[name].current for name in left}
            present = {n: r for n, r in retired.items() if r is not None}
            self.update_rows(token_wait_blip_rows(present, variant), silent=variant == "silent")
            if variant != "silent":
                await asyncio.sleep(0.02)
                self.update_rows(present)
            else:
                for sb in self.sandboxes:
                    sb.row_frozen = sb.row_frozen or sb.name() in retired
        await asyncio.sleep(2.5)
        db.unstall()
