"""The emulator's HTTP face: the Kubernetes REST paths, watch streaming, and ``/_emulator`` admin.

API paths (``/api/v1/...``, ``/apis/coordination.k8s.io/v1/...``, the Events paths of
``events.py``, discovery) go through one middleware that applies injected latency, then, in a
kube-apiserver's order, authenticates the request when token authentication is on (``auth.py``:
401), gives it a seat of its user's priority level when flow control is on (``flowcontrol.py``:
429), authorizes it when an RBAC policy is installed (``rbac.py``: 403), applies injected faults,
and writes the audit log of mutating requests; admin paths under ``/_emulator/`` bypass all of it
so tests and benchmarks can steer a running emulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from devtools.emulator import discovery, fields, rbac, tables
from devtools.emulator import statuses as st
from devtools.emulator.auth import DEFAULT_USER
from devtools.emulator.core import MERGE_PATCH, Emulator
from devtools.emulator.events import event_routes
from devtools.emulator.faults import AuditEntry, RequestRecord
from devtools.emulator.flowcontrol import DEFAULT_SEAT_TIME_S, FlowControl
from devtools.emulator.statuses import NAMESPACES, PODS, ApiError, Resource
from devtools.emulator.watch import WatchExpiredError, WatchListSupport

logger = logging.getLogger(__name__)

ADMIN_PREFIX = "/_emulator/"
ANONYMOUS = "system:anonymous"
_MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_TRUE = frozenset({"true", "True", "1"})
_JSON = "application/json"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
EMULATOR_KEY = web.AppKey("emulator", Emulator)


def _json_response(
    body: bytes, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(body=body, status=status, content_type=_JSON, headers=headers)


def _error_response(err: ApiError) -> web.Response:
    return _json_response(msgspec.json.encode(err.body), err.code, err.headers or None)


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    if not raw.strip():
        return None
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise st.bad_request("the request body is not valid JSON") from None


def _authorize(
    emulator: Emulator, method: str, path: str, query: Mapping[str, str], user: str
) -> ApiError | None:
    """The 403 of a request of ``user`` the installed RBAC policy does not allow (a user other
    than the policy's subject is granted nothing); ``None``: allowed."""
    policy = emulator.rbac
    if policy is None:
        return None
    attrs = rbac.attributes(method, path, query)
    if attrs is None or (user == policy.user and policy.allows(attrs)):
        return None
    return policy.forbidden(attrs, user)


def _user(emulator: Emulator, request: web.Request) -> str:
    """The request's user: its token's when authentication is on (raises the 401), else the
    RBAC policy's subject, else ``system:anonymous``."""
    if emulator.auth.enabled:
        return emulator.auth.authenticate(request.headers.get("Authorization"))
    return emulator.rbac.user if emulator.rbac is not None else ANONYMOUS


async def _answer(request: web.Request, handler: Handler, user: str) -> web.StreamResponse:
    """Authorization, faults and the handler: the answer of an authenticated request."""
    emulator = request.app[EMULATOR_KEY]
    method, path = request.method, request.path
    # Authorization first, as a kube-apiserver: a denied request reaches no handler or fault.
    denied = _authorize(emulator, method, path, request.query, user)
    if denied is not None:
        return _error_response(denied)
    fault = emulator.take_fault(method, path, request.query)
    if fault is not None:
        return _error_response(fault)
    try:
        return await handler(request)
    except ApiError as err:
        return _error_response(err)


async def _seated(request: web.Request, handler: Handler, user: str) -> web.StreamResponse:
    """:func:`_answer` in a seat of ``user``'s priority level when flow control is on."""
    flow = request.app[EMULATOR_KEY].flow_control
    watch = request.query.get("watch", "") in _TRUE
    if flow is None or not flow.applies(user, watch=watch):
        return await _answer(request, handler, user)
    if not flow.try_acquire(user):
        return flow.too_many_requests(user)
    try:
        await flow.before_handling()
        response = await _answer(request, handler, user)
        await flow.after_handling()
    finally:
        flow.release_seat(user)
    if not response.prepared:
        response.headers.update(flow.headers(user))
    return response


@web.middleware
async def _api_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    path = request.path
    if path.startswith(ADMIN_PREFIX):
        return await handler(request)
    emulator = request.app[EMULATOR_KEY]
    emulator.requests_served += 1
    method = request.method
    record = RequestRecord(method, path, dict(request.query))
    emulator.requests.append(record)
    delay = emulator.latency_for(method, path)
    if delay > 0:
        await asyncio.sleep(delay)
    await emulator.intercept(method, path)
    record.time_s = time.time()
    try:
        user = _user(emulator, request)
    except ApiError as err:
        response: web.StreamResponse = _error_response(err)
    else:
        response = await _seated(request, handler, user)
    record.status = response.status
    if method in _MUTATING:
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw) if raw.strip() else None
        except msgspec.DecodeError:
            body = raw.decode("utf-8", "replace")
        emulator.record(
            AuditEntry(
                method=method,
                path=path,
                query=dict(request.query),
                body=body,
                status=response.status,
                time_s=time.time(),
            )
        )
    return response


