"""The real kubectl against the API emulator, for tests that run what an operator runs.

``kubectl_binary()`` is the kubectl ``make install`` puts in the virtualenv
(``devtools/kubectl.py``: the pinned official binary, kustomize built in); a missing or
different binary fails the test with the command that installs it.

Fixture ``kubectl_cluster`` (registered through ``pytest_plugins`` in ``tests/conftest.py``) yields
a :class:`KubectlCluster`: an emulator served over HTTP on 127.0.0.1 from a thread of its own (so a
synchronous test can block on a kubectl child process while the emulator answers it), the
namespace ``sandboxes`` created, and a kubeconfig whose current context names it::

    def test_get_pods(kubectl_cluster: KubectlCluster) -> None:
        kubectl_cluster.call(lambda emu: emu.create_pod(sandbox_pod(sandbox_id="a", generation=1)))
        out = kubectl_cluster.run("get", "pods", "-n", "sandboxes").stdout

``seed_lease(holder=...)`` creates the Lease ``retired-pod-gc`` in namespace ``retired-pod-gc`` as
a leader would. A child process of one's own (a doc block run by a shell) takes
``kubectl_cluster.env``: ``PATH`` with kubectl's directory first, ``KUBECONFIG``, and
``HOME``/``KUBECACHEDIR`` in a temporary directory, so nothing outside the test's directory is
read or written.
"""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from devtools.emulator import Emulator, RunningEmulator, start_emulator
from devtools.emulator.statuses import LEASES
from devtools.kubectl import KUBECTL_VERSION, is_installed
from tests.e2e.harness import write_kubeconfig

SANDBOX_NAMESPACE = "sandboxes"
T = TypeVar("T")


@functools.cache
def kubectl_binary() -> Path:
    """The pinned kubectl beside the virtualenv's python; fails the test when it is not there."""
    path = Path(sys.executable).parent / "kubectl"
    if not is_installed(path):
        pytest.fail(
            f"{path} is not the pinned kubectl {KUBECTL_VERSION}: run `make install`",
            pytrace=False,
        )
    return path


class _LoopThread:
    """An event loop running forever in a daemon thread, with a served emulator on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="kubectl-emulator", daemon=True
        )
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> T:
        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=60)

    def start(self) -> RunningEmulator:
        async def serve() -> RunningEmulator:
            emulator = Emulator()
            emulator.ensure_namespace(SANDBOX_NAMESPACE)
            return await start_emulator("127.0.0.1", 0, emulator=emulator)

        return asyncio.run_coroutine_threadsafe(serve(), self.loop).result(timeout=60)

    def stop(self, running: RunningEmulator | None) -> None:
        try:
            if running is not None:
                asyncio.run_coroutine_threadsafe(running.aclose(), self.loop).result(timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=60)
            self.loop.close()


@dataclass
class KubectlCluster:
    """The real kubectl, a kubeconfig, and the emulator it names (see the module docstring)."""

    kubectl: Path
    kubeconfig: Path
    url: str
    """The emulator's base URL (``http://127.0.0.1:PORT``)."""
    env: dict[str, str]
    _thread: _LoopThread
    _emulator: Emulator
    _seen: list[subprocess.CompletedProcess[str]] = field(default_factory=list)

    def call(self, fn: Callable[[Emulator], T]) -> T:
        """``fn(emulator)`` on the emulator's loop thread (seed pods, set statuses, read state)."""
        return self._thread.call(lambda: fn(self._emulator))

    def seed_lease(
        self, *, name: str = "retired-pod-gc", namespace: str = "retired-pod-gc", holder: str
    ) -> None:
        """A Lease held by ``holder`` (the controller's leader), its namespace created."""

        def create(emulator: Emulator) -> None:
            emulator.ensure_namespace(namespace)
            body = {
                "metadata": {"name": name},
                "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15},
            }
            emulator.create(LEASES, namespace, body)

        self.call(create)

    def run(
        self, *args: str, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``kubectl ARGS`` against the emulator; ``check``: fail the test on a non-zero exit."""
        result = subprocess.run(
            [str(self.kubectl), *args],
            env=self.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        self._seen.append(result)
        if check and result.returncode != 0:
            pytest.fail(
                f"kubectl {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}",
                pytrace=False,
            )
        return result


@pytest.fixture
def kubectl_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubectlCluster]:
    kubectl = kubectl_binary()
    home = tmp_path_factory.mktemp("kubectl-home")
    thread = _LoopThread()
    running: RunningEmulator | None = None
    try:
        running = thread.start()
        kubeconfig = write_kubeconfig(home / "kubeconfig", running.url)
        env = {
            "PATH": f"{kubectl.parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "HOME": str(home),
            "KUBECONFIG": str(kubeconfig),
            "KUBECACHEDIR": str(home / "cache"),
            "LANG": "C.UTF-8",
        }
        yield KubectlCluster(
            kubectl=kubectl,
            kubeconfig=kubeconfig,
            url=running.url,
            env=env,
            _thread=thread,
            _emulator=running.emulator,
        )
    finally:
        thread.stop(running)
