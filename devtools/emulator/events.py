"""Events in the emulator: ``events.k8s.io/v1`` create, get and list, and the core/v1 list.

One store holds each Event once, in the ``events.k8s.io/v1`` shape; the core/v1 list renders the
same objects in the legacy shape (``involvedObject``, ``message``, ``reportingComponent``), as
the real server does (``wire-samples/events-core-v1-list.json``). Creation validates what the
real server was seen to reject (``event-create-invalid.422.json``; a ``generateName`` of
``<pod>.``). Faults, latency and the audit log come from the server's middleware like for every
other API path; :meth:`EventStore.events` lets tests and the demo read what was received.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from devtools.emulator import statuses as st
from devtools.emulator import tables
from devtools.emulator.statuses import ApiError, Resource

EVENTS = Resource("events", "Event", "events.k8s.io/v1", "events.k8s.io", True, False, True)
_EVENTS_PATH = "/apis/events.k8s.io/v1/namespaces/{namespace}/events"
_CORE_PATH = "/api/v1/namespaces/{namespace}/events"
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
_MAX_NOTE_BYTES = 1024
_MAX_FIELD = 128
_JSON = "application/json"
_FIELD_ALIASES = {
    "involvedObject.uid": "regarding.uid",
    "involvedObject.name": "regarding.name",
    "involvedObject.kind": "regarding.kind",
    "involvedObject.namespace": "regarding.namespace",
    "message": "note",
    "source": "reportingController",
    "reportingComponent": "reportingController",
}


def _cause(field: str, reason: str, message: str) -> dict[str, str]:
    return {"reason": reason, "message": message, "field": field}


def _required(field: str) -> dict[str, str]:
    return _cause(field, "FieldValueRequired", "Required value")


def _invalid(field: str, value: object, detail: str) -> dict[str, str]:
    return _cause(
        field,
        "FieldValueInvalid",
        f"Invalid value: {msgspec.json.encode(value).decode()}: {detail}",
    )


def _validate(obj: dict[str, Any], namespace: str) -> list[dict[str, str]]:
    """The causes the real server gives for an ``events.k8s.io/v1`` create, in its order."""
    causes: list[dict[str, str]] = []
    meta = obj["metadata"]
    name = meta.get("name")
    if not name:
        causes.append(_required("metadata.name"))
    elif not isinstance(name, str) or len(name) > 253 or not _SUBDOMAIN.fullmatch(name):
        causes.append(_invalid("metadata.name", name, "a lowercase RFC 1123 subdomain"))
    regarding = obj.get("regarding") or {}
    if regarding.get("namespace") not in (None, "", namespace):
        causes.append(
            _invalid(
                "regarding.namespace", regarding["namespace"], "does not match event.namespace"
            )
        )
    if not obj.get("eventTime"):
        causes.append(_required("eventTime"))
    if obj.get("type") not in ("Normal", "Warning"):
        causes.append(_invalid("type", obj.get("type"), "has invalid value"))
    series = obj.get("series")
    if series is not None:
        if not isinstance(series.get("count"), int) or series["count"] < 2:
            causes.append(_invalid("series.count", series.get("count"), "should be at least 2"))
        if not series.get("lastObservedTime"):
            causes.append(_required("series.lastObservedTime"))
    controller = obj.get("reportingController")
    if not controller:
        causes.append(_required("reportingController"))
    elif not isinstance(controller, str) or not _QUALIFIED.fullmatch(controller):
        causes.append(_invalid("reportingController", controller, "must be a qualified name"))
    for field in ("reportingInstance", "action", "reason"):
        value = obj.get(field)
        if not value:
            causes.append(_required(field))
        elif not isinstance(value, str) or len(value) > _MAX_FIELD:
            causes.append(_invalid(field, value, f"can have at most {_MAX_FIELD} characters"))
    note = obj.get("note")
    if isinstance(note, str) and len(note.encode()) > _MAX_NOTE_BYTES:
        causes.append(
            _cause(
                "note",
                "FieldValueTooLong",
                f"Too long: may not be more than {_MAX_NOTE_BYTES} bytes",
            )
        )
    return causes


def _invalid_error(name: str, causes: list[dict[str, str]]) -> ApiError:
    parts = [f"{c['field']}: {c['message']}" for c in causes]
    summary = parts[0] if len(parts) == 1 else f"[{', '.join(parts)}]"
    return ApiError(
        st.status(
            422,
            "Invalid",
            f'Event "{name}" is invalid: {summary}',
            details={"name": name, "kind": "Event", "causes": causes},
        )
    )


def to_core(obj: dict[str, Any]) -> dict[str, Any]:
    """An ``events.k8s.io/v1`` Event in the core/v1 shape (a list item: no kind/apiVersion)."""
    core: dict[str, Any] = {
        "metadata": obj["metadata"],
        "involvedObject": obj.get("regarding") or {},
        "reason": obj.get("reason", ""),
        "message": obj.get("note", ""),
        "source": {},
        "firstTimestamp": None,
        "lastTimestamp": None,
        "type": obj.get("type", ""),
        "eventTime": obj.get("eventTime"),
    }
    if obj.get("series") is not None:
        core["series"] = obj["series"]
    core["action"] = obj.get("action", "")
    core["reportingComponent"] = obj.get("reportingController", "")
    core["reportingInstance"] = obj.get("reportingInstance", "")
    return core


def _lookup_field(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for part in _FIELD_ALIASES.get(path, path).split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def _field_matcher(selector: str) -> Callable[[dict[str, Any]], bool]:
    """``a=b``, ``a==b`` and ``a!=b`` terms joined by commas, as kubectl sends them."""
    terms: list[tuple[str, str, bool]] = []
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        key, sep, value = term.partition("!=" if negate else "=")
        if not sep or not key:
            raise st.bad_request(f"invalid field selector: {term!r}")
        terms.append((key.strip(), value.lstrip("=").strip(), negate))

    def matches(obj: dict[str, Any]) -> bool:
        return all((_lookup_field(obj, k) == v) != neg for k, v, neg in terms)

    return matches


class EventStore:
    """Every Event the emulator received, keyed ``namespace/name``."""

    def __init__(
        self,
        *,
        next_rv: Callable[[], int],
        current_rv: Callable[[], int],
        namespace_exists: Callable[[str], bool],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._next_rv = next_rv
        self._current_rv = current_rv
        self._namespace_exists = namespace_exists
        self._clock = clock
        self._objects: dict[str, dict[str, Any]] = {}

    def create(self, namespace: str, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise st.bad_request("the request body must be a JSON object")
        obj = msgspec.json.decode(msgspec.json.encode(body))
        obj.pop("kind", None)
        obj.pop("apiVersion", None)
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            meta = obj["metadata"] = {}
        if not meta.get("name") and meta.get("generateName"):
            prefix = meta["generateName"]
            if not isinstance(prefix, str) or not _SUBDOMAIN.fullmatch(prefix):
                raise _invalid_error(
                    "",
                    [_invalid("metadata.generateName", prefix, "a lowercase RFC 1123 subdomain")],
                )
            meta["name"] = f"{prefix}{uuid.uuid4().hex[:5]}"
        if meta.get("namespace") not in (None, "", namespace):
            raise st.bad_request(
                "the namespace of the provided object does not match the namespace sent on "
                "the request"
            )
        meta["namespace"] = namespace
        causes = _validate(obj, namespace)
        name = str(meta.get("name") or "")
        if causes:
            raise _invalid_error(name, causes)
        if not self._namespace_exists(namespace):
            raise ApiError(
                st.status(
                    404,
                    "NotFound",
                    f'namespaces "{namespace}" not found',
                    details={"name": namespace, "kind": "namespaces"},
                )
            )
        key = f"{namespace}/{name}"
        if key in self._objects:
            raise st.already_exists(EVENTS, name)
        stored: dict[str, Any] = {
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "resourceVersion": str(self._next_rv()),
                "creationTimestamp": time.strftime(
                    "%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._clock())
                ),
            }
        }
        for field, value in obj.items():
            if field != "metadata":
                stored[field] = value
        stored.setdefault("deprecatedSource", {})
        stored.setdefault("deprecatedFirstTimestamp", None)
        stored.setdefault("deprecatedLastTimestamp", None)
        self._objects[key] = stored
        return stored

    def now_s(self) -> float:
        """The clock the Events' timestamps are written with."""
        return self._clock()

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        obj = self._objects.get(f"{namespace}/{name}")
        if obj is None:
            raise st.not_found(EVENTS, name)
        return obj

    def events(
        self, namespace: str | None = None, field_selector: str = ""
    ) -> list[dict[str, Any]]:
        """Stored Events (``events.k8s.io/v1`` shape, oldest first), optionally filtered."""
        matches = _field_matcher(field_selector)
        return [
            o
            for o in self._objects.values()
            if (namespace is None or o["metadata"]["namespace"] == namespace) and matches(o)
        ]

    def list_body(
        self, namespace: str | None, *, core: bool, field_selector: str = ""
    ) -> dict[str, Any]:
        items = self.events(namespace, field_selector)
        return {
            "kind": "EventList",
            "apiVersion": "v1" if core else "events.k8s.io/v1",
            "metadata": {"resourceVersion": str(self._current_rv())},
            "items": [to_core(o) for o in items] if core else items,
        }


