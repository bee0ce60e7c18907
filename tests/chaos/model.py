"""The campaign's ground truth: what each pod UID and each execution row looked like, and when.

Written independently of ``service.classifier`` on purpose: the oracle here restates the table of
docs/architecture.md ("The two reapable shapes") over the driver's own model of a pod (a small
:class:`PodShape` enum, never the wire JSON), so a bug in the classifier or the decoder cannot hide
itself by being reused by the checker. How the driver writes a shape on the wire is
:func:`tests.chaos.world.pod_status`: nothing here reads or writes pod JSON.

Timelines:

* a pod UID's states are recorded at the exact ``time.time()`` of the emulator call that made
  them (emulator mutations are synchronous on the event loop, so nothing can observe a state
  before it is recorded); two changes in the same instant are separated by a microsecond so
  that a blip always has a positive length;
* a row change becomes visible at its COMMIT, somewhere between the moment the driver sent the
  statement and the moment the driver got its answer: it is recorded as that interval
  ``[lo, hi]``, and the oracle accepts either the old or the new row inside it (leniency that
  can only hide a violation narrower than one local round trip to PostgreSQL).
"""

from __future__ import annotations

import bisect
import enum
import itertools
from dataclasses import dataclass, field, replace

NAMESPACE = "sandboxes"
RETIRED_STATES = frozenset({"suspended", "replaced", "cancelled", "failed", "stopped"})
"""docs/architecture.md: ``active = false`` with any retired state (``stopped`` included);
anything else — ``active`` or an unknown string — never reaps."""
KEEP_ANNOTATION = "retired-pod-gc.space.sandbox/keep"
"""README: a pod an operator annotates with it is never deleted nor reported."""


def keeps(value: str | None) -> bool:
    """docs/architecture.md: the keep annotation keeps the pod when present with ``"true"`` or
    any value but ``"false"`` (any case, surrounding blanks aside)."""
    return value is not None and value.strip().lower() != "false"


POD_KINDS = frozenset({"create", "restore"})
"""The pod kinds there are; a pod or row of any other kind never reaps (unknown values fail
closed), even when the two agree."""


class PodShape(enum.StrEnum):
    """The pod statuses the driver writes (a superset of what the controller cares about)."""

    PENDING_STUCK = "pending_stuck"
    """Pending, no IP, PodReadyToStartContainers=False: reapable when replaced (create pods)."""
    PENDING_WITH_IP = "pending_with_ip"
    PENDING_NO_CONDITION = "pending_no_condition"
    PENDING_READY = "pending_ready"
    """Pending, no IP, PodReadyToStartContainers=True."""
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SUCCEEDED_NO_STATUSES = "succeeded_no_statuses"
    FAILED_CONTAINER_RUNNING = "failed_container_running"
    UNKNOWN_PHASE = "unknown_phase"


TERMINAL_REAPABLE = frozenset({PodShape.SUCCEEDED, PodShape.FAILED})
NON_REAPABLE_SHAPES = tuple(
    s for s in PodShape if s not in TERMINAL_REAPABLE and s is not PodShape.PENDING_STUCK
)


@dataclass(frozen=True, slots=True)
class PodTruth:
    """One pod state as the driver wrote it."""

    shape: PodShape
    sandbox_id: str | None
    """The sandbox-id label (``None``: absent or empty)."""
    generation: int | None
    """The generation label (``None``: absent or not a plain decimal number)."""
    kind: str
    """The pod-kind label: ``create`` or ``restore`` (anything else: an unknown kind)."""
    terminating: bool = False
    keep: bool = False
    """The keep annotation keeps the pod (README: never deleted nor reported)."""


@dataclass(frozen=True, slots=True)
class RowTruth:
    """One execution row as committed (namespace is always :data:`NAMESPACE`)."""

    sandbox_id: str
    generation: int
    pod_kind: str
    state: str
    active: bool
    managed: bool = True


def reapable(pod: PodTruth | None, row: RowTruth | None) -> bool:
    """The two reapable shapes of docs/architecture.md, restated over the driver's model."""
    if pod is None or row is None or pod.terminating or pod.keep or pod.kind not in POD_KINDS:
        return False
    if not row.managed or row.active or row.state not in RETIRED_STATES:
        return False
    if (row.sandbox_id, row.generation, row.pod_kind) != (pod.sandbox_id, pod.generation, pod.kind):
        return False
    if pod.shape in TERMINAL_REAPABLE:
        return True
    return pod.shape is PodShape.PENDING_STUCK and pod.kind == "create" and row.state == "replaced"


def retired_kept(pod: PodTruth | None, row: RowTruth | None) -> bool:
    """Retired but kept (docs/architecture.md): a pod whose Kubernetes-managed row is inactive
    and that is not one of the reapable shapes (restated over the driver's model)."""
    return (
        pod is not None
        and row is not None
        and row.managed
        and not row.active
        and not reapable(pod, row)
    )


def pod_shape_reapable(pod: PodTruth) -> bool:
    """Could this pod state be reaped with some row? (pod side only)."""
    if pod.terminating or pod.keep or pod.kind not in POD_KINDS:
        return False
    if pod.sandbox_id is None or pod.generation is None:
        return False
    return pod.shape in TERMINAL_REAPABLE or (
        pod.shape is PodShape.PENDING_STUCK and pod.kind == "create"
    )


