"""The emulator's fault injection (errors, latency) and its request and audit logs."""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from devtools.emulator import statuses as st
from devtools.emulator.statuses import ApiError


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


@dataclass(slots=True)
class RequestRecord:
    """One API request (method, path and query string parameters), recorded as it arrives, and
    when it was handled: after any injected latency, right before the emulator read or changed
    its state (0.0 until then), and the status it was answered with (0 until then)."""

    method: str
    path: str
    query: dict[str, str]
    time_s: float = 0.0
    status: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.path,
            "query": self.query,
            "time_s": self.time_s,
            "status": self.status,
        }


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


@dataclass
class Faults:
    rules: list[FaultRule] = field(default_factory=list)
    latency: list[LatencyRule] = field(default_factory=list)
    intercepts: list[Intercept] = field(default_factory=list)
    expire_watches: int = 0


@dataclass(slots=True)
class Intercept:
    """Another client's action, run when one matching request has arrived and right before it is
    handled: a test acts while the request is provably in flight, in the server's own step, so
    nothing depends on how soon the test's task runs (a request the test held and released
    itself would wait on that, and a loaded machine can make the client give up first)."""

    method: str | None
    path_contains: str | None
    action: Callable[[], object]


class FaultControls:
    """Fault rules and the logs of what the emulator received."""

    faults: Faults
    audit: list[AuditEntry]
    requests: deque[RequestRecord]

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

    def before_next(
        self,
        action: Callable[[], object],
        *,
        method: str | None = None,
        path_contains: str | None = None,
    ) -> None:
        """Run ``action()`` when the next matching request arrives, before it is handled."""
        self.faults.intercepts.append(
            Intercept(method.upper() if method else None, path_contains, action)
        )

    async def intercept(self, method: str, path: str) -> None:
        """The first pending intercept matching the request: run its action (once; awaited
        when it returns an awaitable)."""
        for i, icpt in enumerate(self.faults.intercepts):
            if (icpt.method is None or icpt.method == method) and (
                icpt.path_contains is None or icpt.path_contains in path
            ):
                del self.faults.intercepts[i]
                result = icpt.action()
                if inspect.isawaitable(result):
                    await result
                return

    def clear_faults(self) -> None:
        self.faults = Faults()

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
