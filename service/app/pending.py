"""The live view of the observation clocks: ``GET /debug/pending`` and its readers.

The service answers with :func:`pending_view`; ``retired-pod-gc pending`` and ``explain --url``
fetch it (:func:`fetch_pending`) and print it. Every answer shows the same times (a wall-clock
step after the first request is not followed).
"""

from __future__ import annotations

import functools
import heapq
import time
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import aiohttp

from service.domain import Waiting
from service.engine.kept.view import KeptPods
from service.engine.observation import ObservationClocks
from service.kit import clock

PATH = "/debug/pending"
DEFAULT_LIMIT = 1000
"""Entries in one answer unless ``?limit=`` says otherwise: 100k would hold the loop for seconds."""


def utc(ts: float, *, fraction: bool = True) -> str:
    """Unix time ``ts`` as ISO 8601 in UTC (with microseconds when ``fraction``)."""
    text = datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return text if fraction else text[:-8] + "Z"


def pending_document(
    *,
    clocks: ObservationClocks,
    threshold_s: float,
    mode: str,
    active: bool,
    now_s: float,
    wall_offset_s: float,
    limit: int = DEFAULT_LIMIT,
    key: str | None = None,
) -> dict[str, Any]:
    """The running clocks, soonest due first, at most ``limit`` of them (``count`` says how many
    run); with ``key``, only that pod's. ``wall_offset_s`` maps ``now_s`` onto Unix time."""
    if key is not None:
        uid = clocks.uid_for(key)
        running = clocks.running_uid(uid) if uid is not None else []
    else:
        # Every clock has the same threshold: the soonest started is the soonest due.
        running = heapq.nsmallest(
            limit, clocks.running(), key=lambda entry: (entry[0].since_s, entry[0].key)
        )
    pods = []
    for observation, waiting in running:
        due_s = observation.since_s + threshold_s
        if now_s < due_s:
            waits_for = Waiting.THRESHOLD
        elif mode == "dry_run" and clocks.was_reported(observation.uid):
            waits_for = Waiting.REPORTED
        else:
            waits_for = waiting if waiting is not None else Waiting.VERIFICATION
        pods.append(
            {
                "key": observation.key,
                "uid": observation.uid,
                "verdict": str(observation.verdict),
                "observed_since": utc(observation.since_s + wall_offset_s),
                "due_at": utc(due_s + wall_offset_s),
                "observed_for_s": round(now_s - observation.since_s, 3),
                "due_in_s": round(max(0.0, due_s - now_s), 3),
                "waits_for": str(waits_for),
            }
        )
    return {
        "mode": mode,
        "active": active,
        "threshold_s": threshold_s,
        "now": utc(now_s + wall_offset_s),
        "count": len(clocks),
        "shown": len(pods),
        "pods": pods,
    }


def pending_view(
    *,
    clocks: ObservationClocks,
    kept: KeptPods | None,
    threshold_s: float,
    mode: str,
    active: Callable[[], bool],
) -> Callable[[int, str | None], dict[str, Any]]:
    """The service's ``GET /debug/pending`` answer for a limit and a key, with the retired-but-kept
    section when ``kept`` is given; the loop's clock mapped onto UTC once, at the first request."""
    wall_offset = functools.cache(lambda: time.time() - clock.now())  # noqa: TID251 (UTC)

    def view(limit: int, key: str | None) -> dict[str, Any]:
        wall_offset_s, now_s = wall_offset(), clock.now()
        document = pending_document(
            clocks=clocks,
            threshold_s=threshold_s,
            mode=mode,
            active=active(),
            now_s=now_s,
            wall_offset_s=wall_offset_s,
            limit=limit,
            key=key,
        )
        if kept is not None:
            document["retired_kept"] = kept_section(
                kept, now_s=now_s, wall_offset_s=wall_offset_s, limit=limit, key=key
            )
        return document

    return view


def kept_section(
    kept: KeptPods,
    *,
    now_s: float,
    wall_offset_s: float,
    limit: int = DEFAULT_LIMIT,
    key: str | None = None,
) -> dict[str, Any]:
    """The document's ``retired_kept`` section (``service/engine/kept/``): the longest kept
    first, at most ``limit``; with ``key``, only that pod's."""
    every = kept.kept()
    shown = every[:limit] if key is None else [k for k in [kept.get(key)] if k is not None]
    return {
        "active": kept.active,
        "bound_s": kept.bound_s,
        "sweep_period_s": kept.period_s,
        "count": len(kept),
        "by_reason": dict(sorted(Counter(str(k.reason) for k in every).items())),
        "shown": len(shown),
        "pods": [
            {
                "key": k.key,
                "uid": k.uid,
                "reason": str(k.reason),
                "severity": k.severity,
                "row_state": str(k.row_state),
                "since": utc(k.since_s + wall_offset_s),
                "since_source": str(k.source),
                "kept_for_s": round(now_s - k.since_s, 3),
                "rule": k.rule,
            }
            for k in shown
        ],
    }


_KEPT_COLUMNS = tuple(
    zip(
        ("KEY", "REASON", "SEVERITY", "ROW STATE", "SINCE", "FROM", "KEPT FOR"),
        ("key", "reason", "severity", "row_state", "since", "since_source", "kept_for_s"),
        strict=True,
    )
)
_COLUMNS = tuple(
    zip(
        ("KEY", "UID", "VERDICT", "OBSERVED SINCE", "DUE AT", "DUE IN", "WAITS FOR"),
        ("key", "uid", "verdict", "observed_since", "due_at", "due_in_s", "waits_for"),
        strict=True,
    )
)
_SECONDS_FORMAT = {"kept_for_s": ".0f", "due_in_s": ".1f"}
"""The fields printed as seconds, and their precision; every other field is printed as is."""