@dataclass(frozen=True, slots=True)
class _Target:
    res: Resource
    namespace: str | None
    name: str | None
    subresource: str | None


def _resolve(emulator: Emulator, path: str) -> _Target:
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api" and parts[1] == "v1":
        group, rest = "", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        raise ApiError(
            st.status(404, "NotFound", "the server could not find the requested resource")
        )
    namespace: str | None = None
    if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    if not rest:
        raise ApiError(
            st.status(404, "NotFound", "the server could not find the requested resource")
        )
    res = emulator.resource(group, rest[0])
    if res is None or len(rest) > 3 or (namespace is not None and not res.namespaced):
        raise ApiError(
            st.status(404, "NotFound", "the server could not find the requested resource")
        )
    name = rest[1] if len(rest) >= 2 else None
    sub = rest[2] if len(rest) == 3 else None
    if sub is not None and (sub != "status" or not res.has_status):
        raise ApiError(
            st.status(404, "NotFound", "the server could not find the requested resource")
        )
    return _Target(res, namespace, name, sub)


def _int_param(request: web.Request, name: str) -> int | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise st.bad_request(f"invalid {name} {raw!r}") from None


def _optional_bool(request: web.Request, name: str) -> bool | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return None
    if raw.lower() not in ("true", "false", "1", "0"):
        raise st.bad_request(f"invalid {name} {raw!r}")
    return raw.lower() in ("true", "1")


async def _dispatch(request: web.Request) -> web.StreamResponse:
    emulator = request.app[EMULATOR_KEY]
    target = _resolve(emulator, request.path)
    res, namespace, name = target.res, target.namespace, target.name
    method = request.method
    ns = namespace or ""
    if name is None:
        if method == "GET":
            field_selector = request.query.get("fieldSelector", "")
            if field_selector and res is not PODS:
                raise st.bad_request(f"the emulator selects {res.plural} by no field")
            if request.query.get("watch", "") in _TRUE:
                if field_selector:
                    raise st.bad_request("the emulator filters no watch by field")
                return await _watch(request, emulator, target)
            body = emulator.list_body(
                res,
                namespace,
                selector=request.query.get("labelSelector", ""),
                limit=_int_param(request, "limit") or 0,
                continue_token=request.query.get("continue", ""),
                resource_version=request.query.get("resourceVersion", ""),
                resource_version_match=request.query.get("resourceVersionMatch", ""),
            )
            as_table = res is PODS and tables.wants_table(request.headers.get("Accept", ""))
            if not field_selector and not as_table:
                return _json_response(body)
            page = msgspec.json.decode(body)
            if field_selector:
                matches = fields.pod_matcher(field_selector)
                page["items"] = [pod for pod in page["items"] if matches(pod)]
                page["metadata"].pop("remainingItemCount", None)
            if as_table:
                return _table_response(request, emulator, page["items"], page["metadata"])
            return _json_response(msgspec.json.encode(page))
        if method == "POST" and (namespace is not None or not res.namespaced):
            entry = emulator.create(res, ns, await _read_json(request))
            return _json_response(emulator.full_bytes(res, entry), 201)
        raise ApiError(st.status(405, "MethodNotAllowed", f"{method} is not supported here"))
    if res.namespaced and namespace is None:
        raise ApiError(
            st.status(404, "NotFound", "the server could not find the requested resource")
        )
    if method == "GET":
        entry = emulator.lookup(res, ns, name)
    elif method == "PUT":
        entry = emulator.replace(
            res, ns, name, await _read_json(request), subresource=target.subresource
        )
    elif method == "PATCH":
        content_type = request.content_type or MERGE_PATCH
        patch = await _read_json(request)
        entry = emulator.patch(
            res, ns, name, patch, content_type=content_type, subresource=target.subresource
        )
    elif method == "DELETE" and target.subresource is None:
        options = await _read_json(request) or {}
        if not isinstance(options, dict):
            raise st.bad_request("DeleteOptions must be a JSON object")
        pre = options.get("preconditions") or {}
        grace = options.get("gracePeriodSeconds")
        if grace is None:
            grace = _int_param(request, "gracePeriodSeconds")
        entry = emulator.delete(
            res,
            ns,
            name,
            grace_period_s=None if grace is None else int(grace),
            uid=pre.get("uid"),
            resource_version=pre.get("resourceVersion"),
        )
    else:
        raise ApiError(st.status(405, "MethodNotAllowed", f"{method} is not supported here"))
    if (
        method == "GET"
        and res is PODS
        and target.subresource is None
        and tables.wants_table(request.headers.get("Accept", ""))
    ):
        pod = emulator.to_object(res, entry)
        return _table_response(
            request, emulator, [pod], {"resourceVersion": pod["metadata"]["resourceVersion"]}
        )
    return _json_response(emulator.full_bytes(res, entry))


