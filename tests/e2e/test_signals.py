"""Every command ends on SIGTERM (exit 143) and SIGINT (exit 130), as PID 1 too: the one-shot
commands as real processes blocked on a database that never answers (a loopback server that
accepts and never replies); ``run`` as PID 1 drains and exits 0; and ``migrate``'s own connect
timeout (``DB_CONNECT_TIMEOUT_SECONDS``).

Nothing here is timed: a command blocked on the silent database is signalled once the server
has accepted its connection, with a connect timeout (120 s) far beyond the hang guard (60 s), so
an exit with 143 or 130 is an exit caused by the signal, before the timeout could have fired.
As PID 1 of its own PID namespace (``unshare --pid``, as in a container) the kernel drops a
signal the process has no handler for, even one sent from outside the namespace: without the
handlers (``service/app/signals.py``) the signal is lost and ``migrate`` goes on waiting.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from devtools.emulator import RunningEmulator
from service.config import PREFIX

from .harness import (
    AS_PID1,
    REPO_ROOT,
    ServiceLauncher,
    SilentServer,
    base_env,
    child_of,
    cli_command,
    lease_holder,
)

CONNECT_TIMEOUT_S = 120  # the maximum DB_CONNECT_TIMEOUT_SECONDS: never fires within a test
HANG_GUARD_S = 60.0  # a process that has not done its step by then never will

# Each one-shot command with the database it needs first: it blocks on the silent server.
ONE_SHOT = {
    "migrate": ("migrate",),
    "scan": ("scan", "--timeout", "5"),
    "explain": ("explain", "sandboxes/space-sbx-idle0001-g1"),
    "cancel-create": ("cancel-create", "idle0001", "1", "0"),
}


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    with SilentServer() as server:
        yield server


@dataclass
class Started:
    proc: subprocess.Popen[bytes]
    target: int  # the pid to signal: the command itself (PID 1 of its namespace under unshare)
    stderr_path: Path

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None


def _env(tmp_path: Path, port: int, **settings: object) -> dict[str, str]:
    return base_env(
        kubeconfig=tmp_path / "absent.yaml",  # never reached: the database comes first
        database_url=f"postgresql://gc:hunter2@127.0.0.1:{port}/db",
        DB_CONNECT_TIMEOUT_SECONDS=CONNECT_TIMEOUT_S,
        **settings,
    )


Launch = Callable[..., Started]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Launch]:
    started: list[Started] = []

    def launch(args: tuple[str, ...], env: dict[str, str], *, as_pid1: bool = False) -> Started:
        command = cli_command(*args)
        if as_pid1:
            command = [*AS_PID1, *command]
        path = tmp_path / f"stderr-{len(started)}.log"
        with path.open("wb") as err:
            proc = subprocess.Popen(
                command,
                env=env,
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        one = Started(proc, child_of(proc.pid) if as_pid1 else proc.pid, path)
        started.append(one)
        return one

    yield launch
    for one in started:
        if one.proc.poll() is None:
            one.proc.kill()
            one.proc.wait(timeout=10)


def _signal_while_connecting(
    started: Started, silent: SilentServer, signum: signal.Signals
) -> int | None:
    assert silent.accepted.wait(HANG_GUARD_S), f"never connected:\n{started.stderr()}"
    assert started.proc.poll() is None, started.stderr()
    sent = time.monotonic()
    os.kill(started.target, signum)
    code = started.wait(HANG_GUARD_S)
    if code is not None:
        print(f"\n{signum.name}: exited {code} after {time.monotonic() - sent:.2f}s")
    return code


@pytest.mark.parametrize(("signum", "expected"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_migrate_blocked_on_a_silent_database_exits_on_the_signal(
    tmp_path: Path, silent: SilentServer, start: Launch, signum: signal.Signals, expected: int
) -> None:
    started = start(ONE_SHOT["migrate"], _env(tmp_path, silent.port))
    code = _signal_while_connecting(started, silent, signum)
    assert code == expected, started.stderr()
    stderr = started.stderr()
    assert stderr.strip().splitlines() == [f"retired-pod-gc: interrupted by {signum.name}"]
    assert "no connection within" not in stderr  # the exit came before the connect timeout


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_migrate_as_pid_1_exits_on_the_signal(
    tmp_path: Path, silent: SilentServer, start: Launch, signum: signal.Signals
) -> None:
    started = start(ONE_SHOT["migrate"], _env(tmp_path, silent.port), as_pid1=True)
    assert _pid_in_its_namespace(started.target) == "1"
    code = _signal_while_connecting(started, silent, signum)
    # unshare exits with its command's status.
    assert code == 128 + signum, started.stderr()
    assert started.stderr().strip().splitlines() == [
        f"retired-pod-gc: interrupted by {signum.name}"
    ]


@pytest.mark.parametrize("command", ["scan", "explain", "cancel-create"])
def test_every_one_shot_command_blocked_on_the_database_exits_143_on_sigterm(
    tmp_path: Path, silent: SilentServer, start: Launch, command: str
) -> None:
    started = start(ONE_SHOT[command], _env(tmp_path, silent.port))
    code = _signal_while_connecting(started, silent, signal.SIGTERM)
    assert code == 143, started.stderr()
    # One human line; JSON log lines aside (cancel-create logs at LOG_LEVEL, info here).
    lines = started.stderr().strip().splitlines()
    assert [ln for ln in lines if not ln.startswith("{")] == [
        "retired-pod-gc: interrupted by SIGTERM"
    ]
    assert "Traceback" not in started.stderr()


@pytest.mark.parametrize(("signum", "expected"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_pending_blocked_on_a_replica_that_never_answers_exits_on_the_signal(
    tmp_path: Path, silent: SilentServer, start: Launch, signum: signal.Signals, expected: int
) -> None:
    # ``pending`` needs no database: the silent server stands for a replica's health port.
    url = f"http://127.0.0.1:{silent.port}"
    started = start(("pending", "--url", url, "--timeout", "120"), _env(tmp_path, silent.port))
    code = _signal_while_connecting(started, silent, signum)
    assert code == expected, started.stderr()
    assert started.stderr().strip().splitlines() == [
        f"retired-pod-gc: interrupted by {signum.name}"
    ]


def _pid_in_its_namespace(pid: int) -> str:
    """NSpid: the pid here, then in its own namespace (1 for a namespace's init)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    (nspid,) = (line.split()[1:] for line in status if line.startswith("NSpid:"))
    return nspid[-1]


@pytest.mark.anyio
async def test_run_as_pid_1_drains_and_exits_0_on_sigterm(
    emulator: RunningEmulator, launcher: ServiceLauncher
) -> None:
    svc = launcher.start("pid1", as_pid1=True, ENABLED=True, DRY_RUN=True)
    assert svc.signal_pid is not None
    assert _pid_in_its_namespace(svc.signal_pid) == "1"
    await svc.wait_for("/readyz", 200, timeout_s=HANG_GUARD_S)
    assert lease_holder(emulator.emulator) == "pid1"
    code, took_s = await svc.terminate(timeout_s=HANG_GUARD_S)
    print(f"\nrun as PID 1: SIGTERM, exited {code} after {took_s:.2f}s")
    assert code == 0, svc.log_tail()
    assert lease_holder(emulator.emulator) == ""  # drained: the lease released


def test_migrate_gives_up_after_the_configured_connect_timeout(
    tmp_path: Path, silent: SilentServer, start: Launch
) -> None:
    env = _env(tmp_path, silent.port)
    env[PREFIX + "DB_CONNECT_TIMEOUT_SECONDS"] = "0.5"
    started = start(ONE_SHOT["migrate"], env)
    code = started.wait(HANG_GUARD_S)
    assert silent.accepted.is_set()  # it got through to the silent server, was not refused
    assert code == 1, started.stderr()
    lines = started.stderr().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("retired-pod-gc: migrate failed (postgresql://gc:***@127.0.0.1:")
    # The configured timeout, not a built-in one, is what gave up.
    assert "no connection within 0.5s; are the host and port right" in lines[0], lines[0]
    assert "hunter2" not in lines[0]
