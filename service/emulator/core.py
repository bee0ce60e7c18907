"""The emulator's state: objects, the global resourceVersion, watch history, faults and audit.

Objects are stored as plain dicts (without ``kind``/``apiVersion``, like list items on the wire)
together with their encoded bytes, so a list page is a byte join and a watch event is a splice.
Every mutation, whether it came over HTTP or through the Python helpers, goes through the same
methods here and emits the same watch events. All methods run on the event loop thread.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import calendar
import gc
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from service.emulator import statuses as st
from service.emulator.events import EventStore
from service.emulator.patching import (
    PatchError,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)
from service.emulator.sandboxpods import SELECTOR_LABEL, Shape, sandbox_pod
from service.emulator.selectors import Matcher, SelectorError, compile_selector
from service.emulator.statuses import LEASES, NAMESPACES, PODS, ApiError, Resource

logger = logging.getLogger(__name__)

_encode = msgspec.json.encode
_decode = msgspec.json.decode


def _clone(obj: Any) -> Any:
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
_IMMUTABLE_META = (
    "name",
    "namespace",
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
)
_TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
_MAX_SNAPSHOTS = 16

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


def format_time(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _parse_time(raw: str) -> float:
    return float(calendar.timegm(time.strptime(raw, "%Y-%m-%dT%H:%M:%SZ")))


def _ordered(obj: dict[str, Any]) -> dict[str, Any]:
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


class Watcher:
    """One open watch stream's queue of encoded event lines."""

    __slots__ = ("abort", "closed", "lines", "matcher", "namespace", "wake")

    def __init__(self, namespace: str | None, matcher: Matcher | None) -> None:
        self.namespace = namespace
        self.matcher = matcher
        self.lines: list[bytes] = []
        self.wake = asyncio.Event()
        self.closed = False
        self.abort = False


class _Table:
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


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One mutating request as the emulator answered it."""

    method: str
    path: str
    query: dict[str, str]
    body: Any
    status: int
    time_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.path,
            "query": self.query,
            "body": self.body,
            "status": self.status,
            "time_s": self.time_s,
        }


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One API request as received (method, path and query string parameters)."""

    method: str
    path: str
    query: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "path": self.path, "query": self.query}


@dataclass(slots=True)
class FaultRule:
    """Answer the next ``remaining`` matching requests with ``code``."""

    code: int
    remaining: int
    method: str | None = None
    path_contains: str | None = None
    retry_after_s: int | None = None
    query: dict[str, str] | None = None
    """Parameters the request's query must carry (e.g. ``{"watch": "true"}``); values compare
    case-insensitively, as the server's booleans do (clients send ``true`` or ``True``)."""

    def matches(self, method: str, path: str, query: Mapping[str, str]) -> bool:
        return (
            (self.method is None or self.method == method)
            and (self.path_contains is None or self.path_contains in path)
            and (
                self.query is None
                or all(query.get(k, "").lower() == v.lower() for k, v in self.query.items())
            )
        )


@dataclass(slots=True)
class LatencyRule:
    delay_s: float
    method: str | None = None
    path_contains: str | None = None
    remaining: int | None = None
    """``None``: forever."""


@dataclass(slots=True)
class _Snapshot:
    keys: list[str]
    bodies: list[bytes]


@dataclass
class _Faults:
    rules: list[FaultRule] = field(default_factory=list)
    latency: list[LatencyRule] = field(default_factory=list)
    expire_watches: int = 0