def _table_response(
    request: web.Request,
    emulator: Emulator,
    pods: list[dict[str, Any]],
    list_meta: dict[str, Any],
) -> web.Response:
    """Pods in the Table form (``tables.py``), as a real server answers ``kubectl get pods``."""
    table = tables.pod_table(
        pods, list_meta=list_meta, now_s=emulator.now_s(), include_object=_include_object(request)
    )
    return _json_response(msgspec.json.encode(table))


def _include_object(request: web.Request) -> str:
    include = request.query.get("includeObject", "") or "Metadata"
    if include not in tables.INCLUDE_OBJECT:
        raise st.bad_request(f"invalid includeObject {include!r}")
    return include


PRE_TIMEOUT_BOOKMARK_S = 2.0
"""How long before a watch's ``timeoutSeconds`` a kube-apiserver sends it a last bookmark."""


def _next_bookmark(
    now: float, interval_s: float, deadline: float, timeout_s: float
) -> float | None:
    """When a watch that allows bookmarks gets its next one, as a kube-apiserver's watch cache
    sends them: ``interval_s`` after the last (60 s on a real server) until the last one,
    :data:`PRE_TIMEOUT_BOOKMARK_S` before the watch's end; ``None`` once that one is sent. A
    watch of ``timeout_s`` no longer than that (a real server sends it none) gets one every
    ``interval_s``: tests scale the interval down, not this constant."""
    at = now + interval_s
    if timeout_s <= PRE_TIMEOUT_BOOKMARK_S:
        return at
    last = deadline - PRE_TIMEOUT_BOOKMARK_S
    return min(at, last) if now < last else None


