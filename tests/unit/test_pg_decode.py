"""Pure parts of the PostgreSQL adapter: row decoding, payload parsing, SQL rendering, the
listener's reconnect policy."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.domain import ExecutionChange, ExecutionState, PodKind
from service.pg.listener import (
    BACKOFF_MAX_S,
    MAX_PAYLOAD_BYTES,
    ParsedPayload,
    default_backoff,
    parse_payload,
)
from service.pg.migrate import DEFAULT_CHANNEL, render_trigger_sql, steps
from service.pg.store import COLUMNS, LOOKUP_SQL, decode_row


def _record(**overrides: Any) -> tuple[Any, ...]:
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
    return tuple(base[column] for column in COLUMNS)


def test_lookup_selects_the_columns_decode_row_unpacks_in_its_order() -> None:
    select = LOOKUP_SQL.split("SELECT", 1)[1].split("FROM", 1)[0]
    selected = tuple(item.strip().rpartition(".")[2] for item in select.split(","))
    assert selected == COLUMNS


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


@pytest.mark.parametrize("value", [1, 1.5, b"active", ["active"], {"active": True}])
def test_decode_row_maps_a_state_or_kind_of_another_type_to_unknown(value: object) -> None:
    # Another column type in a schema the project did not write (an unhashable one included):
    # the row decodes, with the unknown member, and is never reaped on it.
    row = decode_row(_record(execution_state=value, pod_kind=value))
    assert row is not None
    assert row.state is ExecutionState.UNKNOWN and row.pod_kind is PodKind.UNKNOWN


def test_decode_row_copies_fields_and_marks_rows_kubernetes_managed() -> None:
    row = decode_row(_record(generation=7, activation_attempt=3, active=True))
    assert row is not None
    assert (row.pod_name, row.namespace, row.sandbox_id) == ("space-sbx-a-g1", "sandboxes", "a")
    assert (row.generation, row.activation_attempt, row.active) == (7, 3, True)
    assert row.kubernetes_managed is True


@pytest.mark.parametrize("column", COLUMNS)
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


def _batch(*rows: Any) -> str:
    return json.dumps({"rows": list(rows)}, separators=(",", ":"))


def _groups(*groups: Any) -> str:
    return json.dumps({"groups": list(groups)}, separators=(",", ":"))


WATCHED = ("sandboxes",)
"""The namespaces a listener watches (a ``pods`` change is one change in each)."""


def _pods(*groups: Any) -> str:
    return json.dumps({"pods": list(groups)}, separators=(",", ":"))


def _only(parsed: ParsedPayload) -> ExecutionChange:
    assert parsed.malformed == 0, parsed.problem
    (change,) = parsed.changes
    return change


def test_parse_payload_update_retired() -> None:
    change = _only(parse_payload(_payload(), received_at_s=12.5, namespaces=WATCHED))
    assert change.key == "sandboxes/space-sbx-a-g1"
    assert change.active is False and change.state is ExecutionState.SUSPENDED
    assert change.retired and not change.deleted
    assert change.received_at_s == 12.5


def test_parse_payload_reactivation_is_not_retired() -> None:
    change = _only(
        parse_payload(
            _payload(active=True, execution_state="active"), received_at_s=0, namespaces=WATCHED
        )
    )
    assert change.active is True and not change.retired


def test_parse_payload_delete_carries_no_state() -> None:
    change = _only(parse_payload(_payload(op="delete"), received_at_s=0, namespaces=WATCHED))
    assert change.deleted and change.active is None and change.state is None
    assert not change.retired


def test_parse_payload_unknown_state_string_is_unknown_member() -> None:
    change = _only(
        parse_payload(_payload(execution_state="weird"), received_at_s=0, namespaces=WATCHED)
    )
    assert change.state is ExecutionState.UNKNOWN
    assert not change.retired


@pytest.mark.parametrize("op", ["insert", "update", "delete"])
@pytest.mark.parametrize("active", [True, False, None])
@pytest.mark.parametrize("state", [*(s.value for s in ExecutionState), "weird", None])
def test_both_payload_shapes_say_the_same_change(
    op: str, active: bool | None, state: str | None
) -> None:
    # 0002's object and a row of 0003's batch carry the same facts: during a rolling upgrade a
    # change must mean the same whichever trigger sent it.
    single = parse_payload(
        _payload(op=op, active=active, execution_state=state), received_at_s=3.0, namespaces=WATCHED
    )
    batch = parse_payload(
        _batch([op, "sandboxes", "space-sbx-a-g1", active, state]),
        received_at_s=3.0,
        namespaces=WATCHED,
    )
    grouped = parse_payload(
        _groups([op, "sandboxes", active, state, ["space-sbx-a-g1"]]),
        received_at_s=3.0,
        namespaces=WATCHED,
    )
    assert _only(single) == _only(batch) == _only(grouped)


def test_groups_are_parsed_whole_each_name_with_its_groups_facts() -> None:
    names = [f"space-sbx-{i}-g1" for i in range(100)]
    parsed = parse_payload(
        _groups(
            ["update", "sandboxes", False, "replaced", names],
            ["insert", "other", True, "active", ["space-sbx-x-g1"]],
            ["delete", "sandboxes", None, None, ["d", "e"]],
        ),
        received_at_s=7.0,
        namespaces=WATCHED,
    )
    assert parsed.malformed == 0 and parsed.problem == ""
    assert [c.key for c in parsed.changes] == [
        *(f"sandboxes/{n}" for n in names),
        "other/space-sbx-x-g1",
        "sandboxes/d",
        "sandboxes/e",
    ]
    assert [c.retired for c in parsed.changes] == [True] * 100 + [False] * 3
    assert parsed.changes[100].active is True
    assert [c.deleted for c in parsed.changes[-3:]] == [False, True, True]
    assert {c.received_at_s for c in parsed.changes} == {7.0}


@pytest.mark.parametrize(
    ("bad_group", "bad"),
    [
        (["update", "sandboxes", False, ["space-sbx-bad-g1"]], 1),  # too short: not a group
        (["update", "sandboxes", False, "replaced", ["a", "b"], "extra"], 1),
        (["update", "sandboxes", False, "replaced", "space-sbx-bad-g1"], 1),  # names not a list
        (["truncate", "sandboxes", False, "replaced", ["a", "b"]], 2),  # bad facts: every name
        (["update", None, False, "replaced", ["a", "b"]], 2),  # no sandboxes row
        (["update", "", False, "replaced", ["a", "b", "c"]], 3),
        (["update", "sandboxes", "false", "replaced", ["a"]], 1),
        (["update", "sandboxes", False, 3, ["a"]], 1),
        (["update", "sandboxes", False, "replaced", []], 0),  # nothing in it, nothing bad
        (["update", "sandboxes", False, "replaced", ["", 5, None]], 3),  # each bad name
        ("garbage", 1),
        (None, 1),
    ],
)
def test_a_malformed_group_or_name_is_counted_and_never_hides_the_others(
    bad_group: Any, bad: int
) -> None:
    good = [
        ["update", "sandboxes", False, "replaced", [f"space-sbx-{i}-g1", "ok"]] for i in range(3)
    ]
    # A bad name inside an otherwise good group hides neither its neighbours nor other groups.
    mixed = ["update", "sandboxes", False, "replaced", ["m1", 7, "m2"]]
    parsed = parse_payload(
        _groups(good[0], bad_group, good[1], mixed, good[2]), received_at_s=0, namespaces=WATCHED
    )
    assert [c.pod_name for c in parsed.changes] == [
        "space-sbx-0-g1",
        "ok",
        "space-sbx-1-g1",
        "ok",
        "m1",
        "m2",
        "space-sbx-2-g1",
        "ok",
    ]
    assert all(c.retired for c in parsed.changes)
    assert parsed.malformed == bad + 1 and "invalid changes" in parsed.problem


def test_groups_of_only_malformed_names_count_each() -> None:
    parsed = parse_payload(
        _groups(["update", "sandboxes", False, "replaced", ["", 5]], "x"),
        received_at_s=0,
        namespaces=WATCHED,
    )
    assert parsed.changes == [] and parsed.malformed == 3
    assert parse_payload(_groups(), received_at_s=0, namespaces=WATCHED).malformed == 1


def test_a_batch_is_parsed_whole_in_order() -> None:
    rows = [["update", "sandboxes", f"space-sbx-{i}-g1", False, "replaced"] for i in range(100)] + [
        ["insert", "other", "space-sbx-x-g1", True, "active"],
        ["delete", "sandboxes", "d", None, None],
    ]
    parsed = parse_payload(_batch(*rows), received_at_s=7.0, namespaces=WATCHED)
    assert parsed.malformed == 0 and parsed.problem == ""
    assert [c.key for c in parsed.changes] == [f"{r[1]}/{r[2]}" for r in rows]
    assert [c.retired for c in parsed.changes] == [True] * 100 + [False, False]
    assert parsed.changes[-1].deleted and parsed.changes[-2].active is True
    assert {c.received_at_s for c in parsed.changes} == {7.0}


@pytest.mark.parametrize(
    "bad_row",
    [
        ["update", "sandboxes", "space-sbx-bad-g1", False],  # too short
        ["update", "sandboxes", "space-sbx-bad-g1", False, "replaced", "extra"],
        ["truncate", "sandboxes", "space-sbx-bad-g1", False, "replaced"],
        ["update", None, "space-sbx-bad-g1", False, "replaced"],  # no sandboxes row
        ["update", "", "space-sbx-bad-g1", False, "replaced"],
        ["update", "sandboxes", "", False, "replaced"],
        ["update", "sandboxes", 5, False, "replaced"],
        ["update", "sandboxes", "space-sbx-bad-g1", "false", "replaced"],
        ["update", "sandboxes", "space-sbx-bad-g1", 0, "replaced"],
        ["update", "sandboxes", "space-sbx-bad-g1", False, 3],
        {"op": "update", "namespace": "sandboxes", "pod_name": "space-sbx-bad-g1"},
        "garbage",
        None,
    ],
)
def test_a_malformed_row_is_counted_and_never_hides_the_others(bad_row: Any) -> None:
    good = [["update", "sandboxes", f"space-sbx-{i}-g1", False, "replaced"] for i in range(3)]
    parsed = parse_payload(
        _batch(good[0], bad_row, good[1], bad_row, good[2]), received_at_s=0, namespaces=WATCHED
    )
    assert [c.pod_name for c in parsed.changes] == [r[2] for r in good]
    assert all(c.retired for c in parsed.changes)
    assert parsed.malformed == 2 and "invalid changes" in parsed.problem


def test_a_batch_of_only_malformed_rows_counts_each() -> None:
    parsed = parse_payload(
        _batch(["x"], ["update", "", "p", True, "active"], 7), received_at_s=0, namespaces=WATCHED
    )
    assert parsed.changes == [] and parsed.malformed == 3


def test_an_empty_batch_is_malformed() -> None:
    parsed = parse_payload(_batch(), received_at_s=0, namespaces=WATCHED)
    assert parsed.changes == [] and parsed.malformed == 1


def test_an_oversized_payload_is_skipped_whole() -> None:
    # PostgreSQL refuses payloads of 8000 bytes or more, so this did not come from the trigger;
    # valid rows in it are not trusted either.
    row = ["update", "sandboxes", "space-sbx-0123456789ab-g1", False, "replaced"]
    row_bytes = len(json.dumps(row, separators=(",", ":"))) + 1  # with its comma
    rows = [row] * (MAX_PAYLOAD_BYTES // row_bytes + 1)
    payload = _batch(*rows)
    assert len(payload.encode()) >= MAX_PAYLOAD_BYTES
    parsed = parse_payload(payload, received_at_s=0, namespaces=WATCHED)
    assert parsed.changes == [] and parsed.malformed == 1 and parsed.problem == "oversized"
    # The bound is in bytes: fewer characters than the limit, but more bytes, is oversized too.
    wide = json.dumps(
        {"rows": [["update", "sandboxes", "\u00e9" * 3980, False, "replaced"]]}, ensure_ascii=False
    )
    assert len(wide) < MAX_PAYLOAD_BYTES <= len(wide.encode())
    assert parse_payload(wide, received_at_s=0, namespaces=WATCHED).problem == "oversized"
    # Just below the bound, the same rows are parsed.
    most = (MAX_PAYLOAD_BYTES - len('{"rows":[]}')) // row_bytes
    fits = _batch(*rows[:most])
    assert len(fits.encode()) < MAX_PAYLOAD_BYTES
    assert len(parse_payload(fits, received_at_s=0, namespaces=WATCHED).changes) == most


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "not json",
        "null",
        "[1, 2]",
        "{}",
        '{"op": "insert"}',
        '{"rows": 5}',
        '{"rows": {"a": 1}}',
        '{"groups": 5}',
        '{"groups": {"a": 1}}',
        '{"groups": []}',
        '{"pods": 5}',
        '{"pods": []}',
        '{"pods": [["update", false, "replaced", []]]}',
        _payload(op="truncate"),
        _payload(namespace=""),
        _payload(pod_name=""),
        _payload(pod_name=5),
        _payload(active="false"),
        _payload(execution_state=3),
    ],
)
def test_parse_payload_rejects_garbage(garbage: str) -> None:
    parsed = parse_payload(garbage, received_at_s=0, namespaces=WATCHED)
    assert parsed.changes == [] and parsed.malformed == 1 and parsed.problem


def test_trigger_sql_carries_the_configured_channel_as_trigger_argument() -> None:
    sql = render_trigger_sql("my_channel_2")
    # A pg_notify call for a one-row statement of each trigger event (insert, update, delete),
    # and two in the packing loop every other statement goes through.
    assert sql.count("pg_notify('my_channel_2', ") == 5
    assert f"pg_notify('{DEFAULT_CHANNEL}'" not in sql
    assert render_trigger_sql(DEFAULT_CHANNEL).count(f"pg_notify('{DEFAULT_CHANNEL}', ") == 5


@pytest.mark.parametrize("bad", ["", "1abc", "a-b", "a'b", 'a"b', "x" * 64, "a b"])
def test_trigger_sql_refuses_a_channel_that_is_not_an_identifier(bad: str) -> None:
    with pytest.raises(ValueError):
        render_trigger_sql(bad)


def test_steps_include_the_schema_only_when_asked() -> None:
    # 0003 supersedes 0002 (it drops 0002's triggers): a run never applies 0002.
    assert [s.name for s in steps(channel="c", with_schema=False)] == [
        "0003_notify_statement_trigger"
    ]
    assert [s.name for s in steps(channel="c", with_schema=True)] == [
        "0001_dev_schema",
        "0003_notify_statement_trigger",
    ]
    # The checksum depends on the channel, so a channel change re-applies the trigger.
    a, b = steps(channel="a", with_schema=False)[0], steps(channel="b", with_schema=False)[0]
    assert a.sha256 != b.sha256


def test_the_default_reconnect_policy_is_equal_jitter_from_0_1_s_to_the_cap() -> None:
    policy = default_backoff()
    assert (policy.initial_s, policy.max_s, policy.jitter) == (0.1, BACKOFF_MAX_S, 0.5)
    # Each call makes a policy of its own (its own random source), never a shared one.
    assert default_backoff().rng is not policy.rng
