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


def prefilter(pod: PodSnapshot) -> Decision | None:
    """Skip decisions that need no database row; ``None`` means "look the row up"."""
    if pod.keep:
        return Decision.skip(
            SkipReason.KEEP_ANNOTATION, f"an operator keeps this pod ({KEEP_ANNOTATION})"
        )
    if pod.terminating:
        return Decision.skip(SkipReason.TERMINATING, "pod has a deletionTimestamp")
    if pod.sandbox_id is None or pod.generation is None:
        return Decision.skip(
            SkipReason.UNLABELLED, "pod lacks a valid sandbox id or generation label"
        )
    if pod.kind is PodKind.UNKNOWN:
        return Decision.skip(SkipReason.UNKNOWN_POD_KIND, "pod kind label is not create/restore")
    match pod.phase:
        case PodPhase.RUNNING:
            return Decision.skip(SkipReason.POD_RUNNING, "Running pods may hold a live VM")
        case PodPhase.UNKNOWN:
            return Decision.skip(SkipReason.PHASE_UNKNOWN, "phase Unknown proves nothing")
        case PodPhase.PENDING:
            return _prefilter_pending(pod)
        case PodPhase.SUCCEEDED | PodPhase.FAILED:
            return _prefilter_terminal(pod)
        case _ as unreachable:
            assert_never(unreachable)


def _prefilter_pending(pod: PodSnapshot) -> Decision | None:
    if pod.pod_ip:
        return Decision.skip(
            SkipReason.PENDING_WITH_IP, "a Pending pod with an IP passed RunPodSandbox"
        )
    if pod.kind is PodKind.RESTORE:
        return Decision.skip(
            SkipReason.PENDING_RESTORE_POD, "Pending restore pods are never reaped"
        )
    match pod.ready_to_start:
        case ConditionStatus.FALSE:
            return None
        case ConditionStatus.ABSENT:
            return Decision.skip(
                SkipReason.PENDING_WITHOUT_CONDITION,
                "Pending pod without a PodReadyToStartContainers condition",
            )
        case ConditionStatus.TRUE | ConditionStatus.UNKNOWN:
            return Decision.skip(
                SkipReason.PENDING_CONDITION_NOT_FALSE,
                "PodReadyToStartContainers is not False",
            )
        case _ as unreachable:
            assert_never(unreachable)


def _prefilter_terminal(pod: PodSnapshot) -> Decision | None:
    if pod.container_count == 0:
        return Decision.skip(
            SkipReason.TERMINAL_NO_CONTAINER_STATUSES,
            "a terminal pod without container statuses is not proof",
        )
    if not pod.all_containers_terminated:
        return Decision.skip(
            SkipReason.TERMINAL_CONTAINER_NOT_TERMINATED,
            "a terminal pod with a container not terminated",
        )
    return None


def classify(pod: PodSnapshot, row: ExecutionRow | None) -> Decision:
    """Classify ``pod`` against its execution ``row`` (``None`` when there is none)."""
    early = prefilter(pod)
    if early is not None:
        return early
    return classify_prefiltered(pod, row)


def classify_prefiltered(pod: PodSnapshot, row: ExecutionRow | None) -> Decision:
    """The rest of :func:`classify` for a pod that :func:`prefilter` let through (``None``).

    For a caller that has just run the prefilter on this very snapshot (frozen, and the
    prefilter is pure, so its answer cannot have changed): a burst's observation would
    otherwise run the prefilter twice a key."""
    if row is None:
        return Decision.skip(SkipReason.NO_ROW, "no execution row names this pod")
    identity = _identity_mismatch(pod, row)
    if identity is not None:
        return identity
    if row.active:
        return Decision.skip(SkipReason.ROW_ACTIVE, "the execution is still active")
    if row.state is ExecutionState.UNKNOWN:
        return Decision.skip(SkipReason.UNKNOWN_STATE, "unrecognised execution state")
    if row.state not in RETIRED_STATES:
        return Decision.skip(
            SkipReason.ROW_INCONSISTENT, f"row is inactive but its state is {row.state}"
        )
    if pod.phase is PodPhase.PENDING:
        if row.state is ExecutionState.REPLACED:
            return Decision.reap(
                Verdict.REPLACED_NEVER_STARTED,
                "Pending fresh-create pod, no IP, PodReadyToStartContainers=False, "
                "execution retired as replaced",
            )
        return Decision.skip(
            SkipReason.PENDING_NOT_REPLACED,
            f"Pending pods are reaped only when retired as replaced, not {row.state}",
        )
    return Decision.reap(
        Verdict.TERMINAL_RETIRED,
        f"{pod.phase} pod, every container terminated, execution retired as {row.state}",
    )


def _identity_mismatch(pod: PodSnapshot, row: ExecutionRow) -> Decision | None:
    if not row.kubernetes_managed:
        return Decision.skip(
            SkipReason.NOT_KUBERNETES_MANAGED, "the sandbox is not Kubernetes-managed"
        )
    if row.namespace != pod.namespace:
        return Decision.skip(
            SkipReason.NAMESPACE_MISMATCH,
            f"row namespace {row.namespace!r} differs from pod namespace {pod.namespace!r}",
        )
    if row.pod_name != pod.name:
        return Decision.skip(SkipReason.POD_NAME_MISMATCH, "row names a different pod")
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
