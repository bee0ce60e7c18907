"""The watch decoder: one line of a watch response → one typed event, or a line skipped (counted
and logged), never an exception."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from service.kube.decode import PodDecoder
from service.kube.watchstream import (
    SKIPPED,
    Bookmark,
    ErrorStatus,
    PodChange,
    Unreadable,
    WatchDecoder,
)
from service.metrics import KubeMetrics
from tests.kubefixtures import SANDBOX_NAMESPACE, sandbox_pod

NS = SANDBOX_NAMESPACE


def line(kind: str, obj: object) -> bytes:
    return msgspec.json.encode({"type": kind, "object": obj}) + b"\n"


def pod(name: str = "a") -> dict[str, Any]:
    body = sandbox_pod(name)
    body["metadata"].update({"namespace": NS, "uid": f"uid-{name}", "resourceVersion": "7"})
    return body


def decoder() -> tuple[WatchDecoder, KubeMetrics]:
    metrics = KubeMetrics(CollectorRegistry())
    return WatchDecoder(PodDecoder(), metrics), metrics


def count(metrics: KubeMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("kind", ["ADDED", "MODIFIED", "DELETED"])
def test_a_change_decodes_to_its_pod_and_whether_it_was_deleted(kind: str) -> None:
    watch, metrics = decoder()
    event = watch.decode(line(kind, pod()))
    assert isinstance(event, PodChange)
    assert (event.pod.name, event.pod.resource_version) == ("space-sbx-a-g1", "7")
    assert event.deleted is (kind == "DELETED")
    assert count(metrics, "retired_pod_gc_watch_events_total", type=kind) == 1


def test_a_change_whose_pod_does_not_decode_names_the_pod_when_it_can() -> None:
    watch, metrics = decoder()
    unreadable = {"metadata": {"namespace": NS, "name": "p"}}  # no uid, no resourceVersion
    assert watch.decode(line("MODIFIED", unreadable)) == Unreadable(f"{NS}/p")
    assert watch.decode(line("ADDED", {"metadata": {"name": 3}})) == Unreadable(None)
    assert count(metrics, "retired_pod_gc_decode_errors_total", source="watch") == 2


def test_bookmarks_carry_their_version_and_whether_they_end_the_initial_events() -> None:
    watch, _ = decoder()
    periodic = {"metadata": {"resourceVersion": "9"}}
    end = {
        "metadata": {"resourceVersion": "9", "annotations": {"k8s.io/initial-events-end": "true"}}
    }
    assert watch.decode(line("BOOKMARK", periodic)) == Bookmark("9", False)
    assert watch.decode(line("BOOKMARK", end)) == Bookmark("9", True)


def test_an_error_event_carries_its_status_and_500_when_it_has_none() -> None:
    watch, _ = decoder()
    gone = {"kind": "Status", "code": 410, "message": "too old", "reason": "Expired"}
    assert watch.decode(line("ERROR", gone)) == ErrorStatus(410, "too old")
    assert watch.decode(line("ERROR", {"reason": "InternalError"})) == ErrorStatus(
        500, "InternalError"
    )
    assert watch.decode(line("ERROR", [1])) == ErrorStatus(500, "undecodable ERROR event")


@pytest.mark.parametrize(
    "raw",
    [b"not json\n", b'{"type": "ADDED"}\n', line("SURPRISE", {}), line("BOOKMARK", [1])],
)
def test_a_line_that_cannot_be_used_is_skipped_and_counted(raw: bytes) -> None:
    watch, metrics = decoder()
    assert watch.decode(raw) is SKIPPED
    assert count(metrics, "retired_pod_gc_decode_errors_total", source="watch") == 1
