"""The change trigger's NOTIFY payload, decoded into :class:`service.domain.ExecutionChange` values.

Trigger 0003 sends one shape: ``{"pods": [[op, active, execution_state, [pod_name, ...]], ...]}``
(the data contract of docs/architecture.md, "The change notifications"). Each name of a group is
one change with the group's facts, in each watched namespace (a name carries no namespace: the
pod's is checked against the row's when the row is read).

:func:`parse_payload` never raises. A payload that is not this shape, or 8000 bytes or longer,
is skipped whole and counts as one bad part; inside a payload each bad part (a name that is not a
non-empty string, each name of a group whose facts are bad, an element that is not a group) is
skipped and counted once, and the others are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from service.domain import ExecutionChange, ExecutionState, parse_execution_state

MAX_PAYLOAD_BYTES = 8000
"""PostgreSQL refuses a NOTIFY payload of this many bytes or more, so a longer payload did not
come from the trigger: it is skipped whole (``oversized``)."""

_Op = Literal["insert", "update", "delete"]
_Head = tuple[_Op, bool | None, str | None]
"""A group's facts: op, active, execution_state."""


class _Pods(msgspec.Struct, forbid_unknown_fields=False):
    """The whole payload, every group valid (the common case: one decode)."""

    pods: list[tuple[_Op, bool | None, str | None, list[str]]]


class _LoosePods(msgspec.Struct, forbid_unknown_fields=False):
    """The payload decoded group by group, so that a bad part hides none of the others."""

    pods: list[msgspec.Raw]


_pods_decoder = msgspec.json.Decoder(_Pods)
_loose_pods_decoder = msgspec.json.Decoder(_LoosePods)
_loose_group_decoder = msgspec.json.Decoder(
    tuple[msgspec.Raw, msgspec.Raw, msgspec.Raw, list[msgspec.Raw]]
)
_head_decoder = msgspec.json.Decoder(_Head)
_name_decoder = msgspec.json.Decoder(str)


@dataclass(frozen=True, slots=True)
class ParsedPayload:
    """What one payload says: its valid changes, in payload order, and how many parts were
    skipped (``malformed``: the whole payload counts as one, else each bad part once)."""

    changes: list[ExecutionChange]
    malformed: int = 0
    problem: str = ""
    """Why something was skipped (for the log), empty when nothing was."""


def parse_payload(
    payload: str, *, received_at_s: float, namespaces: Sequence[str]
) -> ParsedPayload:
    """The changes ``payload`` describes: each valid name once in each of ``namespaces`` (the
    watched ones), group by group, in payload order. Never raises (see the module docstring)."""
    if len(payload) >= MAX_PAYLOAD_BYTES or len(payload.encode()) >= MAX_PAYLOAD_BYTES:
        return ParsedPayload([], 1, "oversized")
    batch = _Batch(received_at_s, namespaces)
    try:
        groups = _pods_decoder.decode(payload).pods
    except msgspec.DecodeError:
        return _parse_loosely(payload, batch)
    for op, active, state, names in groups:
        batch.add((op, active, state), names)
    return batch.outcome()


def _parse_loosely(payload: str, batch: _Batch) -> ParsedPayload:
    """A payload that did not decode whole: its groups, facts and names one by one."""
    try:
        raw_groups = _loose_pods_decoder.decode(payload).pods
    except msgspec.DecodeError:
        return ParsedPayload([], 1, "not a change payload")
    for raw in raw_groups:
        try:
            *raw_head, raw_names = _loose_group_decoder.decode(raw)
        except msgspec.DecodeError:
            batch.parts += 1  # not a group: one bad part
            continue
        try:
            head = _head_decoder.decode(b"[" + b",".join(raw_head) + b"]")
        except msgspec.DecodeError:
            batch.parts += len(raw_names)  # every name of the group is bad with it
            continue
        names: list[str] = []
        for raw_name in raw_names:
            try:
                names.append(_name_decoder.decode(raw_name))
            except msgspec.DecodeError:
                batch.parts += 1
        batch.add(head, names)
    return batch.outcome()


class _Batch:
    """The changes of one payload as its groups are added, and the count of its parts."""

    def __init__(self, received_at_s: float, namespaces: Sequence[str]) -> None:
        self.received_at_s = received_at_s
        self.namespaces = namespaces
        self.changes: list[ExecutionChange] = []
        self.parts = 0
        """Every part seen: each name of a group, each element that is not a group."""
        self.valid = 0

    def add(self, head: _Head, names: Sequence[str]) -> None:
        """A change for each non-empty name in each namespace (a delete: no active, no state)."""
        op, active, state = head
        deleted = op == "delete"
        parsed: ExecutionState | None = None
        if deleted:
            active = None
        elif state is not None:
            parsed = parse_execution_state(state)
        self.parts += len(names)
        valid = [name for name in names if name]
        self.valid += len(valid)
        at = self.received_at_s
        for namespace in self.namespaces:
            self.changes.extend(
                ExecutionChange(namespace, name, active, parsed, deleted, at) for name in valid
            )

    def outcome(self) -> ParsedPayload:
        """The changes, and the bad parts: every invalid one (an empty payload counts as one)."""
        if not self.changes:
            return ParsedPayload([], max(1, self.parts), "no valid change in the batch")
        bad = self.parts - self.valid
        return ParsedPayload(
            self.changes, bad, f"{bad} invalid changes in the batch" if bad else ""
        )
