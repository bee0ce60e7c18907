"""The emulator's object store: stored objects, the global resourceVersion and consistent lists.

Objects are stored as plain dicts (without ``kind``/``apiVersion``, like list items on the wire)
together with their encoded bytes, so a list page is a byte join and a watch event is a splice.
A list is consistent at the resourceVersion of its first page (paginated lists keep a snapshot).
"""

from __future__ import annotations

import base64
import bisect
import calendar
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import msgspec

from devtools.emulator import statuses as st
from devtools.emulator.selectors import Matcher, SelectorError, compile_selector
from devtools.emulator.statuses import Resource
from devtools.emulator.watcher import Watcher

_encode = msgspec.json.encode
_decode = msgspec.json.decode


def clone(obj: Any) -> Any:
    """A deep copy of JSON data (several times faster than ``copy.deepcopy``)."""
    return _decode(_encode(obj))


_META_ORDER = (
    "name",
    "generateName",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
    "managedFields",
)
_MAX_SNAPSHOTS = 16


def format_time(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def parse_time(raw: str) -> float:
    return float(calendar.timegm(time.strptime(raw, "%Y-%m-%dT%H:%M:%SZ")))


def ordered(obj: dict[str, Any]) -> dict[str, Any]:
    """Key order of the real server: metadata, spec, status, then anything else."""
    meta = obj.get("metadata") or {}
    ordered_meta = {k: meta[k] for k in _META_ORDER if k in meta}
    ordered_meta.update((k, v) for k, v in meta.items() if k not in ordered_meta)
    out: dict[str, Any] = {"metadata": ordered_meta}
    for key in ("spec", "status"):
        if key in obj:
            out[key] = obj[key]
    out.update((k, v) for k, v in obj.items() if k not in out and k not in ("kind", "apiVersion"))
    return out


@dataclass(slots=True)
class Entry:
    """One stored object: the dict (no kind/apiVersion) and its encoded bytes."""

    obj: dict[str, Any]
    body: bytes
    namespace: str
    name: str

    @property
    def labels(self) -> dict[str, str] | None:
        labels: dict[str, str] | None = self.obj["metadata"].get("labels")
        return labels


class Table:
    """All objects of one resource, its sorted key cache and its event history."""

    def __init__(self, res: Resource, history_size: int) -> None:
        self.res = res
        self.entries: dict[str, Entry] = {}
        self._sorted: list[str] | None = None
        self.history: deque[tuple[int, bytes, Entry]] = deque(maxlen=history_size)
        self.compacted_rv = 0
        self.watchers: set[Watcher] = set()
        self.prefix = b'{"kind":"%s","apiVersion":"%s",' % (
            res.kind.encode(),
            res.api_version.encode(),
        )

    def sorted_keys(self) -> list[str]:
        if self._sorted is None:
            self._sorted = sorted(self.entries)
        return self._sorted

    def invalidate(self) -> None:
        self._sorted = None

    def full(self, body: bytes) -> bytes:
        return self.prefix + body[1:]


@dataclass(slots=True)
class _Snapshot:
    keys: list[str]
    bodies: list[bytes]


class Store:
    """Objects, versions and lists; :meth:`_emit` is the hook every change goes through."""

    _rv: int
    _tables: dict[str, Table]
    _snapshots: OrderedDict[tuple[str, str, str, int], _Snapshot]

    @property
    def resource_version(self) -> int:
        """The newest resourceVersion handed out."""
        return self._rv

    def table(self, res: Resource) -> Table:
        return self._tables[res.plural]

    def resource(self, group: str, plural: str) -> Resource | None:
        table = self._tables.get(plural)
        if table is None or table.res.group != group:
            return None
        return table.res

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def _store(self, table: Table, obj: dict[str, Any], *, new: bool) -> Entry:
        meta = obj["metadata"]
        rv = self._next_rv()
        meta["resourceVersion"] = str(rv)
        obj = ordered(obj)
        meta = obj["metadata"]
        namespace = meta.get("namespace", "")
        entry = Entry(obj=obj, body=_encode(obj), namespace=namespace, name=meta["name"])
        key = f"{namespace}/{entry.name}" if table.res.namespaced else entry.name
        table.entries[key] = entry
        if new:
            table.invalidate()
        self._emit(table, b"ADDED" if new else b"MODIFIED", entry)
        return entry

    def _remove(self, table: Table, key: str, entry: Entry) -> Entry:
        obj = entry.obj
        obj["metadata"]["resourceVersion"] = str(self._next_rv())
        final = Entry(obj=obj, body=_encode(obj), namespace=entry.namespace, name=entry.name)
        del table.entries[key]
        table.invalidate()
        self._emit(table, b"DELETED", final)
        return final

    # ------------------------------------------------------------------ lookups

    @staticmethod
    def _key(res: Resource, namespace: str, name: str) -> str:
        return f"{namespace}/{name}" if res.namespaced else name

    def lookup(self, res: Resource, namespace: str, name: str) -> Entry:
        entry = self.table(res).entries.get(self._key(res, namespace, name))
        if entry is None:
            raise st.not_found(res, name)
        return entry

    def full_bytes(self, res: Resource, entry: Entry) -> bytes:
        return self.table(res).full(entry.body)

    def to_object(self, res: Resource, entry: Entry) -> dict[str, Any]:
        """A deep copy of the object with kind and apiVersion, as a client would see it."""
        obj: dict[str, Any] = {"kind": res.kind, "apiVersion": res.api_version}
        obj.update(clone(entry.obj))
        return obj

    # ------------------------------------------------------------------ list

    def list_body(
        self,
        res: Resource,
        namespace: str | None,
        *,
        selector: str = "",
        limit: int = 0,
        continue_token: str = "",
        resource_version: str = "",
        resource_version_match: str = "",
    ) -> bytes:
        """A ``<Kind>List`` page, consistent at the resourceVersion of its first page.

        Without ``resource_version`` the list is a quorum read and honours ``limit``; with one it
        is served from the watch cache as the real server does (whole, ``limit`` ignored):
        ``"0"`` any version, ``NotOlderThan`` (or no match) the current state if it is not older,
        ``Exact`` the state at that version while the history still holds it, else 410.
        """
        matcher = self._matcher(selector)
        table = self.table(res)
        ns_key = namespace or ""
        at = self._cached_list_version(resource_version, resource_version_match, continue_token)
        if at is not None:
            limit = 0
            continue_token = ""
        if at is not None and at < self._rv:
            bodies = self._bodies_at(table, at, namespace, matcher)
            snapshot = _Snapshot(keys=[""] * len(bodies), bodies=bodies)
            rv, position = at, 0
        elif continue_token:
            rv, start = self._decode_continue(continue_token)
            kept = self._snapshots.get((res.plural, ns_key, selector, rv))
            if kept is None:
                raise st.expired_continue(self._encode_continue(-1, start))
            snapshot = kept
            start_key = f"{namespace}{start}" if namespace else start
            position = bisect.bisect_left(snapshot.keys, start_key)
        else:
            rv = self._rv
            keys = table.sorted_keys()
            if namespace:
                lo = bisect.bisect_left(keys, namespace + "/")
                hi = bisect.bisect_left(keys, namespace + "0")  # "0" sorts right after "/"
                keys = keys[lo:hi]
            entries = table.entries
            if matcher is None:
                chosen = keys
                bodies = [entries[k].body for k in keys]
            else:
                chosen = []
                bodies = []
                for k in keys:
                    e = entries[k]
                    if matcher(e.labels):
                        chosen.append(k)
                        bodies.append(e.body)
            snapshot = _Snapshot(keys=chosen, bodies=bodies)
            position = 0
            if limit and len(chosen) > limit:
                self._snapshots[(res.plural, ns_key, selector, rv)] = snapshot
                while len(self._snapshots) > _MAX_SNAPSHOTS:
                    self._snapshots.popitem(last=False)
        end = len(snapshot.keys) if not limit else min(position + limit, len(snapshot.keys))
        page = snapshot.bodies[position:end]
        list_meta = b'"resourceVersion":"%d"' % rv
        if end < len(snapshot.keys):
            last = snapshot.keys[end - 1]
            start = last[len(namespace) :] if namespace else last
            token = self._encode_continue(rv, start + "\x00")
            list_meta += b',"continue":"%s","remainingItemCount":%d' % (
                token.encode(),
                len(snapshot.keys) - end,
            )
        return (
            b'{"kind":"%sList","apiVersion":"%s","metadata":{'
            % (res.kind.encode(), res.api_version.encode())
            + list_meta
            + b'},"items":['
            + b",".join(page)
            + b"]}"
        )

    def _cached_list_version(self, rv: str, match: str, continue_token: str) -> int | None:
        """The version a list with these options is served at from the watch cache (``None``:
        a quorum read); raises the 422, 410 or 504 the server would answer."""
        if match and not rv:
            raise st.invalid_list_options(
                (
                    "resourceVersionMatch",
                    "Forbidden",
                    "resourceVersionMatch is forbidden unless resourceVersion is provided",
                )
            )
        if match not in ("", "NotOlderThan", "Exact"):
            raise st.invalid_list_options(
                (
                    "resourceVersionMatch",
                    "Unsupported value",
                    f'"{match}": supported values: "Exact", "NotOlderThan"',
                )
            )
        if not rv:
            return None
        if continue_token:
            raise st.invalid_list_options(
                (
                    "resourceVersion",
                    "Forbidden",
                    "specifying resource version is not allowed when using continue",
                )
            )
        try:
            version = int(rv)
        except ValueError:
            raise st.bad_request(f"invalid resourceVersion {rv!r}") from None
        if match == "Exact" and version == 0:
            raise st.invalid_list_options(
                (
                    "resourceVersionMatch",
                    "Forbidden",
                    'resourceVersionMatch "exact" is forbidden for resourceVersion "0"',
                )
            )
        if version > self._rv:
            raise st.too_large_resource_version(version, self._rv)
        return version if match == "Exact" else self._rv

    def _bodies_at(
        self, table: Table, at: int, namespace: str | None, matcher: Matcher | None
    ) -> list[bytes]:
        """The objects as they were at resourceVersion ``at``, rebuilt from the history by
        undoing every later event; 410 once the history no longer reaches back that far."""
        history = list(table.history)
        if at < table.compacted_rv:
            raise st.list_too_old()
        previous: list[int | None] = []
        latest: dict[tuple[str, str], int] = {}
        for i, (_, _, e) in enumerate(history):
            previous.append(latest.get((e.namespace, e.name)))
            latest[(e.namespace, e.name)] = i
        state = {(e.namespace, e.name): e for e in table.entries.values()}
        for i in range(len(history) - 1, -1, -1):
            rv, etype, e = history[i]
            if rv <= at:
                break
            key = (e.namespace, e.name)
            before = previous[i]
            if etype == b"ADDED":
                state.pop(key, None)
            elif before is None:
                raise st.list_too_old()  # its earlier state is older than the history
            else:
                state[key] = history[before][2]
        return [
            state[k].body
            for k in sorted(state)
            if (namespace is None or k[0] == namespace)
            and (matcher is None or matcher(state[k].labels))
        ]

    @staticmethod
    def _encode_continue(rv: int, start: str) -> str:
        raw = _encode({"v": "meta.k8s.io/v1", "rv": rv, "start": start})
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    @staticmethod
    def _decode_continue(token: str) -> tuple[int, str]:
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            data = _decode(raw)
            rv, start = int(data["rv"]), str(data["start"])
        except (ValueError, KeyError, TypeError, msgspec.DecodeError):
            raise st.bad_request(f"invalid continue token: {token!r}") from None
        return rv, start

    @staticmethod
    def _matcher(selector: str) -> Matcher | None:
        try:
            return compile_selector(selector)
        except SelectorError as exc:
            raise st.bad_request(f"unable to parse requirement: {exc}") from None

    def _emit(self, table: Table, etype: bytes, entry: Entry) -> None:
        raise NotImplementedError
