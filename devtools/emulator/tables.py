"""The Table form of pods and Events (``meta.k8s.io/v1`` ``Table``), what ``kubectl get`` asks for.

kubectl sends ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io,...`` and prints the cells it
gets back; a server that answers plain JSON leaves it with only NAME and AGE. The columns, their
descriptions and each cell follow the real server's pod printer (captured in
``tests/fixtures/wire/list-pods-table.json`` and ``get-pod-table.json``): Name, Ready, Status,
Restarts and Age, then the ``-o wide`` columns IP, Node, Nominated Node and Readiness Gates
(priority 1). ``includeObject`` (``None``, ``Metadata`` — the default — or ``Object``) chooses what
each row's ``object`` carries. A watch asked for as a Table (``kubectl get pods -w``) gets each
pod event's object as a one-row Table; BOOKMARK and ERROR events pass unchanged. Init containers
are not looked at (sandbox pods have none).

Events (``kubectl get events``, core/v1 or ``events.k8s.io``) get the real server's event printer:
LAST SEEN, TYPE, REASON, OBJECT, MESSAGE, then SUBOBJECT, SOURCE, FIRST SEEN, COUNT and NAME
with ``-o wide``. No capture of an Event Table exists among the wire samples: the cells follow
the printer's rules, the column descriptions are the API's field docs it uses.
"""

from __future__ import annotations

from typing import Any

import msgspec

from devtools.emulator.store import parse_time

TABLE_API_VERSION = "meta.k8s.io/v1"

_NAME = (
    "Name must be unique within a namespace. Is required when creating resources, although some "
    "resources may allow a client to request the generation of an appropriate name automatically. "
    "Name is primarily intended for creation idempotence and configuration definition. Cannot be "
    "updated. More info: "
    "https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names"
)
_AGE = (
    "CreationTimestamp is a timestamp representing the server time when this object was created. "
    "It is not guaranteed to be set in happens-before order across separate operations. Clients "
    "may not set this value. It is represented in RFC3339 form and is in UTC.\n\nPopulated by the "
    "system. Read-only. Null for lists. More info: "
    "https://git.k8s.io/community/contributors/devel/sig-architecture/api-conventions.md#metadata"
)
_NODE = (
    "NodeName indicates in which node this pod is scheduled. If empty, this pod is a candidate for "
    "scheduling by the scheduler defined in schedulerName. Once this field is set, the kubelet for "
    "this node becomes responsible for the lifecycle of this pod. This field should not be used to "
    "express a desire for the pod to be scheduled on a specific node. "
    "https://kubernetes.io/docs/concepts/scheduling-eviction/assign-pod-node/#nodename"
)
_NOMINATED = (
    "nominatedNodeName is set only when this pod preempts other pods on the node, but it cannot be "
    "scheduled right away as preemption victims receive their graceful termination periods. This "
    "field does not guarantee that the pod will be scheduled on this node. Scheduler may decide to "
    "place the pod elsewhere if other nodes become available sooner. Scheduler may also decide to "
    "give the resources on this node to a higher priority pod that is created after preemption. As "
    "a result, this field may be different than PodSpec.nodeName when the pod is scheduled."
)
_GATES = (
    "If specified, all readiness gates will be evaluated for pod readiness. A pod is ready when "
    "all its containers are ready AND all conditions specified in the readiness gates have status "
    'equal to "True" '
    "More info: https://git.k8s.io/enhancements/keps/sig-network/580-pod-readiness-gates"
)


def _column(name: str, description: str, *, priority: int = 0, fmt: str = "") -> dict[str, Any]:
    return {
        "name": name,
        "type": "string",
        "format": fmt,
        "description": description,
        "priority": priority,
    }


POD_COLUMNS: tuple[dict[str, Any], ...] = (
    _column("Name", _NAME, fmt="name"),
    _column("Ready", "The aggregate readiness state of this pod for accepting traffic."),
    _column("Status", "The aggregate status of the containers in this pod."),
    _column(
        "Restarts",
        "The number of times the containers in this pod have been restarted and when the last "
        "container in this pod has restarted.",
    ),
    _column("Age", _AGE),
    _column(
        "IP",
        "podIP address allocated to the pod. Routable at least within the cluster. Empty if not "
        "yet allocated.",
        priority=1,
    ),
    _column("Node", _NODE, priority=1),
    _column("Nominated Node", _NOMINATED, priority=1),
    _column("Readiness Gates", _GATES, priority=1),
)

_SUCCEEDED = {
    "type": "Completed",
    "status": "True",
    "reason": "Succeeded",
    "message": "The pod has completed successfully.",
}
_FAILED = {"type": "Completed", "status": "True", "reason": "Failed", "message": "The pod failed."}
INCLUDE_OBJECT = ("None", "Metadata", "Object")


