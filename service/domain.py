"""The domain model: wire-string enums, the slim pod snapshot, the execution row, decisions.

Everything here is immutable and free of I/O. Adapters parse wire values into these types at
the boundary; a value they do not recognise becomes an explicit unknown member, which the
classifier never reaps. A value made in bulk at the edge (per watch event, row, notification or
classification) is a frozen msgspec Struct with ``gc=False``, built in C and never tracked by the
garbage collector; every other value is a frozen, slotted dataclass.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec

_E = TypeVar("_E", bound=enum.StrEnum)


class PodPhase(enum.StrEnum):
    """The five Kubernetes pod phases. Anything else on the wire decodes to ``UNKNOWN``."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"


class ExecutionState(enum.StrEnum):
    """``sandbox_k8s_executions.execution_state``."""

    ACTIVE = "active"
    SUSPENDED = "suspended"
    REPLACED = "replaced"
    CANCELLED = "cancelled"
    FAILED = "failed"
    STOPPED = "stopped"
    UNKNOWN = "unknown"


def _wire_parser(unknown: _E) -> Callable[[object], _E]:
    """A parser of the wire strings of ``unknown``'s enum: a string that is no member's value,
    or no string at all, is ``unknown`` (its look-up bound: every row and change is parsed)."""
    get = {member.value: member for member in type(unknown)}.get

    def parse(raw: object) -> _E:
        return get(raw, unknown) if isinstance(raw, str) else unknown

    return parse


parse_execution_state = _wire_parser(ExecutionState.UNKNOWN)

RETIRED_STATES: frozenset[ExecutionState] = frozenset(
    {
        ExecutionState.SUSPENDED,
        ExecutionState.REPLACED,
        ExecutionState.CANCELLED,
        ExecutionState.FAILED,
        ExecutionState.STOPPED,
    }
)
"""States that mean the execution was retired (``active = false`` is required as well)."""


class PodKind(enum.StrEnum):
    """Whether a pod was created fresh or restores a suspended sandbox."""

    CREATE = "create"
    RESTORE = "restore"
    UNKNOWN = "unknown"


parse_pod_kind = _wire_parser(PodKind.UNKNOWN)


class ConditionStatus(enum.StrEnum):
    """Status of the ``PodReadyToStartContainers`` condition, or ``ABSENT`` when not reported."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"
    ABSENT = "absent"


class Mode(enum.StrEnum):
    """What the service does with a reapable pod (``Settings.mode``)."""

    LIVE = "live"
    DRY_RUN = "dry_run"
    DISABLED = "disabled"


class Verdict(enum.StrEnum):
    """The two reapable shapes."""

    TERMINAL_RETIRED = "terminal_retired"
    REPLACED_NEVER_STARTED = "replaced_never_started"


class SkipReason(enum.StrEnum):
    """Why a pod is not reaped. One member per rule; the value is the metric/log label."""

    # pod-only reasons (decided before any database lookup)
    KEEP_ANNOTATION = "keep_annotation"
    """An operator asked to keep the pod (:data:`KEEP_ANNOTATION`)."""
    TERMINATING = "terminating"
    POD_RUNNING = "pod_running"
    PHASE_UNKNOWN = "phase_unknown"
    UNLABELLED = "unlabelled"
    UNKNOWN_POD_KIND = "unknown_pod_kind"
    PENDING_WITH_IP = "pending_with_ip"
    PENDING_RESTORE_POD = "pending_restore_pod"
    PENDING_WITHOUT_CONDITION = "pending_without_condition"
    PENDING_CONDITION_NOT_FALSE = "pending_condition_not_false"
    TERMINAL_NO_CONTAINER_STATUSES = "terminal_no_container_statuses"
    TERMINAL_CONTAINER_NOT_TERMINATED = "terminal_container_not_terminated"
    # reasons that need the execution row
    NO_ROW = "no_row"
    NOT_KUBERNETES_MANAGED = "not_kubernetes_managed"
    NAMESPACE_MISMATCH = "namespace_mismatch"
    POD_NAME_MISMATCH = "pod_name_mismatch"
    SANDBOX_MISMATCH = "sandbox_mismatch"
    GENERATION_MISMATCH = "generation_mismatch"
    POD_KIND_MISMATCH = "pod_kind_mismatch"
    ROW_ACTIVE = "row_active"
    UNKNOWN_STATE = "unknown_state"
    ROW_INCONSISTENT = "row_inconsistent"
    PENDING_NOT_REPLACED = "pending_not_replaced"


KEEP_ANNOTATION = "retired-pod-gc.space.sandbox/keep"
"""A pod annotated with this key is never deleted nor reported as a would-be reap (a retired one
is listed as retired but kept, ``service/engine/kept/``): any value but ``"false"`` (any case)
keeps it, so a typo never deletes a pod someone meant to keep. Removing the annotation restarts
the pod's clock."""


def keep_value_keeps(value: str | None) -> bool:
    """Whether the keep annotation's value (``None``: absent) keeps the pod."""
    return value is not None and value.strip().lower() != "false"


@dataclass(frozen=True, slots=True)
class LabelKeys:
    """Which pod labels carry the sandbox id, the generation and the pod kind."""

    sandbox_id: str = "space.sandbox-id"
    generation: str = "space.generation"
    pod_kind: str = "space.pod-kind"


def pod_key(namespace: str, name: str) -> str:
    """The work-queue key of a pod: ``namespace/name``."""
    return f"{namespace}/{name}"


def split_key(key: str) -> tuple[str, str]:
    """Inverse of :func:`pod_key`. Raises ``ValueError`` for a key without exactly one ``/``."""
    namespace, sep, name = key.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise ValueError(f"not a namespace/name key: {key!r}")
    return namespace, name


