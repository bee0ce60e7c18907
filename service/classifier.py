"""The decision function: is this pod one of the two reapable shapes, given its execution row?

Pure and total: no I/O, no clock, no exceptions for any well-typed input. Every path that is not
one of the two shapes of docs/architecture.md returns a named skip reason; unknown values fail
closed.
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

# The decisions whose rule is a fixed sentence (Decision is frozen, so one of each is shared).
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
    """The operator's keep rule alone (:data:`KEEP_ANNOTATION`): a kept pod's skip, else ``None``;
    :func:`prefilter` applies it first, ``cancel-create`` (no shape rules) applies it too."""
    return _KEEP if pod.keep else None


def prefilter(pod: PodSnapshot) -> Decision | None:
    """Skip decisions that need no database row; ``None`` means "look the row up". Each rule is a
    function of this module called by its name (the mutation check disables one by that name,
    ``tests/chaos/removals.py``); the first that answers decides."""
    decision = kept(pod) or _terminating(pod) or _unlabelled(pod) or _unknown_pod_kind(pod)
    if decision is not None:
        return decision
    phase = pod.phase
    if phase is PodPhase.PENDING:
        return _pending_with_ip(pod) or _pending_restore_pod(pod) or _pending_condition(pod)
    if phase is PodPhase.SUCCEEDED or phase is PodPhase.FAILED:
        return _terminal_without_container_statuses(pod) or _terminal_container_running(pod)
    if phase is PodPhase.RUNNING:
        return _POD_RUNNING
    if phase is PodPhase.UNKNOWN:
        return _PHASE_UNKNOWN
    assert_never(phase)


def _terminating(pod: PodSnapshot) -> Decision | None:
    return _TERMINATING if pod.terminating else None


def _unlabelled(pod: PodSnapshot) -> Decision | None:
    return _UNLABELLED if pod.sandbox_id is None or pod.generation is None else None


def _unknown_pod_kind(pod: PodSnapshot) -> Decision | None:
    return _UNKNOWN_POD_KIND if pod.kind is PodKind.UNKNOWN else None


def _pending_with_ip(pod: PodSnapshot) -> Decision | None:
    return _PENDING_WITH_IP if pod.pod_ip else None


def _pending_restore_pod(pod: PodSnapshot) -> Decision | None:
    return _PENDING_RESTORE_POD if pod.kind is PodKind.RESTORE else None


def _pending_condition(pod: PodSnapshot) -> Decision | None:
    ready = pod.ready_to_start
    if ready is ConditionStatus.FALSE:
        return None
    if ready is ConditionStatus.ABSENT:
        return _PENDING_WITHOUT_CONDITION
    if ready is ConditionStatus.TRUE or ready is ConditionStatus.UNKNOWN:
        return _PENDING_CONDITION_NOT_FALSE
    assert_never(ready)


def _terminal_without_container_statuses(pod: PodSnapshot) -> Decision | None:
    return _TERMINAL_NO_CONTAINER_STATUSES if pod.container_count == 0 else None


def _terminal_container_running(pod: PodSnapshot) -> Decision | None:
    # A pod without container statuses is _terminal_without_container_statuses's alone.
    if pod.container_count == 0 or pod.all_containers_terminated:
        return None
    return _TERMINAL_CONTAINER_NOT_TERMINATED


def classify(pod: PodSnapshot, row: ExecutionRow | None) -> Decision:
    """Classify ``pod`` against its execution ``row`` (``None`` when there is none)."""
    early = prefilter(pod)
    if early is not None:
        return early
    if row is None:
        return _NO_ROW
    skip = _identity_mismatch(pod, row) or _row_active(row)
    if skip is not None:
        return skip
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
    # Only a terminal pod gets here (the prefilter lets no other phase through).
    return _TERMINAL_RETIRED.get((pod.phase, state), _PHASE_UNKNOWN)


def _row_active(row: ExecutionRow) -> Decision | None:
    return _ROW_ACTIVE if row.active else None


def _identity_mismatch(pod: PodSnapshot, row: ExecutionRow) -> Decision | None:
    """The row's identity fields against the pod's, each a rule called by its name."""
    return (
        _not_kubernetes_managed(pod, row)
        or _namespace_mismatch(pod, row)
        or _pod_name_mismatch(pod, row)
        or _sandbox_mismatch(pod, row)
        or _generation_mismatch(pod, row)
        or _pod_kind_mismatch(pod, row)
    )


def _not_kubernetes_managed(_pod: PodSnapshot, row: ExecutionRow) -> Decision | None:
    return None if row.kubernetes_managed else _NOT_KUBERNETES_MANAGED


def _namespace_mismatch(pod: PodSnapshot, row: ExecutionRow) -> Decision | None:
    if row.namespace == pod.namespace:
        return None
    return Decision.skip(
        SkipReason.NAMESPACE_MISMATCH,
        f"row namespace {row.namespace!r} differs from pod namespace {pod.namespace!r}",
    )


def _pod_name_mismatch(pod: PodSnapshot, row: ExecutionRow) -> Decision | None:
    return None if row.pod_name == pod.name else _POD_NAME_MISMATCH


def _sandbox_mismatch(pod: PodSnapshot, row: ExecutionRow) -> Decision | None:
    # A pod without the label is the prefilter's `unlabelled` alone.
    if pod.sandbox_id is None or row.sandbox_id == pod.sandbox_id:
        return None
    return _label_mismatch(SkipReason.SANDBOX_MISMATCH, "sandbox", row.sandbox_id, pod.sandbox_id)


def _generation_mismatch(pod: PodSnapshot, row: ExecutionRow) -> Decision | None:
    if pod.generation is None or row.generation == pod.generation:
        return None
    return _label_mismatch(
        SkipReason.GENERATION_MISMATCH, "generation", row.generation, pod.generation
    )


def _label_mismatch(reason: SkipReason, what: str, in_row: object, on_pod: object) -> Decision:
    """The skip of a pod whose label says another ``what`` than its row. The rules test the
    match themselves: it is on every classification's path, the skip is not."""
    return Decision.skip(reason, f"row {what} {in_row!r} differs from pod label {on_pod!r}")


def _pod_kind_mismatch(pod: PodSnapshot, row: ExecutionRow) -> Decision | None:
    if row.pod_kind is pod.kind:
        return None
    return Decision.skip(
        SkipReason.POD_KIND_MISMATCH,
        f"row pod kind {row.pod_kind} differs from pod label {pod.kind}",
    )