def wants_table(accept: str) -> bool:
    """Whether an Accept header asks for a ``meta.k8s.io/v1`` Table (kubectl lists it first)."""
    for part in accept.split(","):
        params = {p.strip() for p in part.split(";")[1:]}
        if {"as=Table", "g=meta.k8s.io", "v=v1"} <= params:
            return True
    return False


def human_duration(seconds: float) -> str:
    """A duration as kubectl's AGE column writes it (``k8s.io/apimachinery`` ``HumanDuration``)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        rest = s % 60
        return f"{minutes}m" if rest == 0 else f"{minutes}m{rest}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        rest = minutes % 60
        return f"{hours}h" if rest == 0 else f"{hours}h{rest}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        rest = hours % 24
        return f"{hours // 24}d" if rest == 0 else f"{hours // 24}d{rest}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        rest = (hours // 24) % 365
        years = hours // 24 // 365
        return f"{years}y" if rest == 0 else f"{years}y{rest}d"
    return f"{hours // 24 // 365}y"


def _since(timestamp: Any, now_s: float) -> str:
    if not isinstance(timestamp, str) or not timestamp:
        return "<unknown>"
    return human_duration(now_s - parse_time(timestamp))


def _status_and_ready(pod: dict[str, Any]) -> tuple[str, int, int, str, list[dict[str, Any]]]:
    """(STATUS, ready containers, restarts, last restart time, row conditions), as the real
    printer derives them from phase, reason, container states and deletion."""
    status, meta = pod.get("status") or {}, pod.get("metadata") or {}
    phase = str(status.get("phase") or "")
    reason = str(status.get("reason") or "") or phase
    conditions = status.get("conditions") or []
    for condition in conditions:
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "SchedulingGated":
            reason = "SchedulingGated"
    row_conditions = {"Succeeded": [_SUCCEEDED], "Failed": [_FAILED]}.get(phase, [])
    ready = restarts = 0
    last_restart = ""
    has_running = False
    for container in reversed(status.get("containerStatuses") or []):
        restarts += int(container.get("restartCount") or 0)
        finished = ((container.get("lastState") or {}).get("terminated") or {}).get("finishedAt")
        if finished and finished > last_restart:
            last_restart = finished
        state = container.get("state") or {}
        waiting, terminated = state.get("waiting"), state.get("terminated")
        if waiting is not None and waiting.get("reason"):
            reason = waiting["reason"]
        elif terminated is not None and terminated.get("reason"):
            reason = terminated["reason"]
        elif terminated is not None:
            signal = terminated.get("signal") or 0
            reason = f"Signal:{signal}" if signal else f"ExitCode:{terminated.get('exitCode', 0)}"
        elif container.get("ready") and state.get("running") is not None:
            has_running = True
            ready += 1
    if reason == "Completed" and has_running:
        pod_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        reason = "Running" if pod_ready else "NotReady"
    if meta.get("deletionTimestamp"):
        if status.get("reason") == "NodeLost":
            reason = "Unknown"
        elif phase not in ("Succeeded", "Failed"):
            reason = "Terminating"
    return reason, ready, restarts, last_restart, row_conditions


def pod_row(pod: dict[str, Any], *, now_s: float, include_object: str) -> dict[str, Any]:
    """One Table row of ``pod`` (a full object without kind/apiVersion or with them)."""
    spec, status, meta = pod.get("spec") or {}, pod.get("status") or {}, pod.get("metadata") or {}
    reason, ready, restarts, last_restart, conditions = _status_and_ready(pod)
    restarts_cell = str(restarts)
    if restarts and last_restart:
        restarts_cell = f"{restarts} ({_since(last_restart, now_s)} ago)"
    pod_ips = status.get("podIPs") or []
    gates = spec.get("readinessGates") or []
    gates_cell = "<none>"
    if gates:
        by_type = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        true = sum(1 for g in gates if by_type.get(g.get("conditionType")) == "True")
        gates_cell = f"{true}/{len(gates)}"
    row: dict[str, Any] = {
        "cells": [
            meta.get("name", ""),
            f"{ready}/{len(spec.get('containers') or [])}",
            reason,
            restarts_cell,
            _since(meta.get("creationTimestamp"), now_s),
            (pod_ips[0].get("ip") if pod_ips else "") or "<none>",
            spec.get("nodeName") or "<none>",
            status.get("nominatedNodeName") or "<none>",
            gates_cell,
        ]
    }
    if conditions:
        row["conditions"] = conditions
    if include_object == "Metadata":
        row["object"] = {
            "kind": "PartialObjectMetadata",
            "apiVersion": TABLE_API_VERSION,
            "metadata": meta,
        }
    elif include_object == "Object":
        row["object"] = {"kind": "Pod", "apiVersion": "v1", **pod}
    else:
        row["object"] = None
    return row


def pod_table(
    pods: list[dict[str, Any]],
    *,
    list_meta: dict[str, Any],
    now_s: float,
    include_object: str = "Metadata",
) -> dict[str, Any]:
    """The Table answer for ``pods``; ``list_meta`` is the list's (or one object's)
    ``resourceVersion`` and, for a page of a list, ``continue`` and ``remainingItemCount``."""
    return {
        "kind": "Table",
        "apiVersion": TABLE_API_VERSION,
        "metadata": list_meta,
        "columnDefinitions": list(POD_COLUMNS),
        "rows": [pod_row(p, now_s=now_s, include_object=include_object) for p in pods],
    }


_POD_EVENTS = frozenset({"ADDED", "MODIFIED", "DELETED"})


def watch_line(line: bytes, *, now_s: float, include_object: str = "Metadata") -> bytes:
    """One watch event line with its pod as a one-row Table (other events unchanged)."""
    event = msgspec.json.decode(line)
    if event.get("type") not in _POD_EVENTS:
        return line
    pod = event["object"]
    list_meta = {"resourceVersion": (pod.get("metadata") or {}).get("resourceVersion", "")}
    table = pod_table([pod], list_meta=list_meta, now_s=now_s, include_object=include_object)
    return msgspec.json.encode({"type": event["type"], "object": table}) + b"\n"


_EVENT_NAME = _column("Name", _NAME, priority=1, fmt="name")
EVENT_COLUMNS: tuple[dict[str, Any], ...] = (
    _column(
        "Last Seen",
        "The time at which the most recent occurrence of this event was recorded.",
    ),
    _column("Type", "Type of this event (Normal, Warning), new types could be added in the future"),
    _column(
        "Reason",
        "This should be a short, machine understandable string that gives the reason for the "
        "transition into the object's current status.",
    ),
    _column("Object", "The object that this event is about."),
    _column(
        "Subobject",
        "If referring to a piece of an object instead of an entire object, this string should "
        "contain a valid JSON/Go field access statement, such as "
        "desiredState.manifest.containers[2]. For example, if the object reference is to a "
        'container within a pod, this would take on a value like: "spec.containers{name}" (where '
        '"name" refers to the name of the container that triggered the event) or if no container '
        'name is specified "spec.containers[2]" (container with index 2 in this pod). This syntax '
        "is chosen only to have some well-defined way of referencing a part of an object.",
        priority=1,
    ),
    _column(
        "Source",
        "The component reporting this event. Should be a short machine understandable string.",
        priority=1,
    ),
    _column("Message", "A human-readable description of the status of this operation."),
    _column(
        "First Seen",
        "The time at which the event was first recorded. (Time of server receipt is in TypeMeta.)",
        priority=1,
    ),
    _column("Count", "The number of times this event has occurred.", priority=1),
    _EVENT_NAME,
)


def _micro_since(timestamp: Any, now_s: float) -> str:
    """``translateMicroTimestampSince``: a MicroTime (``...:35.000000Z``) as an AGE."""
    if not isinstance(timestamp, str) or not timestamp:
        return "<unknown>"
    whole = timestamp.split(".", 1)[0].removesuffix("Z") + "Z"
    return _since(whole, now_s)


def event_row(event: dict[str, Any], *, now_s: float) -> dict[str, Any]:
    """One row of a core/v1-shaped Event, as the real server's event printer writes it."""
    first = _since(event.get("firstTimestamp"), now_s)
    if not event.get("firstTimestamp"):
        first = _micro_since(event.get("eventTime"), now_s)
    last = _since(event.get("lastTimestamp"), now_s) if event.get("lastTimestamp") else first
    count = int(event.get("count") or 0)
    series = event.get("series")
    if series is not None:
        last = _micro_since(series.get("lastObservedTime"), now_s)
        count = int(series.get("count") or 0)
    elif count == 0:
        count = 1  # a singleton Event of the events.k8s.io API carries no count
    regarding = event.get("involvedObject") or {}
    kind = str(regarding.get("kind") or "").lower()
    target = f"{kind}/{regarding['name']}" if regarding.get("name") else kind
    source = event.get("source") or {}
    component = source.get("component") or event.get("reportingComponent") or ""
    instance = source.get("host") or event.get("reportingInstance") or ""
    meta = event.get("metadata") or {}
    return {
        "cells": [
            last,
            event.get("type", ""),
            event.get("reason", ""),
            target,
            regarding.get("fieldPath", ""),
            f"{component}, {instance}" if instance else component,
            str(event.get("message") or "").strip(),
            first,
            count,
            meta.get("name", ""),
        ],
        "object": {
            "kind": "PartialObjectMetadata",
            "apiVersion": TABLE_API_VERSION,
            "metadata": meta,
        },
    }


def event_table(
    events: list[dict[str, Any]], *, list_meta: dict[str, Any], now_s: float
) -> dict[str, Any]:
    """The Table answer for core/v1-shaped ``events``."""
    return {
        "kind": "Table",
        "apiVersion": TABLE_API_VERSION,
        "metadata": list_meta,
        "columnDefinitions": list(EVENT_COLUMNS),
        "rows": [event_row(e, now_s=now_s) for e in events],
    }