class PodSnapshot(msgspec.Struct, frozen=True, gc=False):
    """What classification needs of a pod, and nothing more (kept small: 100k are cached).
    ``all_containers_terminated`` is true only when ``container_count > 0`` and every container
    status is ``terminated``; ``created_at_s`` is ``creationTimestamp`` as Unix seconds, ``None``
    when absent or unparsable; ``keep`` is whether the :data:`KEEP_ANNOTATION` keeps the pod.
    """

    namespace: str
    name: str
    uid: str
    resource_version: str
    phase: PodPhase
    terminating: bool
    pod_ip: str | None
    ready_to_start: ConditionStatus
    container_count: int
    all_containers_terminated: bool
    sandbox_id: str | None
    generation: int | None
    kind: PodKind
    created_at_s: float | None
    keep: bool = False

    @property
    def key(self) -> str:
        return pod_key(self.namespace, self.name)


class ExecutionRow(msgspec.Struct, frozen=True, gc=False):
    """One ``sandbox_k8s_executions`` row joined to its ``sandboxes`` row."""

    pod_name: str
    namespace: str
    sandbox_id: str
    generation: int
    activation_attempt: int
    pod_kind: PodKind
    state: ExecutionState
    active: bool
    kubernetes_managed: bool

    @property
    def key(self) -> str:
        return pod_key(self.namespace, self.pod_name)


class Decision(msgspec.Struct, frozen=True, gc=False):
    """The classifier's answer: exactly one of ``verdict`` and ``reason`` is set (frozen)."""

    verdict: Verdict | None
    reason: SkipReason | None
    rule: str
    """A sentence naming the rule that decided, for logs and ``explain``."""

    @property
    def reapable(self) -> bool:
        return self.verdict is not None

    @property
    def label(self) -> str:
        outcome = self.verdict if self.verdict is not None else self.reason
        assert outcome is not None
        return str(outcome)

    @staticmethod
    def reap(verdict: Verdict, rule: str) -> Decision:
        return Decision(verdict=verdict, reason=None, rule=rule)

    @staticmethod
    def skip(reason: SkipReason, rule: str) -> Decision:
        return Decision(verdict=None, reason=reason, rule=rule)


class Waiting(enum.StrEnum):
    """What a pod whose clock runs waits for (``GET /debug/pending``)."""

    THRESHOLD = "threshold"
    """Not yet continuously reapable for the threshold."""
    VERIFICATION = "verification"
    """Due: the fresh GET, the row re-read and the notification sync, or its turn for them."""
    BUDGET = "budget"
    """Verified, waiting for its turn at the delete budget (or throttled and requeued)."""
    REPORTED = "reported"
    """Dry run: reported once; nothing more happens to this UID."""


class DeleteResult(enum.StrEnum):
    """The expected answers to a preconditioned DELETE; a failure (no answer, another status)
    is raised as a kit error instead (``ports.PodClient``)."""

    DELETED = "deleted"
    GONE = "gone"
    """404: the pod is not there (any more)."""
    CONFLICT = "conflict"
    """409: a precondition (UID, resourceVersion) no longer holds."""


@dataclass(frozen=True, slots=True)
class DeleteOutcome:
    result: DeleteResult
    status: int
    """HTTP status code of the answer."""
    message: str = ""


class Outcome(enum.StrEnum):
    """What one reconcile ended in: the ``verdict`` label of the outcome metric (a reap as its
    verdict, deleted or reported in a dry run, or why not), or :attr:`INACTIVE`, not counted."""

    TERMINAL_RETIRED = Verdict.TERMINAL_RETIRED.value
    REPLACED_NEVER_STARTED = Verdict.REPLACED_NEVER_STARTED.value
    TOO_YOUNG = "too_young"
    """Reapable, but not yet continuously for the threshold: requeued for the remainder."""
    SKIPPED = "skipped"
    """Classified as not reapable (the skip reason is counted separately)."""
    GONE = "gone"
    """The pod vanished (not cached, 404 on GET or DELETE)."""
    CONFLICT = "conflict"
    """The DELETE preconditions failed (409): the pod changed; looked at again later."""
    CHANGED = "changed"
    """The fresh GET or re-read row no longer classifies the same, or the UID changed."""
    LOOKUP_FAILED = "lookup_failed"
    """The row lookup failed; the clock was cleared and the key backs off."""
    ERROR = "error"
    """An API or database error other than the above; the key backs off."""
    ALREADY_REPORTED = "already_reported"
    """Dry run: this UID's would-reap was reported before."""
    THROTTLED = "throttled"
    """The delete budget had no token within the reconcile's wait, or the API server throttled
    the GET or DELETE (429); requeued for later (after its Retry-After), the clock running on."""
    CACHE_COLD = "cache_cold"
    """The pod cache is relisting: nothing is observed from a snapshot that may be stale; every
    candidate is looked at again when the cache is synced."""
    STALE = "stale"
    """The final check kept aging past its bound (a starved loop, slow database); requeued."""
    INACTIVE = "inactive"
    """The replica is disabled or not the leader: nothing is done, nothing counted."""


class ExecutionChange(msgspec.Struct, frozen=True, gc=False):
    """One parsed change of a notification: which pod's execution changed, and how."""

    namespace: str
    pod_name: str
    active: bool | None
    """``None`` when the payload did not say (or the row was deleted)."""
    state: ExecutionState | None
    deleted: bool = False
    received_at_s: float = 0.0
    """Monotonic time the notification was received (for the retirement-to-enqueue metric)."""

    @property
    def key(self) -> str:
        return pod_key(self.namespace, self.pod_name)

    @property
    def retired(self) -> bool:
        """True only when the payload positively says the execution is retired."""
        return (
            not self.deleted
            and self.active is False
            and self.state is not None
            and self.state in RETIRED_STATES
        )
