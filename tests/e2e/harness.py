"""End-to-end harness: the service as a real subprocess (``python -m service.cli``).

The emulator runs in the test's own event loop (so a test reads its audit log and leases
directly); each service process gets a kubeconfig file pointing at the emulator's URL, an
explicit environment (nothing inherited but PATH and HOME), a free port for ``/metrics``, and
its stderr (JSON log lines) captured to a file whose tail is shown when a test fails.

Also used by the CLI integration tests (``run_cli``), which run the other commands the same way.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio

from devtools import demo
from devtools.emulator import Emulator
from devtools.emulator.statuses import LEASES
from service.config import PREFIX
from service.domain import Verdict

REPO_ROOT = Path(__file__).resolve().parents[2]
SANDBOX_NAMESPACE = "sandboxes"
LEASE_NAMESPACE = "retired-pod-gc"
LEASE_NAME = "retired-pod-gc"
LOOP = "retired_execution_pod_gc"


def free_port() -> int:
    """A port that was free a moment ago (the kernel does not hand it out again at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def closed_port() -> int:
    """A local port nobody listens on: connecting to it is refused at once."""
    return free_port()


class SilentServer:
    """A loopback TCP server that accepts every connection and never sends a byte: a database
    (or any server) that never answers. ``accepted`` is set once a client got through."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = int(self._sock.getsockname()[1])
        self.accepted = threading.Event()
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, name="silent-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self._held.append(conn)  # held open, never read from nor written to
            self.accepted.set()

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)
        for conn in self._held:
            conn.close()

    def __enter__(self) -> SilentServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_kubeconfig(path: Path, server_url: str, namespace: str = SANDBOX_NAMESPACE) -> Path:
    """A minimal kubeconfig whose current context names ``server_url`` and ``namespace`` (the
    emulator accepts any token)."""
    path.write_text(
        "\n".join(
            [
                "apiVersion: v1",
                "kind: Config",
                "clusters:",
                "- name: emulator",
                "  cluster:",
                f"    server: {server_url}",
                "users:",
                "- name: tester",
                "  user:",
                "    token: not-a-secret",
                "contexts:",
                "- name: emulator",
                "  context:",
                "    cluster: emulator",
                "    user: tester",
                f"    namespace: {namespace}",
                "current-context: emulator",
                "",
            ]
        )
    )
    return path


def base_env(*, kubeconfig: Path, database_url: str, **settings: object) -> dict[str, str]:
    """The explicit environment of a child process: PATH, HOME, KUBECONFIG and our variables
    (keyword names are variable suffixes, e.g. ``THRESHOLD_SECONDS=3``)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "KUBECONFIG": str(kubeconfig),
        # Never let a developer's in-cluster variables leak into the child.
        PREFIX + "DATABASE_URL": database_url,
        PREFIX + "NAMESPACE": SANDBOX_NAMESPACE,
        PREFIX + "LEASE_NAMESPACE": LEASE_NAMESPACE,
        PREFIX + "LOG_FORMAT": "json",
    }
    for suffix, value in settings.items():
        env[PREFIX + suffix] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "service.cli", *args]


# A command run as PID 1 of a new PID namespace, as in a container (the tests run as root).
# unshare forwards no signal: signal its child (:func:`child_of`), it exits with the child's
# status.
AS_PID1 = ("unshare", "--pid", "--fork", "--kill-child", "--")


