"""Fixtures of the deployment tests: rendered kustomizations and the service's metric names.

Nothing here needs a cluster, a container engine or the network: kustomizations are rendered by
``tests/deploy/kustomize.py`` and metric names come from the service's own exposition.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from service.metrics import Metrics
from tests.deploy.kustomize import Obj, render
from tests.deploy.support import BASE, MONITORING, OVERLAYS, ExportedMetrics


@pytest.fixture(scope="session")
def exported_metric_names() -> ExportedMetrics:
    """Every series name the service exports, with the label values of its samples.

    The one place that decides where the exposition comes from. For now: a fresh ``Metrics``
    registry rendered by ``generate_latest``. To check a running instance instead, return
    ``ExportedMetrics(<text of GET /metrics>)`` here; every test follows.
    """
    text = generate_latest(Metrics(CollectorRegistry()).registry).decode("utf-8")
    return ExportedMetrics(text)


@pytest.fixture(scope="session")
def base_objects() -> list[Obj]:
    return render(BASE)


@pytest.fixture(scope="session")
def overlay_objects() -> dict[str, list[Obj]]:
    return {name: render(path) for name, path in OVERLAYS.items()}


@pytest.fixture(scope="session")
def monitoring_objects() -> list[Obj]:
    return render(MONITORING)