def _reply(obj: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type=_JSON)


def _with_kind(obj: dict[str, Any]) -> dict[str, Any]:
    return {"kind": EVENTS.kind, "apiVersion": EVENTS.api_version, **obj}


def event_routes(store_of: Callable[[web.Request], EventStore]) -> list[web.RouteDef]:
    """The Events paths; register them before the generic resource dispatcher."""

    async def create(request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw) if raw.strip() else None
        except msgspec.DecodeError:
            raise st.bad_request("the request body is not valid JSON") from None
        stored = store_of(request).create(request.match_info["namespace"], body)
        return _reply(_with_kind(stored), 201)

    async def get(request: web.Request) -> web.Response:
        info = request.match_info
        return _reply(_with_kind(store_of(request).get(info["namespace"], info["name"])))

    def lister(*, core: bool) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            store = store_of(request)
            as_table = tables.wants_table(request.headers.get("Accept", ""))
            body = store.list_body(
                request.match_info["namespace"],
                core=core or as_table,
                field_selector=request.query.get("fieldSelector", ""),
            )
            if as_table:
                body = tables.event_table(
                    body["items"], list_meta=body["metadata"], now_s=store.now_s()
                )
            return _reply(body)

        return handler

    return [
        web.post(_EVENTS_PATH, create),
        web.get(_EVENTS_PATH, lister(core=False)),
        web.get(_EVENTS_PATH + "/{name}", get),
        web.get(_CORE_PATH, lister(core=True)),
    ]
