"""Debian's Prometheus and Alertmanager as child processes of a test, on 127.0.0.1, and the shipped
monitoring files they load (``make promtool alertmanager`` installs both servers)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from .harness import REPO_ROOT

MONITORING = REPO_ROOT / "deploy" / "monitoring"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
START_S = 60.0
"""Only a bound on a hung start."""


def shipped_alert_rules() -> list[dict[str, Any]]:
    """The alerting rules of deploy/monitoring/prometheusrule.yaml, every group's."""
    source = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text(encoding="utf-8"))
    return [rule for group in source["spec"]["groups"] for rule in group["rules"]]


def shipped_inhibit_rules() -> list[dict[str, Any]]:
    """The ``inhibit_rules`` of deploy/monitoring/alertmanager-inhibit.yaml, as shipped."""
    fragment = yaml.safe_load((MONITORING / "alertmanager-inhibit.yaml").read_text("utf-8"))
    rules: list[dict[str, Any]] = fragment["inhibit_rules"]
    return rules


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{what} exited with {proc.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not listen on {port} within {START_S:.0f}s")


@contextmanager
def server(command: list[str], log: Path, port: int, what: str) -> Iterator[None]:
    """``command`` running (its output in ``log``) once it listens on ``port``; stopped after."""
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_port(port, proc, what)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextmanager
def alertmanager(directory: Path, config: dict[str, Any], port: int) -> Iterator[str]:
    """Alertmanager with ``config`` (no cluster), its data and log under ``directory``: its URL."""
    assert Path(ALERTMANAGER).exists(), f"{ALERTMANAGER} is missing: make alertmanager"
    directory.mkdir()
    (directory / "alertmanager.yml").write_text(yaml.safe_dump(config))
    command = [
        ALERTMANAGER,
        f"--config.file={directory / 'alertmanager.yml'}",
        f"--storage.path={directory / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
    ]
    with server(command, directory / "alertmanager.log", port, "alertmanager"):
        yield f"http://127.0.0.1:{port}"


async def get_json(url: str) -> Any:
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as http, http.get(url) as response:
        assert response.status == 200, (url, response.status)
        return json.loads(await response.text())