class WatchExpiredError(Exception):
    """The requested resourceVersion is outside the history window (or a 410 was injected)."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body["message"])
        self.body = body


def _default_pod_template() -> dict[str, Any]:
    """A stuck fresh-create sandbox pod without identity (bulk creation fills name and labels)."""
    pod = sandbox_pod(sandbox_id="0", generation=1, shape=Shape.PENDING_STUCK)
    pod["metadata"] = {"labels": {SELECTOR_LABEL[0]: SELECTOR_LABEL[1]}}
    return pod


DEFAULT_POD_TEMPLATE: dict[str, Any] = _default_pod_template()


class Emulator:
    """The API server's state and its fault controls.

    ``history_size`` bounds the watch history (older resourceVersions get 410 Expired);
    ``bookmark_interval_s`` is how often watches with ``allowWatchBookmarks`` get a BOOKMARK;
    ``kubelet_finish_after_s`` (``None``: never) finishes graceful pod deletions by itself, as
    a kubelet would; ``clock`` gives wall-clock seconds for timestamps.
    """

    def __init__(
        self,
        *,
        history_size: int = 10_000,
        bookmark_interval_s: float = 60.0,
        default_watch_timeout_s: float = 1800.0,
        kubelet_finish_after_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.history_size = history_size
        self.bookmark_interval_s = bookmark_interval_s
        self.default_watch_timeout_s = default_watch_timeout_s
        self.kubelet_finish_after_s = kubelet_finish_after_s
        self._clock = clock
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Forget every object, fault and audit entry (open watches are ended)."""
        for table in getattr(self, "_tables", {}).values():
            for w in table.watchers:
                w.closed = True
                w.wake.set()
        self._rv = 0
        self._tables: dict[str, _Table] = {
            r.plural: _Table(r, self.history_size) for r in (PODS, LEASES, NAMESPACES)
        }
        self._snapshots: OrderedDict[tuple[str, str, str, int], _Snapshot] = OrderedDict()
        self.faults = _Faults()
        self.audit: list[AuditEntry] = []
        self.requests: deque[RequestRecord] = deque(maxlen=10_000)
        """Every API request (admin ones excepted), newest last, bounded."""
        self.requests_served = 0
        self.events = EventStore(
            next_rv=self._next_rv,
            current_rv=lambda: self._rv,
            namespace_exists=lambda ns: ns in self.table(NAMESPACES).entries,
            clock=self._clock,
        )
        """Every Event received (``events.k8s.io/v1``; served by ``service.emulator.events``)."""

    @property
    def resource_version(self) -> int:
        """The newest resourceVersion handed out."""
        return self._rv

    def table(self, res: Resource) -> _Table:
        return self._tables[res.plural]

    def resource(self, group: str, plural: str) -> Resource | None:
        table = self._tables.get(plural)
        if table is None or table.res.group != group:
            return None
        return table.res

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    # ------------------------------------------------------------------ events

    def _emit(self, table: _Table, etype: bytes, entry: Entry) -> None:
        rv = self._rv
        history = table.history
        if history.maxlen is not None and len(history) == history.maxlen:
            table.compacted_rv = history[0][0]
        history.append((rv, etype, entry))
        if not table.watchers:
            return
        line: bytes | None = None
        for w in table.watchers:
            if w.namespace is not None and w.namespace != entry.namespace:
                continue
            if w.matcher is not None and not w.matcher(entry.labels):
                continue
            if line is None:
                line = self._event_line(table, etype, entry.body)
            w.lines.append(line)
            w.wake.set()

    @staticmethod
    def _event_line(table: _Table, etype: bytes, body: bytes) -> bytes:
        return b'{"type":"' + etype + b'","object":' + table.prefix + body[1:] + b"}\n"

    def bookmark_line(self, res: Resource) -> bytes:
        return (
            b'{"type":"BOOKMARK","object":'
            + self.table(res).prefix
            + b'"metadata":{"resourceVersion":"%d"},"spec":{"containers":null},"status":{}}}\n'
            % self._rv
        )

    def _store(self, table: _Table, obj: dict[str, Any], *, new: bool) -> Entry:
        meta = obj["metadata"]
        rv = self._next_rv()
        meta["resourceVersion"] = str(rv)
        obj = _ordered(obj)
        meta = obj["metadata"]
        namespace = meta.get("namespace", "")
        entry = Entry(obj=obj, body=_encode(obj), namespace=namespace, name=meta["name"])
        key = f"{namespace}/{entry.name}" if table.res.namespaced else entry.name
        table.entries[key] = entry
        if new:
            table.invalidate()
        self._emit(table, b"ADDED" if new else b"MODIFIED", entry)
        return entry

    def _remove(self, table: _Table, key: str, entry: Entry) -> Entry:
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
        obj.update(_clone(entry.obj))
        return obj

    # ------------------------------------------------------------------ create

    def create(
        self,
        res: Resource,
        namespace: str,
        body: Any,
        *,
        keep_status: bool = False,
        owned: bool = False,
    ) -> Entry:
        """POST semantics. Pods start with ``status: {phase: Pending}`` unless ``keep_status``;
        ``owned`` hands ``body`` over (no copy is taken)."""
        if not isinstance(body, dict):
            raise st.bad_request("the request body must be a JSON object")
        obj = body if owned else _clone(body)
        obj.pop("kind", None)
        obj.pop("apiVersion", None)
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            meta = obj["metadata"] = {}
        name = meta.get("name")
        if not name and meta.get("generateName"):
            name = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
        if not isinstance(name, str) or not name:
            raise st.invalid(
                res, "", "metadata.name: Required value: name or generateName is required"
            )
        meta["name"] = name
        if res.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise st.bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = namespace
            if self._key(NAMESPACES, "", namespace) not in self.table(NAMESPACES).entries:
                raise st.not_found(NAMESPACES, namespace)
        else:
            meta.pop("namespace", None)
        table = self.table(res)
        if self._key(res, namespace, name) in table.entries:
            raise st.already_exists(res, name)
        meta["uid"] = str(uuid.uuid4())
        meta.pop("deletionTimestamp", None)
        meta.pop("deletionGracePeriodSeconds", None)
        meta["creationTimestamp"] = format_time(self._clock())
        if res is PODS:
            meta["generation"] = 1
            if not keep_status or not isinstance(obj.get("status"), dict):
                obj["status"] = {"phase": "Pending"}
            spec = obj.setdefault("spec", {})
            spec.setdefault("terminationGracePeriodSeconds", 30)
        elif res is NAMESPACES:
            obj.setdefault("spec", {"finalizers": ["kubernetes"]})
            obj["status"] = {"phase": "Active"}
        return self._store(table, obj, new=True)

    def ensure_namespace(self, name: str) -> None:
        if name not in self.table(NAMESPACES).entries:
            self.create(NAMESPACES, "", {"metadata": {"name": name}})

    # ------------------------------------------------------------------ update

    def replace(
        self, res: Resource, namespace: str, name: str, body: Any, *, subresource: str | None = None
    ) -> Entry:
        """PUT semantics, with optimistic concurrency on ``metadata.resourceVersion``."""
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            raise st.bad_request("the request body must be an object with metadata")
        entry = self.lookup(res, namespace, name)
        if body["metadata"].get("name") not in (None, name):
            raise st.bad_request("the name of the object does not match the name on the URL")
        sent_rv = body["metadata"].get("resourceVersion")
        if not sent_rv and not res.unconditional_update:
            raise st.invalid(
                res,
                name,
                "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update",
            )
        if sent_rv and sent_rv != entry.obj["metadata"]["resourceVersion"]:
            raise st.modified_conflict(res, name)
        if subresource == "status":
            new = _clone(entry.obj)
            new["status"] = _clone(body.get("status", {}))
        else:
            new = _clone(body)
            new.pop("kind", None)
            new.pop("apiVersion", None)
            if res.has_status:
                if "status" in entry.obj:
                    new["status"] = _clone(entry.obj["status"])
                else:
                    new.pop("status", None)
        return self._update(res, entry, new)

    def patch(
        self,
        res: Resource,
        namespace: str,
        name: str,
        patch: Any,
        *,
        content_type: str = MERGE_PATCH,
        subresource: str | None = None,
    ) -> Entry:
        """PATCH semantics (merge, strategic-merge subset, JSON patch)."""
        entry = self.lookup(res, namespace, name)
        current = _clone(entry.obj)
        try:
            if content_type == JSON_PATCH:
                patched = json_patch(current, patch)
            elif content_type == STRATEGIC_MERGE_PATCH:
                if res is not PODS:
                    raise ApiError(
                        st.status(
                            415,
                            "UnsupportedMediaType",
                            f"the body of the request was in an unknown format - accepted media types include: {JSON_PATCH}, {MERGE_PATCH}, application/apply-patch+yaml",
                        )
                    )
                patched = strategic_merge_patch(current, patch)
            elif content_type == MERGE_PATCH:
                patched = merge_patch(current, patch)
            else:
                raise ApiError(
                    st.status(
                        415, "UnsupportedMediaType", f"unsupported patch type {content_type!r}"
                    )
                )
        except PatchError as exc:
            raise st.invalid(res, name, str(exc)) from None
        if not isinstance(patched, dict) or not isinstance(patched.get("metadata"), dict):
            raise st.invalid(res, name, "metadata: Required value")
        sent_rv = (
            patch.get("metadata", {}).get("resourceVersion") if isinstance(patch, dict) else None
        )
        if sent_rv and sent_rv != entry.obj["metadata"]["resourceVersion"]:
            raise st.modified_conflict(res, name)
        if subresource == "status":
            new = _clone(entry.obj)
            new["status"] = patched.get("status", {})
        else:
            new = patched
            if res.has_status:
                if "status" in entry.obj:
                    new["status"] = _clone(entry.obj["status"])
                else:
                    new.pop("status", None)
        return self._update(res, entry, new)

    def _update(self, res: Resource, entry: Entry, new: dict[str, Any]) -> Entry:
        old_meta = entry.obj["metadata"]
        meta = new.setdefault("metadata", {})
        for key in _IMMUTABLE_META:
            if key in old_meta:
                meta[key] = old_meta[key]
            else:
                meta.pop(key, None)
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if not meta.get("finalizers"):
            meta.pop("finalizers", None)
        if res is PODS and new.get("spec") != entry.obj.get("spec"):
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        if _ordered(new) == entry.obj:
            return entry  # a no-op: no new resourceVersion, no event
        table = self.table(res)
        stored = self._store(table, new, new=False)
        return self._maybe_finalize(table, stored)

    def _maybe_finalize(self, table: _Table, entry: Entry) -> Entry:
        meta = entry.obj["metadata"]
        if (
            meta.get("deletionTimestamp") is not None
            and meta.get("deletionGracePeriodSeconds", 0) == 0
            and not meta.get("finalizers")
        ):
            return self._remove(table, self._key(table.res, entry.namespace, entry.name), entry)
        return entry

    # ------------------------------------------------------------------ delete

    def delete(
        self,
        res: Resource,
        namespace: str,
        name: str,
        *,
        grace_period_s: int | None = None,
        uid: str | None = None,
        resource_version: str | None = None,
    ) -> Entry:
        """DELETE semantics: preconditions, graceful pod deletion, finalizers.

        Returns the object as the response shows it: the final state when it went away, or
        the terminating state when it stays (graceful, or held by finalizers).
        """
        entry = self.lookup(res, namespace, name)
        meta = entry.obj["metadata"]
        if uid is not None and uid != meta["uid"]:
            raise st.precondition_uid_conflict(res, name, uid, meta["uid"])
        if resource_version is not None and resource_version != meta["resourceVersion"]:
            raise st.precondition_rv_conflict(res, name, resource_version, meta["resourceVersion"])
        table = self.table(res)
        if res is not PODS:
            if meta.get("finalizers"):
                if meta.get("deletionTimestamp") is not None:
                    return entry
                new = _clone(entry.obj)
                new["metadata"]["deletionTimestamp"] = format_time(self._clock())
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                return self._store(table, new, new=False)
            return self._remove(table, self._key(res, namespace, name), entry)
        spec = entry.obj.get("spec") or {}
        status = entry.obj.get("status") or {}
        grace = grace_period_s
        if grace is None:
            grace = int(spec.get("terminationGracePeriodSeconds", 30))
        if not spec.get("nodeName") or status.get("phase") in _TERMINAL_PHASES:
            grace = 0
        grace = max(grace, 0)
        now = self._clock()
        new = _clone(entry.obj)
        new_meta = new["metadata"]
        current_ts = meta.get("deletionTimestamp")
        if current_ts is None:
            new_meta["generation"] = int(meta.get("generation", 1)) + 1
            deletion_at = now + grace
        else:
            current_grace = int(meta.get("deletionGracePeriodSeconds", 0))
            if grace >= current_grace:
                return entry  # already terminating at least this fast: nothing changes
            deletion_at = _parse_time(current_ts) - current_grace + grace
        new_meta["deletionTimestamp"] = format_time(deletion_at)
        new_meta["deletionGracePeriodSeconds"] = grace
        stored = self._store(table, new, new=False)
        if grace > 0 and self.kubelet_finish_after_s is not None:
            self._schedule_kubelet(namespace, name, new_meta["uid"])
        return self._maybe_finalize(table, stored)

    def _schedule_kubelet(self, namespace: str, name: str, uid: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        assert self.kubelet_finish_after_s is not None
        loop.call_later(self.kubelet_finish_after_s, self._kubelet_finish, namespace, name, uid)

    def _kubelet_finish(self, namespace: str, name: str, uid: str) -> None:
        entry = self.table(PODS).entries.get(f"{namespace}/{name}")
        if entry is not None and entry.obj["metadata"]["uid"] == uid:
            self.delete(PODS, namespace, name, grace_period_s=0, uid=uid)

    def finish_terminating(self, namespace: str | None = None, name: str | None = None) -> int:
        """Act as the kubelet: finish every graceful pod deletion (grace 0). Returns the count."""
        done = 0
        for entry in list(self.table(PODS).entries.values()):
            meta = entry.obj["metadata"]
            if (
                meta.get("deletionTimestamp") is None
                or meta.get("deletionGracePeriodSeconds", 0) == 0
            ):
                continue
            if (namespace is not None and entry.namespace != namespace) or (
                name is not None and entry.name != name
            ):
                continue
            self.delete(PODS, entry.namespace, entry.name, grace_period_s=0)
            done += 1
        return done

    # ------------------------------------------------------------------ list

    def list_body(
        self,
        res: Resource,
        namespace: str | None,
        *,
        selector: str = "",
        limit: int = 0,
        continue_token: str = "",
    ) -> bytes:
        """A ``<Kind>List`` page, consistent at the resourceVersion of its first page."""
        matcher = self._matcher(selector)
        table = self.table(res)
        ns_key = namespace or ""
        if continue_token:
            rv, start = self._decode_continue(continue_token)
            snapshot = self._snapshots.get((res.plural, ns_key, selector, rv))
            if snapshot is None:
                raise st.expired_continue(self._encode_continue(-1, start))
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

    # ------------------------------------------------------------------ watch

    def open_watch(
        self,
        res: Resource,
        namespace: str | None,
        *,
        selector: str = "",
        resource_version: str = "",
    ) -> Watcher:
        """Register a watcher and queue what it must see first.

        Raises :class:`WatchExpiredError` when ``resource_version`` is older than the history.
        """
        matcher = self._matcher(selector)
        table = self.table(res)
        if self.faults.expire_watches > 0:
            self.faults.expire_watches -= 1
            raise WatchExpiredError(st.too_old_watch(resource_version or "0", self._oldest(table)))
        w = Watcher(namespace, matcher)
        if resource_version in ("", "0"):
            # No version: the current state as ADDED events, then changes.
            for key in table.sorted_keys():
                e = table.entries[key]
                if self._watch_matches(w, e):
                    w.lines.append(self._event_line(table, b"ADDED", e.body))
        else:
            try:
                since = int(resource_version)
            except ValueError:
                raise st.bad_request(f"invalid resourceVersion {resource_version!r}") from None
            if since < table.compacted_rv:
                raise WatchExpiredError(st.too_old_watch(resource_version, self._oldest(table)))
            for rv, etype, e in table.history:
                if rv > since and self._watch_matches(w, e):
                    w.lines.append(self._event_line(table, etype, e.body))
        table.watchers.add(w)
        return w

    @staticmethod
    def _watch_matches(w: Watcher, e: Entry) -> bool:
        if w.namespace is not None and w.namespace != e.namespace:
            return False
        return w.matcher is None or w.matcher(e.labels)

    def _oldest(self, table: _Table) -> int:
        return table.history[0][0] if table.history else self._rv

    def close_watch(self, res: Resource, w: Watcher) -> None:
        self.table(res).watchers.discard(w)

    def open_watch_count(self) -> int:
        return sum(len(t.watchers) for t in self._tables.values())

    # ------------------------------------------------------------------ faults

    def drop_watches(self, *, abrupt: bool = True) -> int:
        """End every open watch stream: ``abrupt`` cuts the connection mid-stream, otherwise the
        stream ends cleanly (as at ``timeoutSeconds``). Returns how many were open."""
        count = 0
        for table in self._tables.values():
            for w in table.watchers:
                w.abort = abrupt
                w.closed = True
                if abrupt:
                    w.lines.clear()  # what was still in flight is lost with the connection
                w.wake.set()
                count += 1
            # Detached at once: changes made from now on are not queued on the old streams.
            table.watchers = set()
        return count

    def inject_watch_line(self, line: bytes, res: Resource = PODS) -> int:
        """Send ``line`` (raw bytes, e.g. a malformed event) on every open watch of ``res``."""
        table = self.table(res)
        for w in table.watchers:
            w.lines.append(line if line.endswith(b"\n") else line + b"\n")
            w.wake.set()
        return len(table.watchers)

    def expire_next_watches(self, count: int = 1) -> None:
        """The next ``count`` watch requests get a 410 Expired ERROR event."""
        self.faults.expire_watches += count

    def compact(self) -> None:
        """Forget the watch history and every paginated list snapshot (as etcd compaction
        would): watches from older versions get 410, continue tokens expire."""
        for table in self._tables.values():
            table.history.clear()
            table.compacted_rv = self._rv
        self._snapshots.clear()

    def fail_next(
        self,
        count: int = 1,
        *,
        code: int = 500,
        method: str | None = None,
        path_contains: str | None = None,
        retry_after_s: int | None = None,
        query: dict[str, str] | None = None,
    ) -> None:
        """Answer the next ``count`` matching API requests with ``code`` (429 sets Retry-After);
        ``query``: only requests whose query carries these parameters."""
        self.faults.rules.append(
            FaultRule(
                code=code,
                remaining=count,
                method=method.upper() if method else None,
                path_contains=path_contains,
                retry_after_s=retry_after_s,
                query=query,
            )
        )

    def add_latency(
        self,
        delay_s: float,
        *,
        method: str | None = None,
        path_contains: str | None = None,
        count: int | None = None,
    ) -> None:
        self.faults.latency.append(
            LatencyRule(
                delay_s=delay_s,
                method=method.upper() if method else None,
                path_contains=path_contains,
                remaining=count,
            )
        )

    def clear_faults(self) -> None:
        self.faults = _Faults()

    def take_fault(
        self, method: str, path: str, query: Mapping[str, str] | None = None
    ) -> ApiError | None:
        for rule in self.faults.rules:
            if rule.remaining > 0 and rule.matches(method, path, query or {}):
                rule.remaining -= 1
                return st.injected(rule.code, rule.retry_after_s)
        self.faults.rules = [r for r in self.faults.rules if r.remaining > 0]
        return None

    def latency_for(self, method: str, path: str) -> float:
        delay = 0.0
        for rule in self.faults.latency:
            if rule.remaining == 0:
                continue
            if (rule.method is None or rule.method == method) and (
                rule.path_contains is None or rule.path_contains in path
            ):
                delay += rule.delay_s
                if rule.remaining is not None:
                    rule.remaining -= 1
        return delay

    def record(self, entry: AuditEntry) -> None:
        self.audit.append(entry)

    def watch_requests(self) -> list[RequestRecord]:
        """The watch requests received so far (oldest first)."""
        return [r for r in self.requests if r.query.get("watch") in ("true", "True", "1")]

    def audit_log(
        self, *, method: str | None = None, path_contains: str | None = None
    ) -> list[AuditEntry]:
        return [
            a
            for a in self.audit
            if (method is None or a.method == method.upper())
            and (path_contains is None or path_contains in a.path)
        ]

    # ------------------------------------------------------------------ Python helpers

    def create_pod(self, pod: dict[str, Any], *, namespace: str | None = None) -> dict[str, Any]:
        """Create a pod (its ``status`` is kept, unlike an HTTP create); the namespace is
        created when missing. Emits ADDED like an HTTP create."""
        ns = namespace or (pod.get("metadata") or {}).get("namespace") or "default"
        self.ensure_namespace(ns)
        return self.to_object(PODS, self.create(PODS, ns, pod, keep_status=True))

    def create_pods(
        self, pods: Iterable[dict[str, Any]], *, namespace: str, owned: bool = False
    ) -> int:
        """Create many pods quickly (no copies returned; ``owned``: the dicts are handed over).
        Returns the count."""
        self.ensure_namespace(namespace)
        count = 0
        # Millions of small dicts would trigger many full GC passes over a growing heap.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for pod in pods:
                self.create(PODS, namespace, pod, keep_status=True, owned=owned)
                count += 1
        finally:
            if was_enabled:
                gc.enable()
        # The stored pods live until deleted: keep them out of every later collection, or each
        # full pass walks millions of dicts and stalls every request for a few hundred ms.
        gc.freeze()
        return count

    def bulk_create_pods(
        self,
        *,
        namespace: str,
        count: int,
        start: int = 0,
        template: dict[str, Any] | None = None,
        name_prefix: str = "space-sbx-",
        generation: int = 1,
        pod_kind: str = "create",
    ) -> int:
        """Create ``count`` sandbox-labelled pods named ``<prefix><id>-g<generation>`` where the
        sandbox id is ``start + i`` as 12 hex digits (benchmarks, the demo)."""
        base = _encode(template if template is not None else DEFAULT_POD_TEMPLATE)

        def pods() -> Iterable[dict[str, Any]]:
            for i in range(start, start + count):
                sandbox = f"{i:012x}"
                pod = _decode(base)
                meta = pod.setdefault("metadata", {})
                meta["name"] = f"{name_prefix}{sandbox}-g{generation}"
                labels = meta.setdefault("labels", {})
                labels["space.sandbox-id"] = sandbox
                labels["space.generation"] = str(generation)
                labels["space.pod-kind"] = pod_kind
                yield pod

        return self.create_pods(pods(), namespace=namespace, owned=True)

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        entry = self.table(PODS).entries.get(f"{namespace}/{name}")
        return None if entry is None else self.to_object(PODS, entry)

    def pod_keys(self, namespace: str | None = None) -> set[str]:
        """``namespace/name`` of every pod (optionally in one namespace)."""
        return {
            k
            for k, e in self.table(PODS).entries.items()
            if namespace is None or e.namespace == namespace
        }

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return [
            self.to_object(PODS, e)
            for e in self.table(PODS).entries.values()
            if namespace is None or e.namespace == namespace
        ]

    def set_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Replace a pod's status, as a kubelet's status write would (MODIFIED)."""
        entry = self.lookup(PODS, namespace, name)
        new = _clone(entry.obj)
        new["status"] = _clone(status)
        return self.to_object(PODS, self._update(PODS, entry, new))

    def patch_pod(
        self,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        *,
        subresource: str | None = None,
        content_type: str = STRATEGIC_MERGE_PATCH,
    ) -> dict[str, Any]:
        entry = self.patch(
            PODS, namespace, name, patch, content_type=content_type, subresource=subresource
        )
        return self.to_object(PODS, entry)

    def delete_pod(
        self,
        namespace: str,
        name: str,
        *,
        grace_period_s: int | None = None,
        uid: str | None = None,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        entry = self.delete(
            PODS,
            namespace,
            name,
            grace_period_s=grace_period_s,
            uid=uid,
            resource_version=resource_version,
        )
        return self.to_object(PODS, entry)