def _table(columns: tuple[tuple[str, str], ...], entries: list[Mapping[str, Any]]) -> list[str]:
    """One row per entry under a header line, each column (a heading and the entry's field) as
    wide as its widest cell; nothing when there are no entries."""
    rows = [tuple(_cell(entry, field) for _, field in columns) for entry in entries]
    if not rows:
        return []
    header = tuple(heading for heading, _ in columns)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]


def _cell(entry: Mapping[str, Any], field: str) -> str:
    spec = _SECONDS_FORMAT.get(field)
    value = entry.get(field)
    return str(value) if spec is None else f"{float(value or 0):{spec}}s"


def _partly(section: Mapping[str, Any], which: str) -> str:
    """The heading's note when not every entry is shown."""
    shown = section.get("shown")
    return "" if shown == section.get("count") else f", the {shown} {which} shown"


def _entry(section: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    return next((p for p in section.get("pods") or [] if p.get("key") == key), None)


def kept_lines(section: Mapping[str, Any] | None) -> list[str]:
    """The ``retired_kept`` section as a table of its own (nothing when the service has none)."""
    if not isinstance(section, Mapping):
        return []
    heading = (
        f"retired but kept: {section.get('count')} pods whose execution is retired but that "
        f"are kept (bound {section.get('bound_s')}s{_partly(section, 'longest kept')})"
    )
    return [heading, *_table(_KEPT_COLUMNS, section.get("pods") or [])]


def live_kept_lines(
    key: str, url: str | None, document: Mapping[str, Any] | str | None
) -> list[str]:
    """``explain``'s line on the running replica's retired-but-kept view of one pod."""
    section = document.get("retired_kept") if isinstance(document, Mapping) else None
    if url is None or not isinstance(section, Mapping):
        return []
    entry = _entry(section, key)
    if entry is None:
        return [f"retired but kept ({url}): not reported for this pod"]
    return [
        f"retired but kept ({url}): {entry.get('reason')} (severity {entry.get('severity')}), "
        f"row {entry.get('row_state')} since {entry.get('since')} ({entry.get('since_source')}), "
        f"kept for {float(entry.get('kept_for_s') or 0):.0f}s"
    ]


class PendingUnavailable(Exception):
    """The service could not be asked (no answer, the view off, an unexpected answer)."""


async def fetch_pending(
    url: str, *, timeout_s: float, limit: int | None = None, key: str | None = None
) -> dict[str, Any]:
    """``GET {url}/debug/pending``; raises :class:`PendingUnavailable` with a printable reason."""
    target = url.rstrip("/") + PATH
    asked = {"limit": None if limit is None else str(limit), "key": key}
    params = {name: value for name, value in asked.items() if value is not None}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.get(target, params=params) as response,
        ):
            if response.status == 404:
                raise PendingUnavailable(
                    f"{target} answered 404: the service does not serve the live view there "
                    "(set SPACE_RETIRED_EXECUTION_POD_GC_DEBUG_PENDING=true, and ask its debug "
                    "listener, DEBUG_BIND_ADDRESS, never the metrics port)"
                )
            if response.status != 200:
                raise PendingUnavailable(f"{target} answered {response.status}")
            document = await response.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise PendingUnavailable(
            f"could not reach {target}: {type(exc).__name__}: {exc}".rstrip(": ")
            + "; is a port-forward to the leader's pod running (retired-pod-gc pending --help)?"
        ) from None
    if not isinstance(document, dict) or not isinstance(document.get("pods"), list):
        raise PendingUnavailable(f"{target} did not answer a pending document")
    return document


def pending_lines(document: Mapping[str, Any]) -> list[str]:
    """The document as a table, with a header line naming the mode and threshold; then, after a
    blank line, the retired-but-kept section's (:func:`kept_lines`) when the document has one."""
    heading = (
        f"mode {document.get('mode')}, active {str(document.get('active')).lower()}, "
        f"threshold {document.get('threshold_s')}s, at {document.get('now')}: "
        f"{document.get('count')} pods with a running clock{_partly(document, 'soonest due')}"
    )
    lines = [heading, *_table(_COLUMNS, document.get("pods") or [])]
    kept = kept_lines(document.get("retired_kept"))
    return [*lines, "", *kept] if kept else lines


def live_clock_lines(
    key: str, url: str | None, document: Mapping[str, Any] | str | None
) -> list[str]:
    """``explain``'s live-clock lines: ``document`` is the fetched view, or the reason it could
    not be fetched (a string), or ``None`` when no URL was given."""
    if url is None:
        return [
            "live clock: not asked (--url http://127.0.0.1:PORT asks a running replica, "
            "e.g. through kubectl port-forward)"
        ]
    if isinstance(document, str) or document is None:
        return [f"live clock: unknown, {document or 'no answer'}"]
    entry = _entry(document, key)
    if entry is None:
        return [
            f"live clock ({url}): none runs for this pod (mode {document.get('mode')}, "
            f"active {str(document.get('active')).lower()})"
        ]
    return [
        f"live clock ({url}): uid {entry.get('uid')} {entry.get('verdict')}, observed since "
        f"{entry.get('observed_since')}, due at {entry.get('due_at')} "
        f"(in {float(entry.get('due_in_s') or 0):.1f}s), waits for {entry.get('waits_for')}"
    ]