@dataclass
class PodLife:
    """Every state of one pod UID, with exact times and resourceVersions."""

    uid: str
    name: str
    times: list[float] = field(default_factory=list)
    states: list[PodTruth] = field(default_factory=list)
    rvs: list[str] = field(default_factory=list)
    ended_at: float | None = None
    """When the pod stopped existing or became terminating (by the driver or the service)."""
    ended_by_service: bool = False

    def record(self, t: float, state: PodTruth, rv: str) -> float:
        if self.times and t <= self.times[-1]:
            t = self.times[-1] + 1e-6
        self.times.append(t)
        self.states.append(state)
        self.rvs.append(rv)
        return t

    def end(self, t: float, *, by_service: bool) -> None:
        if self.ended_at is None:
            self.ended_at = max(t, self.times[-1] + 1e-6 if self.times else t)
            self.ended_by_service = by_service

    def at(self, t: float) -> PodTruth | None:
        """The state at time ``t`` (``None`` before creation or after the end)."""
        i = bisect.bisect_right(self.times, t) - 1
        if i < 0 or (self.ended_at is not None and t >= self.ended_at):
            return None
        return self.states[i]

    def rv_at(self, t: float) -> str | None:
        i = bisect.bisect_right(self.times, t) - 1
        return None if i < 0 else self.rvs[i]

    @property
    def current(self) -> PodTruth | None:
        if self.ended_at is not None or not self.states:
            return None
        return self.states[-1]


@dataclass
class RowLife:
    """Every committed state of one execution row (``None``: no row), with commit intervals."""

    name: str
    los: list[float] = field(default_factory=list)
    his: list[float] = field(default_factory=list)
    states: list[RowTruth | None] = field(default_factory=list)

    def record(self, lo: float, hi: float, state: RowTruth | None) -> None:
        self.los.append(lo)
        self.his.append(hi)
        self.states.append(state)

    def candidates(self, t: float) -> list[RowTruth | None]:
        """The row states that may have been visible at ``t`` (two inside a commit interval)."""
        i = bisect.bisect_right(self.los, t) - 1
        if i < 0:
            return [None]
        before = self.states[i - 1] if i >= 1 else None
        if t <= self.his[i]:
            return [before, self.states[i]]
        return [self.states[i]]

    def points(self, a: float, b: float) -> list[float]:
        return [x for lo, hi in zip(self.los, self.his, strict=True) for x in (lo, hi) if a < x < b]

    @property
    def current(self) -> RowTruth | None:
        return self.states[-1] if self.states else None


def continuously_reapable(
    pod: PodLife, row: RowLife | None, a: float, b: float
) -> tuple[bool, str]:
    """Was ``pod`` (one UID) reapable at every instant of ``[a, b]``? (ok, why not)."""
    if b <= a:
        return True, ""
    cuts = sorted({a, b, *(t for t in pod.times if a < t < b), *(row.points(a, b) if row else [])})
    if pod.ended_at is not None and a < pod.ended_at < b:
        cuts = sorted({*cuts, pod.ended_at})
    # Each elementary interval is judged at its midpoint: states are constant inside it.
    for lo, hi in itertools.pairwise(cuts):
        mid = (lo + hi) / 2
        state = pod.at(mid)
        rows = row.candidates(mid) if row is not None else [None]
        if not any(reapable(state, r) for r in rows):
            return False, (
                f"not reapable during [{lo:.3f}, {hi:.3f}] (pod {state}, row {rows[-1]})"
            )
    return True, ""


def action_window_ok(
    life: PodLife,
    row: RowLife | None,
    *,
    since: float,
    reread: float,
    seen: float,
    until: float,
    got: float | None,
    deleted: bool,
    digits: int,
) -> tuple[bool, str]:
    """Invariants 1 and 3 for a DELETE (``deleted``) or a dry-run report of ``life`` at
    ``until``, as both checkers judge it: pod and row reapable together from ``since`` (a
    threshold before the action) up to ``seen`` (the final re-read, which began at ``reread``).
    A row change after the re-read is the accepted race. A DELETE's pod must also stay reapable
    up to ``until``: its resourceVersion precondition pins it to the fresh GET, made before the
    re-read. A report has no precondition: its pod is judged as the last fresh GET before the
    re-read (``got``) saw it. ``digits``: the decimals of the times in the reason."""
    if not deleted:
        pod_at_get = life.at(got) if got is not None else None
        if got is None or pod_at_get is None:
            return False, "no fresh GET of a live pod before its final re-read"
        ok, why = continuously_reapable(life, row, since, got)
        if ok:
            frozen = PodLife(life.uid, life.name, [got], [pod_at_get], [life.rv_at(got) or ""])
            ok, why = continuously_reapable(frozen, row, got, seen)
        if not ok:
            return (
                False,
                f"{why}; fresh GET at {got:.{digits}f}, final re-read at {reread:.{digits}f}",
            )
        return True, ""
    ok, why = continuously_reapable(life, row, since, seen)
    if not ok:
        return False, f"{why}; final re-read at {reread:.{digits}f}"
    for changed, state in zip(life.times, life.states, strict=True):
        if reread < changed <= until and not pod_shape_reapable(state):
            return False, f"pod {state} at {changed:.{digits}f}, after the final re-read"
    return True, ""


def retire(row: RowTruth, state: str) -> RowTruth:
    return replace(row, state=state, active=False)


def reactivate(row: RowTruth) -> RowTruth:
    return replace(row, state="active", active=True)