def child_of(pid: int, *, timeout_s: float = 60.0) -> int:
    """The one child of ``pid`` (``unshare --fork``'s command), once it exists."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except FileNotFoundError:
            children = []
        if children:
            (child,) = children
            return int(child)
        time.sleep(0.01)
    raise AssertionError(f"{pid} started no child within {timeout_s}s")


@dataclass(frozen=True, slots=True)
class CliResult:
    code: int
    stdout: str
    stderr: str


def run_cli(*args: str, env: Mapping[str, str], timeout_s: float = 30.0) -> CliResult:
    """Run one CLI command to completion (blocking; call it from a worker thread in async tests)."""
    done = subprocess.run(
        cli_command(*args),
        env=dict(env),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    return CliResult(done.returncode, done.stdout, done.stderr)


async def run_cli_async(*args: str, env: Mapping[str, str], timeout_s: float = 30.0) -> CliResult:
    return await anyio.to_thread.run_sync(lambda: run_cli(*args, env=env, timeout_s=timeout_s))


# --------------------------------------------------------------------------- metrics text

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition as (name, labels, value)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def sample(text: str, name: str, **labels: str) -> float:
    """One sample's value (0 when absent)."""
    for n, ls, value in parse_metrics(text):
        if n == name and all(ls.get(k) == v for k, v in labels.items()):
            return value
    return 0.0


def outcomes(text: str, *, mode: str, reaped_only: bool = True) -> dict[str, int]:
    """Non-zero ``cluster_reconciler_outcome_total`` counters of ``mode`` by verdict (only the
    two reapable shapes unless ``reaped_only`` is false)."""
    shapes = {str(v) for v in Verdict}
    out: dict[str, int] = {}
    for n, ls, value in parse_metrics(text):
        if (
            n == "cluster_reconciler_outcome_total"
            and ls.get("loop") == LOOP
            and ls.get("mode") == mode
            and value
            and (not reaped_only or ls.get("verdict") in shapes)
        ):
            out[ls["verdict"]] = int(value)
    return out


# ------------------------------------------------------------------------- service process


