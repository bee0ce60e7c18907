"""Fixtures of the deployment tests: rendered kustomizations and the service's metric names.

Nothing here needs a cluster, a container engine or the network: kustomizations are rendered by
the real ``kubectl kustomize`` (``tests/deploy/rendering.py``) and metric names are scraped from a
running service process.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

from devtools.pg.throwaway import run_async
from service.pg.migrate import DEFAULT_CHANNEL, migrate
from tests.deploy.rendering import Obj, render
from tests.deploy.support import BASE, MONITORING, OVERLAYS, ExportedMetrics
from tests.e2e.harness import base_env, cli_command, free_port, write_kubeconfig
from tests.pgfixtures import PgServer


@pytest.fixture(scope="session")
def exported_metric_names(
    pg_server: PgServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ExportedMetrics]:
    """Every series name a running service exports, with the label values of its samples.

    A real ``retired-pod-gc run`` process (live mode, so every code path registers its series)
    against the API emulator (its own process) and a fresh database; ``GET /metrics`` once it is
    ready. The one place that decides where the exposition comes from.
    """
    tmp = tmp_path_factory.mktemp("metrics-instance")
    db_url = pg_server.create_database("rpg_deploy_metrics")
    emu_port, metrics_port = free_port(), free_port()
    procs = []
    try:
        procs.append(
            subprocess.Popen(
                [
                    *(sys.executable, "-m", "devtools.emulator"),
                    *("--port", str(emu_port), "--namespace", "sandboxes"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        run_async(lambda: _migrate(db_url))
        env = base_env(
            kubeconfig=write_kubeconfig(tmp / "kubeconfig", f"http://127.0.0.1:{emu_port}"),
            database_url=db_url,
            ENABLED=True,
            DRY_RUN=False,
            LEADER_ELECTION=False,
            METRICS_BIND_ADDRESS=f"127.0.0.1:{metrics_port}",
        )
        with (tmp / "service.log").open("wb") as log:
            procs.append(
                subprocess.Popen(cli_command("run"), env=env, stdout=log, stderr=subprocess.STDOUT)
            )
        base = f"http://127.0.0.1:{metrics_port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/readyz", timeout=2) as ready:
                    if ready.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or procs[-1].poll() is not None:
                raise AssertionError(
                    "the service never became ready: " + (tmp / "service.log").read_text()[-2000:]
                )
            time.sleep(0.2)
        with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
            yield ExportedMetrics(response.read().decode("utf-8"))
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        pg_server.drop_database("rpg_deploy_metrics")


async def _migrate(url: str) -> None:
    await migrate(url, channel=DEFAULT_CHANNEL, with_schema=True)


@pytest.fixture(scope="session")
def base_objects() -> list[Obj]:
    return render(BASE)


@pytest.fixture(scope="session")
def overlay_objects() -> dict[str, list[Obj]]:
    return {name: render(path) for name, path in OVERLAYS.items()}


@pytest.fixture(scope="session")
def monitoring_objects() -> list[Obj]:
    return render(MONITORING)