async def _watch(request: web.Request, emulator: Emulator, target: _Target) -> web.StreamResponse:
    res = target.res
    bookmarks = request.query.get("allowWatchBookmarks", "") in _TRUE
    as_table = None  # the includeObject of a watch asked for as a Table (kubectl get pods -w)
    if res is PODS and tables.wants_table(request.headers.get("Accept", "")):
        as_table = _include_object(request)
    timeout = _int_param(request, "timeoutSeconds")
    timeout_s = float(timeout) if timeout else emulator.default_watch_timeout_s
    expired: dict[str, Any] | None = None
    watcher = None
    try:
        watcher = emulator.open_watch(
            res,
            target.namespace,
            selector=request.query.get("labelSelector", ""),
            resource_version=request.query.get("resourceVersion", ""),
            resource_version_match=request.query.get("resourceVersionMatch", ""),
            send_initial_events=_optional_bool(request, "sendInitialEvents"),
            bookmarks=bookmarks,
        )
    except WatchExpiredError as exc:
        expired = exc.body
    response = web.StreamResponse(
        status=200, headers={"Content-Type": _JSON, "Cache-Control": "no-cache, private"}
    )
    response.enable_chunked_encoding()
    try:
        await response.prepare(request)
        if watcher is None:
            await response.write(msgspec.json.encode({"type": "ERROR", "object": expired}) + b"\n")
            return response
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        interval = emulator.bookmark_interval_s
        next_bookmark = (
            _next_bookmark(loop.time(), interval, deadline, timeout_s) if bookmarks else None
        )
        while True:
            now = loop.time()
            if now >= deadline:
                break  # as a real server: at timeoutSeconds, whatever is pending
            if watcher.lines:
                lines = watcher.lines
                if as_table is not None:
                    lines = [
                        tables.watch_line(line, now_s=emulator.now_s(), include_object=as_table)
                        for line in lines
                    ]
                chunk = b"".join(lines)
                watcher.lines.clear()
                await response.write(chunk)
                continue
            if watcher.abort:
                if request.transport is not None:
                    request.transport.abort()
                break
            if watcher.closed:
                break
            if next_bookmark is not None and now >= next_bookmark:
                await response.write(emulator.bookmark_line(res))
                next_bookmark = _next_bookmark(now, interval, deadline, timeout_s)
                continue
            wait_s = deadline - now
            if next_bookmark is not None:
                wait_s = min(wait_s, next_bookmark - now)
            watcher.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(watcher.wake.wait(), wait_s)
    except (ConnectionResetError, ConnectionError):
        logger.debug("watch client went away")
    finally:
        if watcher is not None:
            emulator.close_watch(res, watcher)
    return response


# ---------------------------------------------------------------------- discovery


def _discovery_response(request: web.Request, doc: dict[str, Any] | None) -> web.Response:
    if doc is None:
        raise ApiError(
            st.status(404, "NotFound", "the server could not find the requested resource")
        )
    return _json_response(msgspec.json.encode(doc))


async def _version(request: web.Request) -> web.Response:
    return _discovery_response(request, discovery.VERSION)


async def _api(request: web.Request) -> web.Response:
    if discovery.wants_aggregated(request.headers.get("Accept", "")):
        body = msgspec.json.encode(discovery.aggregated(core=True))
        return web.Response(body=body, headers={"Content-Type": discovery.AGGREGATED})
    return _discovery_response(request, discovery.api_versions(request.host))


async def _apis(request: web.Request) -> web.Response:
    if discovery.wants_aggregated(request.headers.get("Accept", "")):
        body = msgspec.json.encode(discovery.aggregated(core=False))
        return web.Response(body=body, headers={"Content-Type": discovery.AGGREGATED})
    return _discovery_response(request, discovery.api_group_list())


async def _api_v1(request: web.Request) -> web.Response:
    return _discovery_response(request, discovery.resource_list("", "v1"))


async def _api_group(request: web.Request) -> web.Response:
    return _discovery_response(request, discovery.api_group(request.match_info["group"]))


async def _api_group_version(request: web.Request) -> web.Response:
    info = request.match_info
    return _discovery_response(request, discovery.resource_list(info["group"], info["version"]))


# ---------------------------------------------------------------------- admin endpoints


async def _admin_body(request: web.Request) -> dict[str, Any]:
    data = await _read_json(request)
    return data if isinstance(data, dict) else {}


def _ok(data: Any) -> web.Response:
    return _json_response(msgspec.json.encode(data))


async def _admin_state(request: web.Request) -> web.Response:
    e = request.app[EMULATOR_KEY]
    return _ok(
        {
            "resourceVersion": str(e.resource_version),
            "pods": len(e.table(PODS).entries),
            "namespaces": len(e.table(NAMESPACES).entries),
            "watches": e.open_watch_count(),
            "requests": e.requests_served,
        }
    )


async def _admin_audit(request: web.Request) -> web.Response:
    e = request.app[EMULATOR_KEY]
    if request.method == "DELETE":
        e.audit.clear()
        return _ok({"cleared": True})
    entries = e.audit_log(
        method=request.query.get("method"), path_contains=request.query.get("path")
    )
    return _ok([a.to_dict() for a in entries])


