"""The decision function: is this pod one of the two reapable shapes, given its execution row?

Pure and total: no I/O, no clock, no exceptions for any well-typed input. Every path that is not
one of the two shapes of docs/architecture.md returns a named skip reason; unknown values fail closed.
"""

from __future__ import annotations

from typing import assert_never

from service.domain import (
    KEEP_ANNOTATION,
    RETIRED_STATES,
    ConditionStatus,
    Decision,
    ExecutionRow,
    ExecutionState,
    PodKind,
    PodPhase,
    PodSnapshot,
    SkipReason,
    Verdict,
)

# The decisions whose rule is a fixed sentence, made once: a burst classifies 10,000 pods, and
# each would otherwise build its decision again (Decision is frozen, so one is shared).
_KEEP = Decision.skip(SkipReason.KEEP_ANNOTATION, f"an operator keeps this pod ({KEEP_ANNOTATION})")
_TERMINATING = Decision.skip(SkipReason.TERMINATING, "pod has a deletionTimestamp")
_UNLABELLED = Decision.skip(
    SkipReason.UNLABELLED, "pod lacks a valid sandbox id or generation label"
)
_UNKNOWN_POD_KIND = Decision.skip(
    SkipReason.UNKNOWN_POD_KIND, "pod kind label is not create/restore"
)
_POD_RUNNING = Decision.skip(SkipReason.POD_RUNNING, "Running pods may hold a live VM")
_PHASE_UNKNOWN = Decision.skip(SkipReason.PHASE_UNKNOWN, "phase Unknown proves nothing")
_PENDING_WITH_IP = Decision.skip(
    SkipReason.PENDING_WITH_IP, "a Pending pod with an IP passed RunPodSandbox"
)
_PENDING_RESTORE_POD = Decision.skip(
    SkipReason.PENDING_RESTORE_POD, "Pending restore pods are never reaped"
)
_PENDING_WITHOUT_CONDITION = Decision.skip(
    SkipReason.PENDING_WITHOUT_CONDITION,
    "Pending pod without a PodReadyToStartContainers condition",
)
_PENDING_CONDITION_NOT_FALSE = Decision.skip(
    SkipReason.PENDING_CONDITION_NOT_FALSE, "PodReadyToStartContainers is not False"
)
_TERMINAL_NO_CONTAINER_STATUSES = Decision.skip(
    SkipReason.TERMINAL_NO_CONTAINER_STATUSES,
    "a terminal pod without container statuses is not proof",
)
_TERMINAL_CONTAINER_NOT_TERMINATED = Decision.skip(
    SkipReason.TERMINAL_CONTAINER_NOT_TERMINATED,
    "a terminal pod with a container not terminated",
)
_NO_ROW = Decision.skip(SkipReason.NO_ROW, "no execution row names this pod")
_ROW_ACTIVE = Decision.skip(SkipReason.ROW_ACTIVE, "the execution is still active")
_UNKNOWN_STATE = Decision.skip(SkipReason.UNKNOWN_STATE, "unrecognised execution state")
_NOT_KUBERNETES_MANAGED = Decision.skip(
    SkipReason.NOT_KUBERNETES_MANAGED, "the sandbox is not Kubernetes-managed"
)
_POD_NAME_MISMATCH = Decision.skip(SkipReason.POD_NAME_MISMATCH, "row names a different pod")
_REPLACED_NEVER_STARTED = Decision.reap(
    Verdict.REPLACED_NEVER_STARTED,
    "Pending fresh-create pod, no IP, PodReadyToStartContainers=False, "
    "execution retired as replaced",
)
_TERMINAL_RETIRED = {
    (phase, state): Decision.reap(
        Verdict.TERMINAL_RETIRED,
        f"{phase} pod, every container terminated, execution retired as {state}",
    )
    for phase in (PodPhase.SUCCEEDED, PodPhase.FAILED)
    for state in RETIRED_STATES
}
"""The reap decision of a terminal pod, by (phase, retired state): every pair there is."""


def kept(pod: PodSnapshot) -> Decision | None:
    """The operator's keep rule alone (:data:`KEEP_ANNOTATION`): the skip decision of a kept pod,
    else ``None``. :func:`prefilter` applies it first; ``cancel-create``, which deletes without
    the shape rules, applies it too (``service/app/cancel_create.py``)."""
    return _KEEP if pod.keep else None


