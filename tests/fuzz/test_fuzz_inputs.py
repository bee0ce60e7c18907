"""Fuzzing every outside input with hypothesis: no crash, no unexpected exception, no reap.

Inputs: pod JSON (``service.kube.decode``), NOTIFY payloads
(``service.pg.payload.parse_payload``) and the environment (``service.config.load``).
Watch-stream framing is fuzzed end to end in ``test_fuzz_watch_stream.py``. The "never reaps"
oracles restate the table of docs/architecture.md over the *raw* input, independently of the
decoder and the classifier: a verdict is only acceptable when the raw document literally has the
reapable shape.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.classifier import classify
from service.config import (
    DRY_RUN,
    ENABLED,
    VARIABLES,
    ConfigError,
    Settings,
    effective,
    load,
)
from service.domain import (
    RETIRED_STATES,
    ExecutionRow,
    ExecutionState,
    LabelKeys,
    PodSnapshot,
    Verdict,
    parse_execution_state,
)
from service.kube.decode import PodDecodeError, PodDecoder
from service.pg.payload import parse_payload

WATCHED = ("sandboxes", "b")
"""The namespaces the listener watches: a ``pods`` change is one change in each."""

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
decoder = PodDecoder()
KEYS = LabelKeys()

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["Succeeded", "Failed", "Pending", "Running", "False", "True", ""])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def reapable_terminal_pod() -> dict[str, Any]:
    return {
        "metadata": {
            "name": "space-sbx-abc-g1",
            "namespace": "sandboxes",
            "uid": "u-1",
            "resourceVersion": "7",
            "labels": {KEYS.sandbox_id: "abc", KEYS.generation: "1", KEYS.pod_kind: "create"},
        },
        "status": {
            "phase": "Succeeded",
            "conditions": [{"type": "PodReadyToStartContainers", "status": "False"}],
            "containerStatuses": [{"state": {"terminated": {"exitCode": 0}}}],
        },
    }


def reapable_pending_pod() -> dict[str, Any]:
    pod = reapable_terminal_pod()
    pod["status"] = {
        "phase": "Pending",
        "conditions": [{"type": "PodReadyToStartContainers", "status": "False"}],
        "containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}],
    }
    return pod


PATHS = [
    ("metadata",),
    ("metadata", "name"),
    ("metadata", "uid"),
    ("metadata", "resourceVersion"),
    ("metadata", "deletionTimestamp"),
    ("metadata", "labels"),
    ("metadata", "labels", KEYS.generation),
    ("metadata", "labels", KEYS.pod_kind),
    ("metadata", "labels", KEYS.sandbox_id),
    ("status",),
    ("status", "phase"),
    ("status", "podIP"),
    ("status", "conditions"),
    ("status", "containerStatuses"),
]


@st.composite
def mutated_pods(draw: st.DrawFn) -> dict[str, Any]:
    pod: dict[str, Any] = draw(st.sampled_from([reapable_terminal_pod, reapable_pending_pod]))()
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS))
        parent: Any = pod
        for part in path[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if not isinstance(parent, dict):
            continue
        if draw(st.booleans()):
            parent.pop(path[-1], None)
        else:
            parent[path[-1]] = draw(json_values)
    return pod


def _dig(doc: Any, *path: str) -> Any:
    for part in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(part)
    return doc


def raw_has_reapable_shape(doc: Any, verdict: Verdict) -> bool:
    """The table of docs/architecture.md over the raw JSON (independent of decoder and
    classifier)."""
    labels = _dig(doc, "metadata", "labels")
    if not isinstance(labels, dict) or _dig(doc, "metadata", "deletionTimestamp") is not None:
        return False
    generation = labels.get(KEYS.generation)
    if not (isinstance(generation, str) and generation.isascii() and generation.isdigit()):
        return False
    statuses = _dig(doc, "status", "containerStatuses")
    conditions = _dig(doc, "status", "conditions")
    phase = _dig(doc, "status", "phase")
    if verdict is Verdict.TERMINAL_RETIRED:
        return (
            phase in ("Succeeded", "Failed")
            and isinstance(statuses, list)
            and len(statuses) > 0
            and all(
                isinstance(_dig(s, "state"), dict)
                and _dig(s, "state", "terminated") is not None
                and _dig(s, "state", "running") is None
                and _dig(s, "state", "waiting") is None
                for s in statuses
            )
        )
    return (
        phase == "Pending"
        and labels.get(KEYS.pod_kind) == "create"
        and not _dig(doc, "status", "podIP")
        and isinstance(conditions, list)
        and any(
            isinstance(c, dict)
            and c.get("type") == "PodReadyToStartContainers"
            and c.get("status") == "False"
            for c in conditions
        )
    )


def retired_row_for(snap: PodSnapshot, state: ExecutionState) -> ExecutionRow:
    return ExecutionRow(
        pod_name=snap.name,
        namespace=snap.namespace,
        sandbox_id=snap.sandbox_id or "",
        generation=snap.generation if snap.generation is not None else -1,
        activation_attempt=0,
        pod_kind=snap.kind,
        state=state,
        active=False,
        kubernetes_managed=True,
    )


# ------------------------------------------------------------------ pod decoder


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes_decode_or_raise_pod_decode_error(data: bytes) -> None:
    try:
        snap = decoder.decode(data)
    except PodDecodeError:
        return
    assert snap.uid and snap.name and snap.namespace and snap.resource_version


@FUZZ
@given(mutated_pods(), st.sampled_from([ExecutionState.REPLACED, ExecutionState.SUSPENDED]))
def test_a_mutated_pod_never_reaps_unless_the_raw_json_has_the_reapable_shape(
    doc: dict[str, Any], state: ExecutionState
) -> None:
    raw = json.dumps(doc).encode()
    try:
        snap = decoder.decode(raw)
    except PodDecodeError:
        return
    # The most permissive row there is: it matches the pod's own identity and is retired.
    decision = classify(snap, retired_row_for(snap, state))
    if decision.verdict is not None:
        assert raw_has_reapable_shape(doc, decision.verdict), (decision, doc)


@FUZZ
@given(json_values)
def test_any_json_document_decodes_or_raises_pod_decode_error(doc: Any) -> None:
    try:
        snap = decoder.decode(msgspec.json.encode(doc))
    except PodDecodeError:
        return
    # Only a document with every identity field can decode (never a half-empty snapshot).
    assert isinstance(doc, dict) and snap.uid == _dig(doc, "metadata", "uid")


@FUZZ
@given(st.lists(json_values | mutated_pods(), max_size=5))
def test_a_list_page_of_garbage_items_counts_them_bad_and_keeps_the_good(items: list[Any]) -> None:
    body = msgspec.json.encode({"metadata": {"resourceVersion": "9"}, "items": items})
    _, pods, bad = decoder.decode_list(body)
    assert len(pods) + bad == len(items)


# ------------------------------------------------------------------ NOTIFY payloads


@FUZZ
@given(st.text(max_size=200))
def test_arbitrary_text_payloads_parse_to_changes_with_keys_or_are_counted(payload: str) -> None:
    parsed = parse_payload(payload, received_at_s=1.0, namespaces=WATCHED)
    assert all(c.namespace and c.pod_name for c in parsed.changes)
    assert parsed.changes or parsed.malformed >= 1


pods_values = (
    st.tuples(
        st.sampled_from(["insert", "update", "delete", "truncate", ""]) | json_scalars,
        st.booleans() | json_scalars,
        st.sampled_from([s.value for s in ExecutionState]) | st.text(max_size=10) | json_scalars,
        st.lists(st.text(max_size=6) | json_scalars, max_size=5) | json_scalars,
    ).map(list)
    # 0003's earlier `groups` element (it named a namespace): not a group of this shape.
    | st.tuples(
        st.sampled_from(["insert", "update", "delete"]),
        st.text(max_size=6),
        st.booleans(),
        st.text(max_size=10),
        st.lists(st.text(max_size=6), max_size=3),
    ).map(list)
    | st.lists(json_scalars, max_size=6)
)


def _valid_head(group: list[Any]) -> bool:
    op, active, state = group[:3]
    return (
        op in ("insert", "update", "delete")
        and (active is None or isinstance(active, bool))
        and (state is None or isinstance(state, str))
    )


@FUZZ
@given(st.lists(pods_values, max_size=6))
def test_pods_keep_exactly_their_valid_names_in_each_namespace_and_count_the_others(
    groups: list[list[Any]],
) -> None:
    parsed = parse_payload(json.dumps({"pods": groups}), received_at_s=1.0, namespaces=WATCHED)
    shaped = [g for g in groups if isinstance(g, list) and len(g) == 4 and isinstance(g[3], list)]
    valid = [
        name for g in shaped if _valid_head(g) for name in g[3] if isinstance(name, str) and name
    ]
    # Group by group: each valid name once per watched namespace, in the namespaces' order.
    expected = []
    for g in shaped:
        if not _valid_head(g):
            continue
        names = [n for n in g[3] if isinstance(n, str) and n]
        expected += [(ns, n) for ns in WATCHED for n in names]
    assert [(c.namespace, c.pod_name) for c in parsed.changes] == expected
    # Each bad part counted once: a bad name, each name of a group with bad facts, a non-group.
    parts = (len(groups) - len(shaped)) + sum(len(g[3]) for g in shaped)
    assert parsed.malformed == (max(1, parts) if not valid else parts - len(valid))
    # Never retired unless its group literally says so.
    for change in parsed.changes:
        if change.retired:
            assert any(
                _valid_head(g)
                and change.pod_name in g[3]
                and g[0] in ("insert", "update")
                and g[1] is False
                and parse_execution_state(g[2]) in RETIRED_STATES
                for g in shaped
            )


# ------------------------------------------------------------------ configuration

NAMES = [v.name for v in VARIABLES]
# A real environment cannot hold NUL (execve strings are NUL-terminated): left out.
env_values = (
    st.text(st.characters(blacklist_characters="\x00"), max_size=12)
    | st.sampled_from(["true", "false", "0", "1", "-1", "1e309", "nan", "inf", " 5 ", "0x10"])
    | st.integers(-(10**12), 10**12).map(str)
    | st.floats(allow_nan=True, allow_infinity=True).map(repr)
)


@FUZZ
@given(st.dictionaries(st.sampled_from(NAMES), env_values, max_size=8))
def test_any_environment_loads_or_raises_one_config_error(env: dict[str, str]) -> None:
    try:
        loaded = load(env)
    except ConfigError as exc:
        assert exc.variable in NAMES
        assert "\n" not in str(exc)
        return
    assert isinstance(loaded, Settings)
    # Every bounded number ends up inside its declared range (clamped, never passed through).
    shown = {name: value for name, value, _ in effective(loaded, env)}
    for var in VARIABLES:
        if var.lo is None and var.hi is None:
            continue
        text = shown.get(var.name, "")
        if text in ("", "None"):
            continue
        value = float(text)
        assert math.isfinite(value), (var.name, text)
        assert var.lo is None or value >= var.lo, (var.name, text)
        assert var.hi is None or value <= var.hi, (var.name, text)
    assert loaded.leader.retry_period_s < loaded.leader.renew_deadline_s
    assert loaded.leader.renew_deadline_s < loaded.leader.lease_duration_s
    if ENABLED.name not in env:
        assert loaded.enabled is False  # off unless asked for
    if DRY_RUN.name not in env:
        assert loaded.dry_run is True  # dry run unless asked for
