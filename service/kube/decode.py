"""Raw Kubernetes pod JSON → :class:`PodSnapshot`, typed only at this edge: msgspec decodes just
the fields classification needs. Garbage gives :class:`PodDecodeError` or unknown members, never
a crash of the caller, never a reapable snapshot.
"""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Any

import msgspec

from service.domain import (
    KEEP_ANNOTATION,
    ConditionStatus,
    LabelKeys,
    PodPhase,
    PodSnapshot,
    keep_value_keeps,
    parse_pod_kind,
)
from service.kit.errors import Undecodable

READY_TO_START = "PodReadyToStartContainers"


class PodDecodeError(Undecodable):
    """A pod object (or a list of them) that cannot be turned into a snapshot. Its reader skips
    it, counts it (``decode_errors_total{source}``) and logs it; it is never acted on."""


_ABSENT = msgspec.Raw(b"")


class WireMeta(msgspec.Struct):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resourceVersion: str = ""
    creationTimestamp: str | None = None
    deletionTimestamp: str | None = None
    labels: dict[str, str] | None = None
    # Raw: only one key matters, so the map is decoded only when that key may be in it.
    annotations: msgspec.Raw = _ABSENT


class WireCondition(msgspec.Struct):
    type: str = ""
    status: str = ""


class WireContainerState(msgspec.Struct):
    # Raw: present-or-not is all that matters, so the inner objects are never built.
    running: msgspec.Raw = _ABSENT
    waiting: msgspec.Raw = _ABSENT
    terminated: msgspec.Raw = _ABSENT


class WireContainerStatus(msgspec.Struct):
    state: WireContainerState | None = None


class WirePodStatus(msgspec.Struct):
    phase: str | None = None
    podIP: str | None = None
    conditions: list[WireCondition] | None = None
    containerStatuses: list[WireContainerStatus] | None = None


class WirePod(msgspec.Struct):
    metadata: WireMeta | None = None
    status: WirePodStatus | None = None


class WireListMeta(msgspec.Struct):
    resourceVersion: str = ""
    continue_: str | None = msgspec.field(default=None, name="continue")


class WirePodList(msgspec.Struct):
    """A ``PodList`` page whose items are kept raw so one bad item cannot spoil the page."""

    metadata: WireListMeta = msgspec.field(default_factory=WireListMeta)
    items: list[msgspec.Raw] | None = None


_PHASES: dict[str | None, PodPhase] = {p.value: p for p in PodPhase}
_CONDITIONS = {c.value: c for c in ConditionStatus if c is not ConditionStatus.ABSENT}
_pod_decoder = msgspec.json.Decoder(WirePod)
_annotations_decoder = msgspec.json.Decoder(dict[str, str])
_KEEP_KEY = KEEP_ANNOTATION.encode()
_list_decoder = msgspec.json.Decoder(WirePodList)


def _parse_generation(raw: str | None) -> int | None:
    # Only plain non-negative decimal integers; "+1", " 1", "1_0" and "٣" are garbage.
    if raw is None or not raw.isascii() or not raw.isdigit() or len(raw) > 9:
        return None
    return int(raw)


def _parse_time(raw: str | None) -> float | None:
    if not raw:
        return None
    try:
        return datetime.fromisoformat(raw).timestamp()
    except ValueError:
        return None


def _ready_to_start(conditions: list[WireCondition] | None) -> ConditionStatus:
    for condition in conditions or ():
        if condition.type == READY_TO_START:
            return _CONDITIONS.get(condition.status, ConditionStatus.UNKNOWN)
    return ConditionStatus.ABSENT


def _present(raw: msgspec.Raw) -> bool:
    return len(raw) > 0 and bytes(raw) != b"null"


def _keep(annotations: msgspec.Raw) -> bool:
    """Whether the keep annotation keeps the pod. The map (a ``last-applied-configuration`` alone
    is kilobytes) is decoded only when the key's bytes occur in it: the API server re-encodes
    every object it serves and writes such a key as is (it escapes only quotes, backslashes,
    control characters and ``<>&``). A map holding the key that does not decode keeps the pod
    (fail closed: it cannot be shown that nobody asked to keep it)."""
    raw = bytes(annotations)  # absent (b"") and null do not hold it
    if _KEEP_KEY not in raw:
        return False
    try:
        values = _annotations_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return True
    return keep_value_keeps(values.get(KEEP_ANNOTATION))


def _containers(statuses: list[WireContainerStatus] | None) -> tuple[int, bool]:
    if not statuses:
        return 0, False
    for status in statuses:
        state = status.state
        if (
            state is None
            or not _present(state.terminated)
            or _present(state.running)
            or _present(state.waiting)
        ):
            return len(statuses), False
    return len(statuses), True


class PodDecoder:
    """Decodes pod JSON into snapshots with the configured label keys."""

    __slots__ = ("_keys",)

    def __init__(self, keys: LabelKeys | None = None) -> None:
        self._keys = keys or LabelKeys()

    def decode(self, raw: bytes | str | msgspec.Raw) -> PodSnapshot:
        try:
            wire = _pod_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise PodDecodeError(f"undecodable pod object: {exc}") from exc
        meta = wire.metadata
        if meta is None or not meta.name or not meta.namespace or not meta.uid:
            raise PodDecodeError("pod object lacks metadata.name, namespace or uid")
        if not meta.resourceVersion:
            raise PodDecodeError(f"pod {meta.namespace}/{meta.name} lacks a resourceVersion")
        labels = meta.labels or {}
        keys = self._keys
        status = wire.status or WirePodStatus()
        count, every = _containers(status.containerStatuses)
        return PodSnapshot(
            # One string per namespace: 528.6 B a cached pod, not 586.6 (benchmarks/NOTES.md).
            namespace=sys.intern(meta.namespace),
            name=meta.name,
            uid=meta.uid,
            resource_version=meta.resourceVersion,
            phase=_PHASES.get(status.phase, PodPhase.UNKNOWN),
            terminating=meta.deletionTimestamp is not None,
            pod_ip=status.podIP or None,
            ready_to_start=_ready_to_start(status.conditions),
            container_count=count,
            all_containers_terminated=every,
            sandbox_id=labels.get(keys.sandbox_id) or None,
            generation=_parse_generation(labels.get(keys.generation)),
            kind=parse_pod_kind(labels.get(keys.pod_kind)),
            created_at_s=_parse_time(meta.creationTimestamp),
            keep=_keep(meta.annotations),
        )

    def decode_list(self, raw: bytes | str) -> tuple[WirePodList, list[PodSnapshot], int]:
        """Decode a ``PodList`` page: (page metadata, good snapshots, count of bad items)."""
        try:
            page = _list_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise PodDecodeError(f"undecodable pod list: {exc}") from exc
        pods: list[PodSnapshot] = []
        bad = 0
        for item in page.items or ():
            try:
                pods.append(self.decode(item))
            except PodDecodeError:
                bad += 1
        return page, pods, bad


def decode_json(raw: bytes | str) -> Any:
    """Untyped JSON decode (for Status bodies and other small documents)."""
    return msgspec.json.decode(raw)
