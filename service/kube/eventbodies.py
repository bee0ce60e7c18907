"""The ``events.k8s.io/v1`` Events of the service's reports, regarding their pod: a ``Normal``
``RetiredPodDeleted`` or ``RetiredPodWouldDelete`` (dry run), a ``Warning`` ``RetiredPodKept``."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from service.ports import KeptReport, ReapReport

REPORTING_CONTROLLER = "space.sandbox/retired-pod-gc"
REASON_DELETED = "RetiredPodDeleted"
REASON_WOULD_DELETE = "RetiredPodWouldDelete"
REASON_KEPT = "RetiredPodKept"
_NOTE_MAX_BYTES = 1024
"""The API server rejects a longer ``note``."""
_INSTANCE_MAX = 128


def event_time(ts: float) -> str:
    """A ``MicroTime`` as the API server writes it."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _truncated(note: str) -> str:
    encoded = note.encode()
    if len(encoded) <= _NOTE_MAX_BYTES:
        return note
    return encoded[: _NOTE_MAX_BYTES - 3].decode("utf-8", "ignore") + "..."


def note_for(report: ReapReport) -> str:
    """What a person reading ``kubectl get events`` needs: what, why, for how long, and the
    preconditions the DELETE carried (or would have carried)."""
    pod = report.pod
    what = "Would delete (dry run)" if report.dry_run else "Deleted"
    return _truncated(
        f"{what} as {report.verdict}: {report.rule}. Reapable continuously for "
        f"{report.reapable_for_s:.0f}s; execution row state {report.row_state}, inactive. "
        f"Preconditions uid={pod.uid} resourceVersion={pod.resource_version}."
    )


def kept_note(report: KeptReport) -> str:
    """Why a retired pod is kept, the row's state, since when, and its runbook entry."""
    since = event_time(report.since_s)
    return _truncated(
        f"Execution retired ({report.row_state}, inactive) since {since} ({report.since_source}) "
        f"but the pod is kept: {report.reason}: {report.rule}. Kept for "
        f"{report.kept_for_s:.0f}s. Nothing will delete it: "
        f'docs/operations.md, "Retired but kept", {report.reason}.'
    )


def event_body(report: ReapReport | KeptReport, *, instance: str, at_s: float) -> dict[str, Any]:
    """The Event of ``report`` regarding its pod, named ``<pod>.<hex nanoseconds>`` as the API
    server requires (a ``generateName`` of ``<pod>.`` is rejected)."""
    if isinstance(report, KeptReport):
        action, reason, note, kind = "Keep", REASON_KEPT, kept_note(report), "Warning"
    else:
        action, note, kind = "Delete", note_for(report), "Normal"
        reason = REASON_WOULD_DELETE if report.dry_run else REASON_DELETED
    pod = report.pod
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {
            "name": f"{pod.name}.{int(at_s * 1e9):x}",
            "namespace": pod.namespace,
        },
        "eventTime": event_time(at_s),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": instance[:_INSTANCE_MAX],
        "action": action,
        "reason": reason,
        "regarding": {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": pod.namespace,
            "name": pod.name,
            "uid": pod.uid,
            "resourceVersion": pod.resource_version,
        },
        "note": note,
        "type": kind,
    }