@dataclass
class ServiceProcess:
    """One ``retired-pod-gc run`` child process."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    debug_port: int
    """DEBUG_BIND_ADDRESS's port (127.0.0.1): ``/debug/*`` is served there, never on ``port``."""
    started_at: float
    stopped: bool = field(default=False)
    signal_pid: int | None = (
        None  # under unshare (``as_pid1``): the command, PID 1 of its namespace
    )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def debug_url(self) -> str:
        """The debug listener (``/debug/pending`` with ``DEBUG_PENDING``)."""
        return f"http://127.0.0.1:{self.debug_port}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    async def get(
        self, path: str, *, timeout_s: float = 3.0, debug: bool = False
    ) -> tuple[int, str]:
        """(status, body) of GET ``path`` on the metrics port (``debug``: on the debug
        listener); (0, error) when the server does not answer."""
        base = self.debug_url if debug else self.base_url
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
                session.get(base + path) as response,
            ):
                return response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return 0, f"{type(exc).__name__}: {exc}"

    async def metrics(self) -> str:
        status, body = await self.get("/metrics")
        assert status == 200, f"{self.name}: /metrics answered {status}: {body}"
        return body

    async def wait_for(
        self, path: str, status: int, *, timeout_s: float = 15.0, interval_s: float = 0.1
    ) -> float:
        """Poll ``path`` until it answers ``status``; returns seconds since process start."""
        deadline = time.monotonic() + timeout_s
        last: tuple[int, str] = (0, "")
        while time.monotonic() < deadline:
            self.assert_running()
            last = await self.get(path)
            if last[0] == status:
                return time.monotonic() - self.started_at
            await anyio.sleep(interval_s)
        raise AssertionError(
            f"{self.name}: {path} never answered {status} within {timeout_s}s "
            f"(last: {last}); log tail:\n{self.log_tail()}"
        )

    def assert_running(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise AssertionError(
                f"{self.name} exited with {code} unexpectedly; log tail:\n{self.log_tail()}"
            )

    async def wait_exit(self, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                return code
            await anyio.sleep(0.05)
        return self.proc.poll()

    async def terminate(
        self, *, timeout_s: float, signum: signal.Signals = signal.SIGTERM
    ) -> tuple[int | None, float]:
        """SIGTERM (or ``signum``); (exit code or None if still running after ``timeout_s``,
        seconds taken)."""
        started = time.monotonic()
        if self.signal_pid is None:
            self.proc.send_signal(signum)
        else:
            os.kill(self.signal_pid, signum)
        code = await self.wait_exit(timeout_s)
        self.stopped = code is not None
        return code, time.monotonic() - started

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.stopped = True


class ServiceLauncher:
    """Starts service processes for one test and kills every one still running at the end."""

    def __init__(self, *, tmp_path: Path, emulator_url: str, database_url: str) -> None:
        self.tmp_path = tmp_path
        self.kubeconfig = write_kubeconfig(tmp_path / "kubeconfig.yaml", emulator_url)
        self.database_url = database_url
        self.processes: list[ServiceProcess] = []

    def env(self, **settings: object) -> dict[str, str]:
        return base_env(kubeconfig=self.kubeconfig, database_url=self.database_url, **settings)

    def start(
        self,
        name: str,
        *,
        database_url: str | None = None,
        as_pid1: bool = False,
        **settings: object,
    ) -> ServiceProcess:
        port, debug_port = free_port(), free_port()
        values: dict[str, object] = {
            "METRICS_BIND_ADDRESS": f"127.0.0.1:{port}",
            "DEBUG_BIND_ADDRESS": f"127.0.0.1:{debug_port}",
            "LEADER_IDENTITY": name,
            "LEASE_DURATION_SECONDS": 3,
            "RENEW_DEADLINE_SECONDS": 2,
            "RETRY_PERIOD_SECONDS": 0.3,
            "LISTENER_HEARTBEAT_SECONDS": 1,
            "SHUTDOWN_TIMEOUT_SECONDS": 5,
            "API_TIMEOUT_SECONDS": 3,
            "LOG_LEVEL": "info",
        }
        values.update(settings)
        env = self.env(**values)
        if database_url is not None:
            env[PREFIX + "DATABASE_URL"] = database_url
        log_path = self.tmp_path / f"{name}.stderr.log"
        command = cli_command("run")
        if as_pid1:
            command = [*AS_PID1, *command]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                command,
                env=env,
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        service = ServiceProcess(
            name=name,
            proc=proc,
            port=port,
            log_path=log_path,
            debug_port=debug_port,
            started_at=time.monotonic(),
            signal_pid=child_of(proc.pid) if as_pid1 else None,
        )
        self.processes.append(service)
        return service

    def close(self) -> None:
        for p in self.processes:
            p.kill()

    def failure_report(self) -> str:
        return "\n".join(
            f"--- {p.name} (exit {p.proc.poll()}) log tail:\n{p.log_tail()}" for p in self.processes
        )


# --------------------------------------------------------------------------- emulator state


def lease(
    emu: Emulator, *, namespace: str = LEASE_NAMESPACE, name: str = LEASE_NAME
) -> dict[str, Any] | None:
    """The Lease object as the emulator holds it (None when absent)."""
    entry = emu.table(LEASES).entries.get(f"{namespace}/{name}")
    return None if entry is None else emu.to_object(LEASES, entry)


def lease_holder(emu: Emulator) -> str | None:
    obj = lease(emu)
    return None if obj is None else str((obj.get("spec") or {}).get("holderIdentity") or "")


def pod_gone_or_terminating(emu: Emulator, name: str) -> bool:
    pod = emu.get_pod(SANDBOX_NAMESPACE, name)
    return pod is None or bool(pod["metadata"].get("deletionTimestamp"))


async def wait_until(
    predicate: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.05, what: str = ""
) -> float:
    """Wait until ``predicate()``; returns the seconds it took. Fails after ``timeout_s``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        await anyio.sleep(interval_s)
    return time.monotonic() - started


# ---------------------------------------------------------------------------- the population


async def seed_population(database_url: str, emu: Emulator) -> dict[str, dict[str, Any]]:
    """The demo's population (rows and pods) plus the unrelated pod; returns name → pod as
    created (uid and resourceVersion included)."""
    return await demo.seed_population(database_url, emu)


def present(emu: Emulator) -> set[str]:
    """Names of the pods in the sandbox namespace that exist and are not terminating."""
    return {
        p["metadata"]["name"]
        for p in emu.pods(SANDBOX_NAMESPACE)
        if not p["metadata"].get("deletionTimestamp")
    }
