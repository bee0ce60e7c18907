"""Pure parts of the PostgreSQL adapter: row decoding, payload parsing, SQL rendering, the
listener's reconnect policy."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.domain import (
    RETIRED_STATES,
    ExecutionChange,
    ExecutionState,
    PodKind,
    parse_execution_state,
)
from service.pg.listener import BACKOFF_MAX_S, default_backoff
from service.pg.migrate import DEFAULT_CHANNEL, render_trigger_sql, steps
from service.pg.payload import MAX_PAYLOAD_BYTES, ParsedPayload, parse_payload
from service.pg.store import COLUMNS, LOOKUP_SQL, decode_row


def _json(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"))


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


WATCHED = ("sandboxes",)
"""The namespaces a listener watches (each name of a payload is one change in each)."""


def _pods(*groups: Any) -> str:
    return _json({"pods": list(groups)})


def _one(
    op: Any = "update", active: Any = False, state: Any = "suspended", name: Any = "space-sbx-a-g1"
) -> str:
    """A payload of one change, as the trigger sends a one-row statement's."""
    return _pods([op, active, state, [name]])


def _only(parsed: ParsedPayload) -> ExecutionChange:
    assert parsed.malformed == 0, parsed.problem
    (change,) = parsed.changes
    return change


def test_parse_payload_update_retired() -> None:
    change = _only(parse_payload(_one(), received_at_s=12.5, namespaces=WATCHED))
    assert change.key == "sandboxes/space-sbx-a-g1"
    assert change.active is False and change.state is ExecutionState.SUSPENDED
    assert change.retired and not change.deleted
    assert change.received_at_s == 12.5


def test_parse_payload_reactivation_is_not_retired() -> None:
    change = _only(
        parse_payload(_one(active=True, state="active"), received_at_s=0, namespaces=WATCHED)
    )
    assert change.active is True and not change.retired


def test_parse_payload_delete_carries_no_state() -> None:
    change = _only(parse_payload(_one(op="delete"), received_at_s=0, namespaces=WATCHED))
    assert change.deleted and change.active is None and change.state is None
    assert not change.retired


def test_parse_payload_unknown_state_string_is_unknown_member() -> None:
    change = _only(parse_payload(_one(state="weird"), received_at_s=0, namespaces=WATCHED))
    assert change.state is ExecutionState.UNKNOWN
    assert not change.retired


@pytest.mark.parametrize("op", ["insert", "update", "delete"])
@pytest.mark.parametrize("active", [True, False, None])
@pytest.mark.parametrize("state", [*(s.value for s in ExecutionState), "weird", None])
def test_a_name_alone_and_among_others_says_the_same_change(
    op: str, active: bool | None, state: str | None
) -> None:
    # A one-row statement's payload and a mass retirement's group must mean the same for a name.
    alone = _only(parse_payload(_one(op, active, state), received_at_s=3.0, namespaces=WATCHED))
    grouped = parse_payload(
        _pods([op, active, state, ["x", "space-sbx-a-g1", "y"]]),
        received_at_s=3.0,
        namespaces=WATCHED,
    )
    assert grouped.malformed == 0
    assert grouped.changes[1] == alone
    assert alone.retired == (
        op != "delete" and active is False and parse_execution_state(state) in RETIRED_STATES
    )


def test_groups_are_parsed_whole_each_name_with_its_groups_facts() -> None:
    names = [f"space-sbx-{i}-g1" for i in range(100)]
    parsed = parse_payload(
        _pods(
            ["update", False, "replaced", names],
            ["insert", True, "active", ["space-sbx-x-g1"]],
            ["delete", None, None, ["d", "e"]],
        ),
        received_at_s=7.0,
        namespaces=WATCHED,
    )
    assert parsed.malformed == 0 and parsed.problem == ""
    assert [c.key for c in parsed.changes] == [
        *(f"sandboxes/{n}" for n in names),
        "sandboxes/space-sbx-x-g1",
        "sandboxes/d",
        "sandboxes/e",
    ]
    assert [c.retired for c in parsed.changes] == [True] * 100 + [False] * 3
    assert parsed.changes[100].active is True
    assert [c.deleted for c in parsed.changes[-3:]] == [False, True, True]
    assert {c.received_at_s for c in parsed.changes} == {7.0}


