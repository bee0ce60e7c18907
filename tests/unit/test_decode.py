"""The pod decoder against real API server bodies (tests/fixtures/wire) and against garbage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.classifier import classify, prefilter
from service.domain import (
    KEEP_ANNOTATION,
    ConditionStatus,
    ExecutionRow,
    ExecutionState,
    LabelKeys,
    PodKind,
    PodPhase,
    SkipReason,
    Verdict,
)
from service.kube.decode import PodDecodeError, PodDecoder

WIRE = Path(__file__).parent.parent / "fixtures" / "wire"
decoder = PodDecoder()


def body(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((WIRE / name).read_text())["body"]
    return loaded


def raw(name: str) -> bytes:
    return json.dumps(body(name)).encode()


def test_decodes_the_stuck_fresh_create_pending_pod() -> None:
    pod = decoder.decode(raw("pod-pending-stuck-create.json"))
    assert (pod.namespace, pod.name) == ("sandboxes", "space-sbx-01a1be5ebfdd-g2")
    assert pod.uid == "702569c6-fa55-49b9-a2aa-2763b8e3ce6f"
    assert pod.resource_version == "326"
    assert pod.phase is PodPhase.PENDING
    assert pod.pod_ip is None
    assert pod.ready_to_start is ConditionStatus.FALSE
    assert (pod.container_count, pod.all_containers_terminated) == (1, False)
    assert (pod.sandbox_id, pod.generation, pod.kind) == ("01a1be5ebfdd", 2, PodKind.CREATE)
    assert not pod.terminating
    assert pod.created_at_s is not None
    assert prefilter(pod) is None


@pytest.mark.parametrize(
    ("fixture", "phase", "kind", "reason"),
    [
        ("pod-running.json", PodPhase.RUNNING, PodKind.CREATE, SkipReason.POD_RUNNING),
        ("pod-pending-with-ip.json", PodPhase.PENDING, PodKind.CREATE, SkipReason.PENDING_WITH_IP),
        (
            "pod-pending-restore.json",
            PodPhase.PENDING,
            PodKind.RESTORE,
            SkipReason.PENDING_RESTORE_POD,
        ),
        ("pod-succeeded-suspended.json", PodPhase.SUCCEEDED, PodKind.CREATE, None),
        ("pod-failed-restore.json", PodPhase.FAILED, PodKind.RESTORE, None),
    ],
)
def test_decodes_each_realistic_shape(
    fixture: str, phase: PodPhase, kind: PodKind, reason: SkipReason | None
) -> None:
    pod = decoder.decode(raw(fixture))
    assert pod.phase is phase
    assert pod.kind is kind
    early = prefilter(pod)
    assert (early.reason if early else None) is reason
    if phase in (PodPhase.SUCCEEDED, PodPhase.FAILED):
        assert pod.all_containers_terminated and pod.container_count == 1


def test_decoded_terminal_pod_reaps_against_its_retired_row() -> None:
    pod = decoder.decode(raw("pod-succeeded-suspended.json"))
    assert pod.sandbox_id is not None and pod.generation is not None
    row = ExecutionRow(
        pod_name=pod.name,
        namespace=pod.namespace,
        sandbox_id=pod.sandbox_id,
        generation=pod.generation,
        activation_attempt=1,
        pod_kind=pod.kind,
        state=ExecutionState.SUSPENDED,
        active=False,
        kubernetes_managed=True,
    )
    assert classify(pod, row).verdict is Verdict.TERMINAL_RETIRED


def test_deletion_timestamp_marks_terminating() -> None:
    doc = body("pod-succeeded-suspended.json")
    doc["metadata"]["deletionTimestamp"] = "2026-11-29T20:40:00Z"
    assert decoder.decode(json.dumps(doc)).terminating


def test_configured_label_keys_are_used() -> None:
    doc = body("pod-pending-stuck-create.json")
    doc["metadata"]["labels"] = {"x/id": "s1", "x/gen": "7", "x/kind": "restore"}
    pod = PodDecoder(LabelKeys(sandbox_id="x/id", generation="x/gen", pod_kind="x/kind")).decode(
        json.dumps(doc)
    )
    assert (pod.sandbox_id, pod.generation, pod.kind) == ("s1", 7, PodKind.RESTORE)
    default = decoder.decode(json.dumps(doc))
    assert (default.sandbox_id, default.generation) == (None, None)


@pytest.mark.parametrize("generation", ["abc", "", "-1", "+2", " 2", "1.0", "٣", "9999999999"])
def test_garbage_generation_label_is_unlabelled(generation: str) -> None:
    doc = body("pod-pending-stuck-create.json")
    doc["metadata"]["labels"]["space.generation"] = generation
    pod = decoder.decode(json.dumps(doc))
    assert pod.generation is None
    early = prefilter(pod)
    assert early is not None and early.reason is SkipReason.UNLABELLED


def test_unknown_phase_condition_and_kind_map_to_unknown_members() -> None:
    doc = body("pod-pending-stuck-create.json")
    doc["status"]["phase"] = "Exploded"
    doc["status"]["conditions"][0]["status"] = "Maybe"
    doc["metadata"]["labels"]["space.pod-kind"] = "clone"
    pod = decoder.decode(json.dumps(doc))
    assert pod.phase is PodPhase.UNKNOWN
    assert pod.ready_to_start is ConditionStatus.UNKNOWN
    assert pod.kind is PodKind.UNKNOWN
    assert prefilter(pod) is not None


def test_missing_status_and_containers_never_reap() -> None:
    doc = body("pod-succeeded-suspended.json")
    del doc["status"]
    pod = decoder.decode(json.dumps(doc))
    assert pod.phase is PodPhase.UNKNOWN and pod.container_count == 0
    doc = body("pod-succeeded-suspended.json")
    doc["status"]["containerStatuses"][0]["state"] = {}
    pod = decoder.decode(json.dumps(doc))
    assert not pod.all_containers_terminated
    early = prefilter(pod)
    assert early is not None and early.reason is SkipReason.TERMINAL_CONTAINER_NOT_TERMINATED


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"not json",
        b"[]",
        b"null",
        b'{"metadata": 5}',
        b'{"metadata": {"name": "a", "namespace": "b"}}',
        b'{"metadata": {"name": "a", "namespace": "b", "uid": "u"}}',
        b'{"metadata": {"name": 1, "namespace": "b", "uid": "u", "resourceVersion": "1"}}',
        b'{"metadata": {"name": "a", "namespace": "b", "uid": "u", "resourceVersion": "1",'
        b' "labels": {"space.generation": 2}}}',
        b'{"metadata": {"name": "a", "namespace": "b", "uid": "u", "resourceVersion": "1"},'
        b' "status": {"conditions": "oops"}}',
    ],
)
def test_garbage_raises_a_defined_decode_error(garbage: bytes) -> None:
    with pytest.raises(PodDecodeError):
        decoder.decode(garbage)


def test_list_page_skips_bad_items_and_keeps_good_ones() -> None:
    page = body("list-page1.json")
    page["items"].append({"metadata": {"name": "broken"}})
    meta, pods, bad = decoder.decode_list(json.dumps(page).encode())
    assert bad == 1
    assert len(pods) == len(page["items"]) - 1
    assert meta.metadata.resourceVersion == page["metadata"]["resourceVersion"]
    assert meta.metadata.continue_ == page["metadata"]["continue"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


@given(
    meta=st.dictionaries(
        st.sampled_from(["name", "namespace", "uid", "resourceVersion", "labels", "annotations"]),
        json_values,
    ),
    status=json_values,
)
def test_fuzzed_objects_decode_or_raise_the_defined_error(meta: object, status: object) -> None:
    doc = msgspec.json.encode({"metadata": meta, "status": status})
    try:
        pod = decoder.decode(doc)
    except PodDecodeError:
        return
    # a decoded fuzz object has no valid labels, so it can never be a candidate
    assert prefilter(pod) is not None


# --- the keep annotation ---------------------------------------------------------------------

KEEPING = {
    None: False,
    "true": True,
    "True": True,
    " TRUE ": True,
    "false": False,
    "FALSE": False,
    "": True,
    "yes": True,
    "1": True,
}


@pytest.mark.parametrize(("value", "kept"), KEEPING.items())
def test_the_keep_annotation_keeps_unless_absent_or_false(value: str | None, kept: bool) -> None:
    doc = body("pod-succeeded-suspended.json")
    annotations = {"kubectl.kubernetes.io/last-applied-configuration": '{"a": "b\\"c"}'}
    if value is not None:
        annotations[KEEP_ANNOTATION] = value
    doc["metadata"]["annotations"] = annotations
    pod = decoder.decode(json.dumps(doc).encode())
    assert pod.keep is kept
    decision = prefilter(pod)
    assert (decision is not None and decision.reason is SkipReason.KEEP_ANNOTATION) is kept


@pytest.mark.parametrize(
    "annotations",
    [
        # a value that is not a string cannot be shown not to keep
        b'{"retired-pod-gc.space.sandbox/keep": 1}',
        b'{"retired-pod-gc.space.sandbox/keep": null, "x": "y"}',
        # an escaped value is still the value
        b'{"a": "\\"q\\"", "retired-pod-gc.space.sandbox/keep": "\\u0074rue"}',
    ],
)
def test_an_odd_or_escaped_value_still_keeps(annotations: bytes) -> None:
    doc = (
        b'{"metadata": {"name": "p", "namespace": "sandboxes", "uid": "u", '
        b'"resourceVersion": "1", "annotations": ' + annotations + b"}}"
    )
    assert decoder.decode(doc).keep is True


@pytest.mark.parametrize("annotations", [b"null", b"{}", b'{"other/keep": "true"}'])
def test_no_keep_annotation_keeps_nothing(annotations: bytes) -> None:
    doc = (
        b'{"metadata": {"name": "p", "namespace": "sandboxes", "uid": "u", '
        b'"resourceVersion": "1", "annotations": ' + annotations + b"}}"
    )
    assert decoder.decode(doc).keep is False