async def _admin_requests(request: web.Request) -> web.Response:
    return _ok([r.to_dict() for r in request.app[EMULATOR_KEY].requests])


async def _admin_faults(request: web.Request) -> web.Response:
    e = request.app[EMULATOR_KEY]
    if request.method == "DELETE":
        e.clear_faults()
        return _ok({"cleared": True})
    b = await _admin_body(request)
    e.fail_next(
        int(b.get("count", 1)),
        code=int(b.get("code", 500)),
        method=b.get("method"),
        path_contains=b.get("path"),
        retry_after_s=b.get("retry_after_s"),
        query=b.get("query"),
    )
    return _ok({"ok": True})


async def _admin_latency(request: web.Request) -> web.Response:
    b = await _admin_body(request)
    request.app[EMULATOR_KEY].add_latency(
        float(b.get("delay_s", 0.0)),
        method=b.get("method"),
        path_contains=b.get("path"),
        count=b.get("count"),
    )
    return _ok({"ok": True})


async def _admin_drop_watches(request: web.Request) -> web.Response:
    b = await _admin_body(request)
    dropped = request.app[EMULATOR_KEY].drop_watches(abrupt=bool(b.get("abrupt", True)))
    return _ok({"dropped": dropped})


async def _admin_expire_watches(request: web.Request) -> web.Response:
    b = await _admin_body(request)
    request.app[EMULATOR_KEY].expire_next_watches(int(b.get("count", 1)))
    return _ok({"ok": True})


async def _admin_compact(request: web.Request) -> web.Response:
    request.app[EMULATOR_KEY].compact()
    return _ok({"ok": True})


async def _admin_bulk(request: web.Request) -> web.Response:
    b = await _admin_body(request)
    e = request.app[EMULATOR_KEY]
    started = time.perf_counter()
    created = e.bulk_create_pods(
        namespace=str(b.get("namespace", "default")),
        count=int(b.get("count", 0)),
        start=int(b.get("start", 0)),
        template=b.get("template"),
        name_prefix=str(b.get("name_prefix", "space-sbx-")),
        generation=int(b.get("generation", 1)),
        pod_kind=str(b.get("pod_kind", "create")),
    )
    return _ok(
        {
            "created": created,
            "resourceVersion": str(e.resource_version),
            "seconds": time.perf_counter() - started,
        }
    )


async def _admin_kubelet_finish(request: web.Request) -> web.Response:
    b = await _admin_body(request)
    done = request.app[EMULATOR_KEY].finish_terminating(b.get("namespace"), b.get("name"))
    return _ok({"finished": done})


async def _admin_watch_list(request: web.Request) -> web.Response:
    b = await _admin_body(request)
    e = request.app[EMULATOR_KEY]
    try:
        e.watch_list = WatchListSupport(str(b.get("support", e.watch_list)))
    except ValueError:
        return _error_response(st.bad_request(f"unknown support {b.get('support')!r}"))
    return _ok({"support": e.watch_list.value})


async def _admin_auth(request: web.Request) -> web.Response:
    auth = request.app[EMULATOR_KEY].auth
    if request.method == "POST":
        b = await _admin_body(request)
        if "enabled" in b:
            auth.enabled = bool(b["enabled"])
        if "token_file" in b:
            auth.token_file = Path(b["token_file"]) if b["token_file"] else None
        if "token_file_user" in b:
            auth.token_file_user = str(b["token_file_user"])
    return _ok(auth.to_dict())


async def _admin_issue_token(request: web.Request) -> web.Response:
    b = await _admin_body(request)
    user = str(b.get("user") or DEFAULT_USER)
    token = request.app[EMULATOR_KEY].auth.issue(user, b.get("token"))
    return _ok({"token": token, "user": user})


async def _admin_revoke_token(request: web.Request) -> web.Response:
    b = await _admin_body(request)
    return _ok({"revoked": request.app[EMULATOR_KEY].auth.revoke(str(b.get("token", "")))})


