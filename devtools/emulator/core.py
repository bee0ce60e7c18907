"""The emulator: the verbs' semantics (create, update, patch, delete), and Python helpers.

Every mutation, whether it came over HTTP or through the Python helpers, goes through the same
methods here and emits the same watch events (``store`` keeps objects and versions, ``watch``
fans changes out to watches, ``faults`` injects errors and logs requests). All methods run on
the event loop thread.
"""

from __future__ import annotations

import asyncio
import gc
import re
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from devtools.emulator import statuses as st
from devtools.emulator.auth import TokenAuth
from devtools.emulator.events import EventStore
from devtools.emulator.faults import AuditEntry, FaultControls, Faults, RequestRecord
from devtools.emulator.flowcontrol import FlowControl
from devtools.emulator.patching import (
    PatchError,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)
from devtools.emulator.rbac import RbacPolicy
from devtools.emulator.sandboxpods import SELECTOR_LABEL, Shape, sandbox_pod
from devtools.emulator.statuses import LEASES, NAMESPACES, PODS, ApiError, Resource
from devtools.emulator.store import Entry, Table, clone, format_time, ordered, parse_time
from devtools.emulator.watch import Watches, WatchListSupport

__all__ = [
    "DEFAULT_POD_TEMPLATE",
    "JSON_PATCH",
    "MERGE_PATCH",
    "STRATEGIC_MERGE_PATCH",
    "AuditEntry",  # where it was before the split (tests/chaos import it from here)
    "Emulator",
]

_encode = msgspec.json.encode
_decode = msgspec.json.decode
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

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

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


def _default_pod_template() -> dict[str, Any]:
    """A stuck fresh-create sandbox pod without identity (bulk creation fills name and labels)."""
    pod = sandbox_pod(sandbox_id="0", generation=1, shape=Shape.PENDING_STUCK)
    pod["metadata"] = {"labels": {SELECTOR_LABEL[0]: SELECTOR_LABEL[1]}}
    return pod


DEFAULT_POD_TEMPLATE: dict[str, Any] = _default_pod_template()


class Emulator(Watches, FaultControls):
    """The API server's state and its fault controls.

    ``history_size`` bounds the watch history (older resourceVersions get 410 Expired);
    ``bookmark_interval_s`` is how often watches with ``allowWatchBookmarks`` get a BOOKMARK
    (and, as from a kube-apiserver, one 2 s before their ``timeoutSeconds``, where they end);
    ``kubelet_finish_after_s`` (``None``: never) finishes graceful pod deletions by itself, as
    a kubelet would; ``clock`` gives wall-clock seconds for timestamps; ``auth`` (``None``:
    no authentication) and ``flow_control`` (``None``: no throttling) install the bearer-token
    authentication of ``auth.py`` (its ``enabled`` says whether requests must authenticate) and
    the priority levels of ``flowcontrol.py``.
    """

    def __init__(
        self,
        *,
        history_size: int = 10_000,
        bookmark_interval_s: float = 60.0,
        default_watch_timeout_s: float = 1800.0,
        kubelet_finish_after_s: float | None = None,
        watch_list: WatchListSupport = WatchListSupport.SUPPORTED,
        clock: Callable[[], float] = time.time,
        auth: TokenAuth | None = None,
        flow_control: FlowControl | None = None,
    ) -> None:
        self.history_size = history_size
        self.bookmark_interval_s = bookmark_interval_s
        self.default_watch_timeout_s = default_watch_timeout_s
        self.kubelet_finish_after_s = kubelet_finish_after_s
        self.watch_list = watch_list
        self._clock = clock
        self.rbac: RbacPolicy | None = None
        """When set, every API request is authorized against it (``devtools/emulator/rbac.py``);
        ``None``: everything is allowed. Kept across :meth:`reset`."""
        self.auth = auth if auth is not None else TokenAuth(enabled=False)
        """The tokens the emulator issued; when ``enabled``, every API request must carry one
        it accepts, or is answered 401 (``devtools/emulator/auth.py``). Kept across
        :meth:`reset`."""
        self.flow_control = flow_control
        """When set, each user's requests beyond its seats are answered 429
        (``devtools/emulator/flowcontrol.py``). Kept across :meth:`reset`."""
        self.reset()

    def now_s(self) -> float:
        """The emulator's wall clock (the one its timestamps are written with)."""
        return self._clock()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Forget every object, fault and audit entry (open watches are ended)."""
        for table in getattr(self, "_tables", {}).values():
            for w in table.watchers:
                w.closed = True
                w.wake.set()
        self._rv = 0
        self._tables: dict[str, Table] = {
            r.plural: Table(r, self.history_size) for r in (PODS, LEASES, NAMESPACES)
        }
        self._snapshots = OrderedDict()
        self.faults = Faults()
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
        """Every Event received (``events.k8s.io/v1``; served by ``devtools.emulator.events``)."""

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
        obj = body if owned else clone(body)
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
        if not _DNS_SUBDOMAIN.fullmatch(name) or len(name) > 253:
            raise st.invalid_name(res, name)
        meta["name"] = name
        if res.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise st.bad_request(
                    "the namespace of the provided object does not match the namespace sent on "
                    "the request"
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
            new = clone(entry.obj)
            new["status"] = clone(body.get("status", {}))
        else:
            new = clone(body)
            new.pop("kind", None)
            new.pop("apiVersion", None)
            if res.has_status:
                if "status" in entry.obj:
                    new["status"] = clone(entry.obj["status"])
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
        current = clone(entry.obj)
        try:
            if content_type == JSON_PATCH:
                patched = json_patch(current, patch)
            elif content_type == STRATEGIC_MERGE_PATCH:
                if res is not PODS:
                    raise ApiError(
                        st.status(
                            415,
                            "UnsupportedMediaType",
                            "the body of the request was in an unknown format - accepted media "
                            f"types include: {JSON_PATCH}, {MERGE_PATCH}, "
                            "application/apply-patch+yaml",
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
            new = clone(entry.obj)
            new["status"] = patched.get("status", {})
        else:
            new = patched
            if res.has_status:
                if "status" in entry.obj:
                    new["status"] = clone(entry.obj["status"])
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
        if ordered(new) == entry.obj:
            return entry  # a no-op: no new resourceVersion, no event
        table = self.table(res)
        stored = self._store(table, new, new=False)
        return self._maybe_finalize(table, stored)

    def _maybe_finalize(self, table: Table, entry: Entry) -> Entry:
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
                new = clone(entry.obj)
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
        new = clone(entry.obj)
        new_meta = new["metadata"]
        current_ts = meta.get("deletionTimestamp")
        if current_ts is None:
            new_meta["generation"] = int(meta.get("generation", 1)) + 1
            deletion_at = now + grace
        else:
            current_grace = int(meta.get("deletionGracePeriodSeconds", 0))
            if grace >= current_grace:
                return entry  # already terminating at least this fast: nothing changes
            deletion_at = parse_time(current_ts) - current_grace + grace
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
        new = clone(entry.obj)
        new["status"] = clone(status)
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
