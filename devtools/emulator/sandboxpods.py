"""Realistic sandbox pod objects, shaped like what a kubelet reports for each sandbox state.

Used to populate the emulator for the demo, the end-to-end scenarios, the fault campaigns and
the benchmarks. The objects mirror the captured API server bodies (labels, spec, conditions,
container states) so the decoder sees what it would see in a cluster.
"""

from __future__ import annotations

import enum
from typing import Any

SELECTOR_LABEL = ("app.kubernetes.io/managed-by", "space-sandbox")
T0 = "2026-11-29T20:00:00Z"


class Shape(enum.StrEnum):
    """The pod states a sandbox pod goes through, as far as this controller cares."""

    PENDING_STUCK = "pending_stuck"
    """Node-bound, no IP, PodReadyToStartContainers=False, container ContainerCreating."""
    PENDING_WITH_IP = "pending_with_ip"
    """RunPodSandbox succeeded (an IP), containers not started yet."""
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    """Every container terminated (an idle-suspended sandbox)."""
    FAILED = "failed"


def pod_name(sandbox_id: str, generation: int) -> str:
    return f"space-sbx-{sandbox_id}-g{generation}"


def _condition(kind: str, status: str) -> dict[str, Any]:
    return {"type": kind, "status": status, "lastProbeTime": None, "lastTransitionTime": T0}


def _container(state: dict[str, Any], *, ready: bool) -> dict[str, Any]:
    return {
        "name": "sandbox",
        "state": state,
        "lastState": {},
        "ready": ready,
        "restartCount": 0,
        "image": "registry.example/sandbox:1.0",
        "imageID": "",
        "started": ready,
    }


def pod_status(shape: Shape, *, ip: str = "10.0.0.10") -> dict[str, Any]:
    """The ``.status`` a kubelet would write for ``shape``."""
    started = shape in (Shape.PENDING_WITH_IP, Shape.RUNNING, Shape.SUCCEEDED, Shape.FAILED)
    running = shape is Shape.RUNNING
    conditions = [
        _condition("PodReadyToStartContainers", "True" if started and running else "False"),
        _condition("Initialized", "True"),
        _condition("Ready", "True" if running else "False"),
        _condition("ContainersReady", "True" if running else "False"),
        _condition("PodScheduled", "True"),
    ]
    if shape is Shape.PENDING_WITH_IP:
        conditions[0] = _condition("PodReadyToStartContainers", "True")
    status: dict[str, Any] = {
        "phase": {
            Shape.PENDING_STUCK: "Pending",
            Shape.PENDING_WITH_IP: "Pending",
            Shape.RUNNING: "Running",
            Shape.SUCCEEDED: "Succeeded",
            Shape.FAILED: "Failed",
        }[shape],
        "conditions": conditions,
        "hostIP": "192.0.2.1",
        "hostIPs": [{"ip": "192.0.2.1"}],
        "startTime": T0,
        "qosClass": "Burstable",
    }
    if started:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    if shape in (Shape.PENDING_STUCK, Shape.PENDING_WITH_IP):
        state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
    elif shape is Shape.RUNNING:
        state = {"running": {"startedAt": T0}}
    else:
        state = {
            "terminated": {
                "exitCode": 0 if shape is Shape.SUCCEEDED else 1,
                "reason": "Completed" if shape is Shape.SUCCEEDED else "Error",
                "startedAt": T0,
                "finishedAt": "2026-11-29T20:30:00Z",
            }
        }
    status["containerStatuses"] = [_container(state, ready=running)]
    return status


def sandbox_pod(
    *,
    sandbox_id: str,
    generation: int,
    kind: str = "create",
    shape: Shape = Shape.RUNNING,
    namespace: str = "sandboxes",
    node: str | None = "node-a",
) -> dict[str, Any]:
    """A complete pod object (metadata, spec, status) ready for ``Emulator.create_pod``."""
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "sandbox",
                "image": "registry.example/sandbox:1.0",
                "resources": {
                    "limits": {"cpu": "2", "memory": "2Gi"},
                    "requests": {"cpu": "1", "memory": "1Gi"},
                },
                "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "File",
                "imagePullPolicy": "IfNotPresent",
            }
        ],
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "runtimeClassName": "vm-shim",
        "schedulerName": "default-scheduler",
        "enableServiceLinks": True,
    }
    if node is not None:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(sandbox_id, generation),
            "namespace": namespace,
            "labels": {
                SELECTOR_LABEL[0]: SELECTOR_LABEL[1],
                "space.generation": str(generation),
                "space.pod-kind": kind,
                "space.sandbox-id": sandbox_id,
            },
        },
        "spec": spec,
        "status": pod_status(shape),
    }