async def _admin_flow_control(request: web.Request) -> web.Response:
    e = request.app[EMULATOR_KEY]
    if request.method == "POST":
        b = await _admin_body(request)
        seats = b.get("seats")
        if not seats:
            if e.flow_control is not None:
                e.flow_control.release()
            e.flow_control = None
        else:
            users = b.get("users")
            if e.flow_control is not None:
                e.flow_control.release()
            e.flow_control = FlowControl(
                seats=int(seats),
                retry_after_s=int(b.get("retry_after_s", 1)),
                seat_time_s=float(b.get("seat_time_s", DEFAULT_SEAT_TIME_S)),
                users=[str(u) for u in users] if users is not None else None,
            )
    return _ok(e.flow_control.to_dict() if e.flow_control is not None else {"seats": None})


async def _admin_reset(request: web.Request) -> web.Response:
    request.app[EMULATOR_KEY].reset()
    return _ok({"ok": True})


def build_app(emulator: Emulator) -> web.Application:
    """The aiohttp application serving ``emulator``."""
    app = web.Application(middlewares=[_api_middleware], client_max_size=64 * 1024 * 1024)
    app[EMULATOR_KEY] = emulator
    admin = ADMIN_PREFIX.rstrip("/")
    app.router.add_get(f"{admin}/state", _admin_state)
    app.router.add_route("GET", f"{admin}/audit", _admin_audit)
    app.router.add_route("DELETE", f"{admin}/audit", _admin_audit)
    app.router.add_get(f"{admin}/requests", _admin_requests)
    app.router.add_route("POST", f"{admin}/faults", _admin_faults)
    app.router.add_route("DELETE", f"{admin}/faults", _admin_faults)
    app.router.add_post(f"{admin}/latency", _admin_latency)
    app.router.add_post(f"{admin}/watches/drop", _admin_drop_watches)
    app.router.add_post(f"{admin}/watches/expire-next", _admin_expire_watches)
    app.router.add_post(f"{admin}/compact", _admin_compact)
    app.router.add_post(f"{admin}/pods/bulk", _admin_bulk)
    app.router.add_post(f"{admin}/kubelet/finish", _admin_kubelet_finish)
    app.router.add_post(f"{admin}/watch-list", _admin_watch_list)
    app.router.add_post(f"{admin}/reset", _admin_reset)
    app.router.add_route("GET", f"{admin}/auth", _admin_auth)
    app.router.add_route("POST", f"{admin}/auth", _admin_auth)
    app.router.add_post(f"{admin}/tokens", _admin_issue_token)
    app.router.add_post(f"{admin}/tokens/revoke", _admin_revoke_token)
    app.router.add_route("GET", f"{admin}/flow-control", _admin_flow_control)
    app.router.add_route("POST", f"{admin}/flow-control", _admin_flow_control)
    app.router.add_get("/version", _version)
    app.router.add_get("/api", _api)
    app.router.add_get("/api/v1", _api_v1)
    app.router.add_get("/apis", _apis)
    app.router.add_get("/apis/{group}", _api_group)
    app.router.add_get("/apis/{group}/{version}", _api_group_version)
    app.router.add_routes(event_routes(lambda request: request.app[EMULATOR_KEY].events))
    app.router.add_route("*", "/{tail:.*}", _dispatch)
    return app


class RunningEmulator:
    """An emulator served over HTTP: ``url``, ``emulator`` and :meth:`aclose`."""

    def __init__(self, emulator: Emulator, runner: web.AppRunner, url: str) -> None:
        self.emulator = emulator
        self.url = url
        self._runner = runner

    async def aclose(self) -> None:
        self.emulator.drop_watches(abrupt=False)
        await self._runner.cleanup()

    async def __aenter__(self) -> RunningEmulator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def start_emulator(
    host: str = "127.0.0.1", port: int = 0, *, emulator: Emulator | None = None
) -> RunningEmulator:
    """Serve an emulator on ``host:port`` (0: a free port) until ``aclose()``."""
    emu = emulator if emulator is not None else Emulator()
    runner = web.AppRunner(
        build_app(emu),
        handle_signals=False,
        access_log=None,
        shutdown_timeout=1.0,
        handler_cancellation=True,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None
    sockets = getattr(server, "sockets", None) or []
    bound_port = sockets[0].getsockname()[1] if sockets else port
    return RunningEmulator(emu, runner, f"http://{host}:{bound_port}")
