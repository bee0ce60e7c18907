"""The classifier: exhaustive over the enums, named regressions, and properties (hypothesis)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st
from msgspec.structs import replace

from service.classifier import classify, prefilter
from service.domain import (
    RETIRED_STATES,
    ConditionStatus,
    ExecutionRow,
    ExecutionState,
    PodKind,
    PodPhase,
    PodSnapshot,
    SkipReason,
    Verdict,
)

NS = "sandboxes"


def make_pod(**overrides: object) -> PodSnapshot:
    base = PodSnapshot(
        namespace=NS,
        name="space-sbx-abc-g2",
        uid="uid-1",
        resource_version="10",
        phase=PodPhase.PENDING,
        terminating=False,
        pod_ip=None,
        ready_to_start=ConditionStatus.FALSE,
        container_count=1,
        all_containers_terminated=False,
        sandbox_id="abc",
        generation=2,
        kind=PodKind.CREATE,
        created_at_s=0.0,
    )
    return replace(base, **overrides)


def make_row(pod: PodSnapshot, **overrides: object) -> ExecutionRow:
    base = ExecutionRow(
        pod_name=pod.name,
        namespace=pod.namespace,
        sandbox_id=pod.sandbox_id or "abc",
        generation=pod.generation if pod.generation is not None else 2,
        activation_attempt=1,
        pod_kind=pod.kind,
        state=ExecutionState.REPLACED,
        active=False,
        kubernetes_managed=True,
    )
    return replace(base, **overrides)


STUCK = make_pod()
TERMINAL = make_pod(
    phase=PodPhase.SUCCEEDED,
    pod_ip="192.0.2.12",
    all_containers_terminated=True,
    ready_to_start=ConditionStatus.FALSE,
)


# --- named regressions -----------------------------------------------------------------------


def test_reaps_the_stuck_container_creating_shape() -> None:
    decision = classify(STUCK, make_row(STUCK, state=ExecutionState.REPLACED))
    assert decision.verdict is Verdict.REPLACED_NEVER_STARTED
    assert decision.reason is None


def test_reaps_a_terminal_pod_of_a_suspended_execution() -> None:
    decision = classify(TERMINAL, make_row(TERMINAL, state=ExecutionState.SUSPENDED))
    assert decision.verdict is Verdict.TERMINAL_RETIRED


def test_reaps_a_terminal_restore_pod() -> None:
    for phase in (PodPhase.SUCCEEDED, PodPhase.FAILED):
        pod = replace(TERMINAL, phase=phase, kind=PodKind.RESTORE)
        decision = classify(pod, make_row(pod, state=ExecutionState.SUSPENDED))
        assert decision.verdict is Verdict.TERMINAL_RETIRED, phase


def test_never_reaps_a_pod_whose_execution_is_active() -> None:
    for phase, state in itertools.product(PodPhase, ExecutionState):
        for pod in (replace(STUCK, phase=phase), replace(TERMINAL, phase=phase)):
            decision = classify(pod, make_row(pod, active=True, state=state))
            assert not decision.reapable, (phase, state)


def test_skips_a_replaced_pending_pod_with_an_ip() -> None:
    pod = replace(STUCK, pod_ip="192.0.2.10")
    assert classify(pod, make_row(pod)).reason is SkipReason.PENDING_WITH_IP


def test_skips_a_replaced_pending_pod_without_the_condition() -> None:
    pod = replace(STUCK, ready_to_start=ConditionStatus.ABSENT)
    assert classify(pod, make_row(pod)).reason is SkipReason.PENDING_WITHOUT_CONDITION


def test_skips_a_pending_pod_whose_condition_is_true_or_unknown() -> None:
    for status in (ConditionStatus.TRUE, ConditionStatus.UNKNOWN):
        pod = replace(STUCK, ready_to_start=status)
        assert classify(pod, make_row(pod)).reason is SkipReason.PENDING_CONDITION_NOT_FALSE


def test_skips_a_pending_restore_pod() -> None:
    pod = replace(STUCK, kind=PodKind.RESTORE)
    assert classify(pod, make_row(pod)).reason is SkipReason.PENDING_RESTORE_POD


def test_skips_a_terminal_pod_with_a_running_container() -> None:
    pod = replace(TERMINAL, container_count=2, all_containers_terminated=False)
    decision = classify(pod, make_row(pod, state=ExecutionState.SUSPENDED))
    assert decision.reason is SkipReason.TERMINAL_CONTAINER_NOT_TERMINATED


def test_skips_a_terminal_pod_without_container_statuses() -> None:
    pod = replace(TERMINAL, container_count=0, all_containers_terminated=False)
    decision = classify(pod, make_row(pod, state=ExecutionState.SUSPENDED))
    assert decision.reason is SkipReason.TERMINAL_NO_CONTAINER_STATUSES


def test_skips_identity_mismatches() -> None:
    cases = {
        SkipReason.NAMESPACE_MISMATCH: {"namespace": "other"},
        SkipReason.POD_NAME_MISMATCH: {"pod_name": "space-sbx-abc-g3"},
        SkipReason.SANDBOX_MISMATCH: {"sandbox_id": "xyz"},
        SkipReason.GENERATION_MISMATCH: {"generation": 3},
        SkipReason.POD_KIND_MISMATCH: {"pod_kind": PodKind.RESTORE},
    }
    for pod in (STUCK, TERMINAL):
        for reason, change in cases.items():
            decision = classify(pod, make_row(pod, **change))
            assert decision.reason is reason, (pod.phase, reason)


def test_skips_sandboxes_not_managed_by_kubernetes() -> None:
    for pod in (STUCK, TERMINAL):
        decision = classify(pod, make_row(pod, kubernetes_managed=False))
        assert decision.reason is SkipReason.NOT_KUBERNETES_MANAGED


def test_skips_unknown_execution_states() -> None:
    for pod in (STUCK, TERMINAL):
        decision = classify(pod, make_row(pod, state=ExecutionState.UNKNOWN))
        assert decision.reason is SkipReason.UNKNOWN_STATE


def test_skips_an_inactive_row_whose_state_still_says_active() -> None:
    decision = classify(TERMINAL, make_row(TERMINAL, state=ExecutionState.ACTIVE))
    assert decision.reason is SkipReason.ROW_INCONSISTENT


def test_skips_a_pending_pod_retired_other_than_replaced() -> None:
    for state in RETIRED_STATES - {ExecutionState.REPLACED}:
        decision = classify(STUCK, make_row(STUCK, state=state))
        assert decision.reason is SkipReason.PENDING_NOT_REPLACED, state


def test_skips_a_pod_without_a_row() -> None:
    for pod in (STUCK, TERMINAL):
        assert classify(pod, None).reason is SkipReason.NO_ROW


def test_skips_terminating_running_unknown_and_unlabelled_pods_before_any_lookup() -> None:
    cases = {
        SkipReason.TERMINATING: replace(TERMINAL, terminating=True),
        SkipReason.POD_RUNNING: replace(STUCK, phase=PodPhase.RUNNING),
        SkipReason.PHASE_UNKNOWN: replace(STUCK, phase=PodPhase.UNKNOWN),
        SkipReason.UNLABELLED: replace(STUCK, sandbox_id=None),
        SkipReason.UNKNOWN_POD_KIND: replace(STUCK, kind=PodKind.UNKNOWN),
    }
    for reason, pod in cases.items():
        early = prefilter(pod)
        assert early is not None and early.reason is reason
        # and the full classification agrees, whatever the row says
        assert classify(pod, make_row(replace(pod, generation=2))).reason is reason
    assert prefilter(replace(STUCK, generation=None)) is not None


def test_the_keep_annotation_skips_every_pod_before_any_lookup_whatever_the_row() -> None:
    rows: list[ExecutionRow | None] = [None]
    for pod in (STUCK, TERMINAL, replace(TERMINAL, terminating=True)):
        kept = replace(pod, keep=True)
        early = prefilter(kept)
        assert early is not None and early.reason is SkipReason.KEEP_ANNOTATION
        assert "retired-pod-gc.space.sandbox/keep" in early.rule
        for row in [*rows, *(make_row(pod, state=s) for s in RETIRED_STATES)]:
            assert classify(kept, row).reason is SkipReason.KEEP_ANNOTATION
    # the same pods without the annotation are the two reapable shapes
    assert classify(STUCK, make_row(STUCK)).verdict is Verdict.REPLACED_NEVER_STARTED
    assert classify(TERMINAL, make_row(TERMINAL)).verdict is Verdict.TERMINAL_RETIRED


def test_prefilter_passes_exactly_the_two_candidate_shapes() -> None:
    assert prefilter(STUCK) is None
    assert prefilter(TERMINAL) is None


# --- exhaustive sweep ------------------------------------------------------------------------

CONTAINERS = {
    "all_terminated": (1, True),
    "some_running": (2, False),
    "none": (0, False),
}


def _expected(pod: PodSnapshot, row: ExecutionRow | None) -> Verdict | None:
    """An independent statement of the table of docs/architecture.md: the only two reapable
    shapes."""
    if row is None or row.active or pod.terminating:
        return None
    if row.state not in RETIRED_STATES:
        return None
    if pod.phase in (PodPhase.SUCCEEDED, PodPhase.FAILED):
        if pod.container_count > 0 and pod.all_containers_terminated:
            return Verdict.TERMINAL_RETIRED
        return None
    if (
        pod.phase is PodPhase.PENDING
        and row.state is ExecutionState.REPLACED
        and pod.kind is PodKind.CREATE
        and pod.pod_ip is None
        and pod.ready_to_start is ConditionStatus.FALSE
    ):
        return Verdict.REPLACED_NEVER_STARTED
    return None


def test_exhaustive_sweep_matches_the_design_table() -> None:
    rows: list[tuple[bool, ExecutionState] | None] = [None]
    rows += [(active, state) for active in (True, False) for state in ExecutionState]
    checked = 0
    reaped = {Verdict.TERMINAL_RETIRED: 0, Verdict.REPLACED_NEVER_STARTED: 0}
    for phase, kind, ip, cond, containers, terminating, row_spec in itertools.product(
        PodPhase,
        PodKind,
        (None, "10.0.0.1"),
        ConditionStatus,
        CONTAINERS,
        (False, True),
        rows,
    ):
        count, every = CONTAINERS[containers]
        pod = replace(
            STUCK,
            phase=phase,
            kind=kind,
            pod_ip=ip,
            ready_to_start=cond,
            container_count=count,
            all_containers_terminated=every,
            terminating=terminating,
        )
        row = None
        if row_spec is not None:
            row = make_row(pod, active=row_spec[0], state=row_spec[1])
            if kind is PodKind.UNKNOWN:
                row = replace(row, pod_kind=PodKind.CREATE)
        decision = classify(pod, row)
        expected = None if kind is PodKind.UNKNOWN else _expected(pod, row)
        assert decision.verdict is expected, (pod, row, decision)
        assert (decision.verdict is None) != (decision.reason is None)
        assert decision.rule
        if decision.verdict is not None:
            reaped[decision.verdict] += 1
        checked += 1
    assert checked == 5 * 3 * 2 * 4 * 3 * 2 * 15
    assert all(n > 0 for n in reaped.values()), reaped


# --- properties ------------------------------------------------------------------------------

texts = st.one_of(st.none(), st.text(max_size=8), st.sampled_from(["abc", "sandboxes"]))
pods = st.builds(
    PodSnapshot,
    namespace=st.sampled_from([NS, "other"]),
    name=st.sampled_from(["space-sbx-abc-g2", "space-sbx-abc-g3", "x"]),
    uid=st.text(min_size=1, max_size=4),
    resource_version=st.text(min_size=1, max_size=4),
    phase=st.sampled_from(PodPhase),
    terminating=st.booleans(),
    pod_ip=st.one_of(st.none(), st.just("10.1.1.1"), st.just("")),
    ready_to_start=st.sampled_from(ConditionStatus),
    container_count=st.integers(min_value=0, max_value=3),
    all_containers_terminated=st.booleans(),
    sandbox_id=texts,
    generation=st.one_of(st.none(), st.integers(min_value=0, max_value=4)),
    kind=st.sampled_from(PodKind),
    created_at_s=st.one_of(st.none(), st.floats(allow_nan=False)),
    keep=st.booleans(),
)
rows = st.one_of(
    st.none(),
    st.builds(
        ExecutionRow,
        pod_name=st.sampled_from(["space-sbx-abc-g2", "space-sbx-abc-g3", "x"]),
        namespace=st.sampled_from([NS, "other"]),
        sandbox_id=st.sampled_from(["abc", "xyz", ""]),
        generation=st.integers(min_value=0, max_value=4),
        activation_attempt=st.integers(min_value=0, max_value=3),
        pod_kind=st.sampled_from(PodKind),
        state=st.sampled_from(ExecutionState),
        active=st.booleans(),
        kubernetes_managed=st.booleans(),
    ),
)


@given(pod=pods, row=rows)
def test_classifier_is_total_and_deterministic(pod: PodSnapshot, row: ExecutionRow | None) -> None:
    first = classify(pod, row)
    assert first == classify(pod, row)
    assert (first.verdict is None) != (first.reason is None)


@given(pod=pods, row=rows)
def test_classifier_never_reaps_what_an_invariant_forbids(
    pod: PodSnapshot, row: ExecutionRow | None
) -> None:
    decision = classify(pod, row)
    if not decision.reapable:
        return
    assert row is not None and not row.active and row.kubernetes_managed
    assert row.state in RETIRED_STATES
    assert pod.phase not in (PodPhase.RUNNING, PodPhase.UNKNOWN)
    assert not pod.terminating
    assert not pod.keep
    assert (row.namespace, row.pod_name, row.sandbox_id, row.generation, row.pod_kind) == (
        pod.namespace,
        pod.name,
        pod.sandbox_id,
        pod.generation,
        pod.kind,
    )
    if pod.phase is PodPhase.PENDING:
        assert decision.verdict is Verdict.REPLACED_NEVER_STARTED
        assert row.state is ExecutionState.REPLACED and pod.kind is PodKind.CREATE
        assert not pod.pod_ip and pod.ready_to_start is ConditionStatus.FALSE
    else:
        assert decision.verdict is Verdict.TERMINAL_RETIRED
        assert pod.container_count > 0 and pod.all_containers_terminated


@given(pod=pods, row=rows)
def test_classify_answers_what_the_prefilter_answers_for_a_pod_it_skips_whatever_the_row(
    pod: PodSnapshot, row: ExecutionRow | None
) -> None:
    # The one entry: observation and verification both call classify, and a pod the prefilter
    # skips (terminating, kept, Pending with an IP, ...) is skipped for that reason whatever
    # its row says.
    early = prefilter(pod)
    if early is not None:
        assert classify(pod, row) == early


@given(pod=pods)
def test_prefilter_skip_implies_classify_skip(pod: PodSnapshot) -> None:
    early = prefilter(pod)
    if early is not None:
        row = make_row(replace(pod, sandbox_id="abc", generation=2), active=False)
        assert classify(pod, row) == early


def test_classify_never_reaps_a_running_or_unknown_pod_whatever_its_retired_row() -> None:
    for phase, reason in (
        (PodPhase.RUNNING, SkipReason.POD_RUNNING),
        (PodPhase.UNKNOWN, SkipReason.PHASE_UNKNOWN),
    ):
        pod = replace(TERMINAL, phase=phase)
        for state in RETIRED_STATES:
            decision = classify(pod, make_row(pod, state=state))
            assert decision.verdict is None
            assert decision.reason is reason