def prefilter(pod: PodSnapshot) -> Decision | None:
    """Skip decisions that need no database row; ``None`` means "look the row up"."""
    keep = kept(pod)
    if keep is not None:
        return keep
    if pod.terminating:
        return _TERMINATING
    if pod.sandbox_id is None or pod.generation is None:
        return _UNLABELLED
    if pod.kind is PodKind.UNKNOWN:
        return _UNKNOWN_POD_KIND
    # By identity, the likeliest phases of a burst first (a ``match`` compares by ``==``).
    phase = pod.phase
    if phase is PodPhase.PENDING:
        return _prefilter_pending(pod)
    if phase is PodPhase.SUCCEEDED or phase is PodPhase.FAILED:
        return _prefilter_terminal(pod)
    if phase is PodPhase.RUNNING:
        return _POD_RUNNING
    if phase is PodPhase.UNKNOWN:
        return _PHASE_UNKNOWN
    assert_never(phase)


def _prefilter_pending(pod: PodSnapshot) -> Decision | None:
    if pod.pod_ip:
        return _PENDING_WITH_IP
    if pod.kind is PodKind.RESTORE:
        return _PENDING_RESTORE_POD
    ready = pod.ready_to_start
    if ready is ConditionStatus.FALSE:
        return None
    if ready is ConditionStatus.ABSENT:
        return _PENDING_WITHOUT_CONDITION
    if ready is ConditionStatus.TRUE or ready is ConditionStatus.UNKNOWN:
        return _PENDING_CONDITION_NOT_FALSE
    assert_never(ready)


def _prefilter_terminal(pod: PodSnapshot) -> Decision | None:
    if pod.container_count == 0:
        return _TERMINAL_NO_CONTAINER_STATUSES
    if not pod.all_containers_terminated:
        return _TERMINAL_CONTAINER_NOT_TERMINATED
    return None


def classify(pod: PodSnapshot, row: ExecutionRow | None) -> Decision:
    """Classify ``pod`` against its execution ``row`` (``None`` when there is none)."""
    early = prefilter(pod)
    if early is not None:
        return early
    return _classify_prefiltered(pod, row)


def _classify_prefiltered(pod: PodSnapshot, row: ExecutionRow | None) -> Decision:
    """The rest of :func:`classify`, for a pod that :func:`prefilter` let through."""
    if row is None:
        return _NO_ROW
    identity = _identity_mismatch(pod, row)
    if identity is not None:
        return identity
    if row.active:
        return _ROW_ACTIVE
    state = row.state
    if state is ExecutionState.UNKNOWN:
        return _UNKNOWN_STATE
    if state not in RETIRED_STATES:
        return Decision.skip(
            SkipReason.ROW_INCONSISTENT, f"row is inactive but its state is {state}"
        )
    if pod.phase is PodPhase.PENDING:
        if state is ExecutionState.REPLACED:
            return _REPLACED_NEVER_STARTED
        return Decision.skip(
            SkipReason.PENDING_NOT_REPLACED,
            f"Pending pods are reaped only when retired as replaced, not {state}",
        )
    reap = _TERMINAL_RETIRED.get((pod.phase, state))
    if reap is not None:
        return reap
    # Not a pod the prefilter lets through (a caller's bug): never a reap.
    return prefilter(pod) or _PHASE_UNKNOWN


def _identity_mismatch(pod: PodSnapshot, row: ExecutionRow) -> Decision | None:
    if not row.kubernetes_managed:
        return _NOT_KUBERNETES_MANAGED
    if row.namespace != pod.namespace:
        return Decision.skip(
            SkipReason.NAMESPACE_MISMATCH,
            f"row namespace {row.namespace!r} differs from pod namespace {pod.namespace!r}",
        )
    if row.pod_name != pod.name:
        return _POD_NAME_MISMATCH
    if row.sandbox_id != pod.sandbox_id:
        return Decision.skip(
            SkipReason.SANDBOX_MISMATCH,
            f"row sandbox {row.sandbox_id!r} differs from pod label {pod.sandbox_id!r}",
        )
    if row.generation != pod.generation:
        return Decision.skip(
            SkipReason.GENERATION_MISMATCH,
            f"row generation {row.generation} differs from pod label {pod.generation}",
        )
    if row.pod_kind is not pod.kind:
        return Decision.skip(
            SkipReason.POD_KIND_MISMATCH,
            f"row pod kind {row.pod_kind} differs from pod label {pod.kind}",
        )
    return None