def test_each_name_is_one_change_in_every_watched_namespace_group_by_group() -> None:
    parsed = parse_payload(
        _pods(["update", False, "replaced", ["a", "b"]], ["delete", None, None, ["c"]]),
        received_at_s=0,
        namespaces=("sandboxes", "tenant-b"),
    )
    assert parsed.malformed == 0
    assert [c.key for c in parsed.changes] == [
        "sandboxes/a",
        "sandboxes/b",
        "tenant-b/a",
        "tenant-b/b",
        "sandboxes/c",
        "tenant-b/c",
    ]
    # A bad name is counted once, not once per namespace.
    bad = parse_payload(
        _pods(["update", False, "replaced", ["a", "", 5]]),
        received_at_s=0,
        namespaces=("sandboxes", "tenant-b"),
    )
    assert [c.key for c in bad.changes] == ["sandboxes/a", "tenant-b/a"]
    assert bad.malformed == 2


@pytest.mark.parametrize(
    ("bad_group", "bad"),
    [
        (["update", False, ["space-sbx-bad-g1"]], 1),  # too short: not a group
        (["update", False, "replaced", ["a", "b"], "extra"], 1),
        (["update", False, "replaced", "space-sbx-bad-g1"], 1),  # names not a list
        (["update", "sandboxes", False, "replaced", ["a", "b"]], 1),  # 0003's earlier `groups`
        (["truncate", False, "replaced", ["a", "b"]], 2),  # bad facts: every name
        (["update", "false", "replaced", ["a"]], 1),
        (["update", 0, "replaced", ["a", "b", "c"]], 3),
        (["update", False, 3, ["a"]], 1),
        (["update", False, "replaced", []], 0),  # nothing in it, nothing bad
        (["update", False, "replaced", ["", 5, None]], 3),  # each bad name
        ("garbage", 1),
        (None, 1),
    ],
)
def test_a_malformed_group_or_name_is_counted_and_never_hides_the_others(
    bad_group: Any, bad: int
) -> None:
    good = [["update", False, "replaced", [f"space-sbx-{i}-g1", "ok"]] for i in range(3)]
    # A bad name inside an otherwise good group hides neither its neighbours nor other groups.
    mixed = ["update", False, "replaced", ["m1", 7, "m2"]]
    parsed = parse_payload(
        _pods(good[0], bad_group, good[1], mixed, good[2]), received_at_s=0, namespaces=WATCHED
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
        _pods(["update", False, "replaced", ["", 5]], "x"), received_at_s=0, namespaces=WATCHED
    )
    assert parsed.changes == [] and parsed.malformed == 3
    assert parse_payload(_pods(), received_at_s=0, namespaces=WATCHED).malformed == 1


def test_an_oversized_payload_is_skipped_whole() -> None:
    # PostgreSQL refuses payloads of 8000 bytes or more, so this did not come from the trigger;
    # valid names in it are not trusted either.
    name = "space-sbx-0123456789ab-g1"
    name_bytes = len(json.dumps(name)) + 1  # with its comma
    names = [name] * (MAX_PAYLOAD_BYTES // name_bytes + 1)
    payload = _pods(["update", False, "replaced", names])
    assert len(payload.encode()) >= MAX_PAYLOAD_BYTES
    parsed = parse_payload(payload, received_at_s=0, namespaces=WATCHED)
    assert parsed.changes == [] and parsed.malformed == 1 and parsed.problem == "oversized"
    # The bound is in bytes: fewer characters than the limit, but more bytes, is oversized too.
    wide = json.dumps(
        {"pods": [["update", False, "replaced", ["\u00e9" * 3990]]]}, ensure_ascii=False
    )
    assert len(wide) < MAX_PAYLOAD_BYTES <= len(wide.encode())
    assert parse_payload(wide, received_at_s=0, namespaces=WATCHED).problem == "oversized"
    # Just below the bound, the same names are parsed.
    head = len(_pods(["update", False, "replaced", []]))
    most = (MAX_PAYLOAD_BYTES - head) // name_bytes
    fits = _pods(["update", False, "replaced", names[:most]])
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
        '{"pods": 5}',
        '{"pods": {"a": 1}}',
        '{"pods": []}',
        '{"pods": [["update", false, "replaced", []]]}',
        _one(op="truncate"),
        _one(name=""),
        _one(name=5),
        _one(active="false"),
        _one(state=3),
        # The shapes no shipped trigger sends (0002's object, 0003's earlier `rows` and
        # `groups`): skipped whole, each valid as it was.
        json.dumps(
            {
                "op": "update",
                "namespace": "sandboxes",
                "pod_name": "space-sbx-a-g1",
                "active": False,
                "execution_state": "suspended",
            }
        ),
        _json({"rows": [["update", "sandboxes", "space-sbx-a-g1", False, "replaced"]]}),
        _json({"groups": [["update", "sandboxes", False, "replaced", ["space-sbx-a-g1"]]]}),
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
