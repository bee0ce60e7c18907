"""Pure parts of the PostgreSQL adapter: row decoding, payload parsing, SQL rendering, the
listener's reconnect policy."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.domain import ExecutionState, PodKind
from service.pg.listener import BACKOFF_MAX_S, default_backoff, parse_payload
from service.pg.migrate import DEFAULT_CHANNEL, render_trigger_sql, steps
from service.pg.store import _REQUIRED, decode_row


def _record(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "pod_name": "space-sbx-a-g1",
        "namespace": "sandboxes",
        "sandbox_id": "a",
        "generation": 1,
        "activation_attempt": 0,
        "pod_kind": "create",
        "execution_state": "suspended",
        "active": False,
    }
    base.update(overrides)
    return base


def test_decode_row_maps_every_known_state_and_unknown_strings_to_unknown() -> None:
    for state in ExecutionState:
        row = decode_row(_record(execution_state=str(state)))
        assert row is not None
        assert row.state is state
    row = decode_row(_record(execution_state="hibernating"))
    assert row is not None and row.state is ExecutionState.UNKNOWN


def test_decode_row_maps_pod_kinds_and_unknown_kind_to_unknown() -> None:
    for kind in PodKind:
        row = decode_row(_record(pod_kind=str(kind)))
        assert row is not None and row.pod_kind is kind
    row = decode_row(_record(pod_kind="clone"))
    assert row is not None and row.pod_kind is PodKind.UNKNOWN


def test_decode_row_copies_fields_and_marks_rows_kubernetes_managed() -> None:
    row = decode_row(_record(generation=7, activation_attempt=3, active=True))
    assert row is not None
    assert (row.pod_name, row.namespace, row.sandbox_id) == ("space-sbx-a-g1", "sandboxes", "a")
    assert (row.generation, row.activation_attempt, row.active) == (7, 3, True)
    assert row.kubernetes_managed is True


@pytest.mark.parametrize("column", _REQUIRED)
def test_decode_row_rejects_a_null_in_any_required_column(column: str) -> None:
    assert decode_row(_record(**{column: None})) is None


@pytest.mark.parametrize(
    ("column", "value"),
    [("generation", True), ("generation", "1"), ("activation_attempt", 1.5), ("active", 0)],
)
def test_decode_row_rejects_mistyped_values(column: str, value: object) -> None:
    assert decode_row(_record(**{column: value})) is None


def _payload(**overrides: Any) -> str:
    body: dict[str, Any] = {
        "op": "update",
        "namespace": "sandboxes",
        "pod_name": "space-sbx-a-g1",
        "active": False,
        "execution_state": "suspended",
    }
    body.update(overrides)
    return json.dumps(body)


def test_parse_payload_update_retired() -> None:
    change = parse_payload(_payload(), received_at_s=12.5)
    assert change is not None
    assert change.key == "sandboxes/space-sbx-a-g1"
    assert change.active is False and change.state is ExecutionState.SUSPENDED
    assert change.retired and not change.deleted
    assert change.received_at_s == 12.5


def test_parse_payload_reactivation_is_not_retired() -> None:
    change = parse_payload(_payload(active=True, execution_state="active"), received_at_s=0)
    assert change is not None and change.active is True and not change.retired


def test_parse_payload_delete_carries_no_state() -> None:
    change = parse_payload(_payload(op="delete"), received_at_s=0)
    assert change is not None
    assert change.deleted and change.active is None and change.state is None
    assert not change.retired


def test_parse_payload_unknown_state_string_is_unknown_member() -> None:
    change = parse_payload(_payload(execution_state="weird"), received_at_s=0)
    assert change is not None and change.state is ExecutionState.UNKNOWN
    assert not change.retired


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "not json",
        "null",
        "[1, 2]",
        "{}",
        '{"op": "insert"}',
        _payload(op="truncate"),
        _payload(namespace=""),
        _payload(pod_name=""),
        _payload(pod_name=5),
        _payload(active="false"),
        _payload(execution_state=3),
    ],
)
def test_parse_payload_rejects_garbage(garbage: str) -> None:
    assert parse_payload(garbage, received_at_s=0) is None


def test_trigger_sql_carries_the_configured_channel_as_trigger_argument() -> None:
    sql = render_trigger_sql("my_channel_2")
    assert sql.count("('my_channel_2')") == 2
    assert f"('{DEFAULT_CHANNEL}')" not in sql
    assert render_trigger_sql(DEFAULT_CHANNEL).count(f"('{DEFAULT_CHANNEL}')") == 2


@pytest.mark.parametrize("bad", ["", "1abc", "a-b", "a'b", 'a"b', "x" * 64, "a b"])
def test_trigger_sql_refuses_a_channel_that_is_not_an_identifier(bad: str) -> None:
    with pytest.raises(ValueError):
        render_trigger_sql(bad)


def test_steps_include_the_schema_only_when_asked() -> None:
    assert [s.name for s in steps(channel="c", with_schema=False)] == ["0002_notify_trigger"]
    assert [s.name for s in steps(channel="c", with_schema=True)] == [
        "0001_dev_schema",
        "0002_notify_trigger",
    ]
    # The checksum depends on the channel, so a channel change re-applies the trigger.
    a, b = steps(channel="a", with_schema=False)[0], steps(channel="b", with_schema=False)[0]
    assert a.sha256 != b.sha256


def test_the_default_reconnect_policy_is_equal_jitter_from_0_1_s_to_the_cap() -> None:
    policy = default_backoff()
    assert (policy.initial_s, policy.max_s, policy.jitter) == (0.1, BACKOFF_MAX_S, 0.5)
    # Each call makes a policy of its own (its own random source), never a shared one.
    assert default_backoff().rng is not policy.rng
