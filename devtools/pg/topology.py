"""The PostgreSQL topologies production runs, built from throwaway servers on loopback.

A dev tool (``devtools/__init__.py``) beside :mod:`devtools.pg.throwaway`, for the tests of
docs/operations.md's database topologies; the product never starts any of it.

* :class:`ThrowawayPgBouncer`: Debian's ``pgbouncer`` (``make pgbouncer`` installs it) in front of
  a :class:`ThrowawayPostgres`, in ``session`` or ``transaction`` pool mode. Its configuration is
  a stock one: only the settings a fresh ``pgbouncer.ini`` asks an operator to fill in are set
  (the ``*`` fallback database naming the server, ``listen_addr`` 127.0.0.1 and a free
  ``listen_port``, ``auth_type`` and ``auth_file``, ``pool_mode``) and no Unix socket; nothing
  else (no ``ignore_startup_parameters``, no ``max_prepared_statements``). Authentication is
  Debian's stock ``auth_type = md5`` with an ``auth_file`` of plain-text passwords (the
  ``users`` given), so a client through the pooler must send its password; PgBouncer logs in to
  the server as the same user with that password (the throwaway server trusts 127.0.0.1 unless
  :func:`require_password` says otherwise). Its log (stderr) is :attr:`ThrowawayPgBouncer.log_path`.
* :class:`ThrowawayStandby`: a streaming hot standby of a running :class:`ThrowawayPostgres`,
  made by ``pg_basebackup -R`` with the primary's binaries and started on a free port.
  :meth:`~ThrowawayStandby.promote`, :meth:`~ThrowawayStandby.detach` (stop streaming: what the
  primary commits afterwards never reaches the standby), :meth:`~ThrowawayStandby.wait_replayed`.
  The throwaway server's defaults allow it as they are: ``wal_level`` replica, ``max_wal_senders``
  10, and initdb's trust entries for replication connections from 127.0.0.1.
* :func:`kill`: SIGKILL of a server's postmaster and every backend (its process group), as a
  crashed host: no shutdown, every connection reset.
* :func:`require_password`: a ``scram-sha-256`` ``pg_hba.conf`` entry for one user (and
  database), ahead of the trust entries, reloaded at once.

Under root, PgBouncer runs as the throwaway server's unprivileged user (it refuses root too).
Everything started is stopped at ``stop()``, at context exit, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Literal

import asyncpg

from devtools.pg.throwaway import (
    ThrowawayError,
    ThrowawayPostgres,
    _free_port,
    _run_as_user,
    run_async,
)

PoolMode = Literal["session", "transaction"]
_PGBOUNCER_FALLBACK = Path("/usr/sbin/pgbouncer")
_HBA_SCRAM = "host {database} {user} 127.0.0.1/32 scram-sha-256"


def find_pgbouncer() -> Path:
    """The ``pgbouncer`` binary (``$PATH``, else Debian's ``/usr/sbin``). Raises
    :class:`ThrowawayError` naming ``make pgbouncer`` when it is absent."""
    found = shutil.which("pgbouncer")
    if found is not None:
        return Path(found)
    if os.access(_PGBOUNCER_FALLBACK, os.X_OK):
        return _PGBOUNCER_FALLBACK
    raise ThrowawayError("no pgbouncer binary: `make pgbouncer` installs Debian's package")


async def _fetchval(url: str, sql: str, *args: object) -> object:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        return await conn.fetchval(sql, *args, timeout=60)
    finally:
        await conn.close(timeout=5)


async def _flushed_lsn(url: str) -> str:
    """The end of the WAL ``url``'s server has flushed, once everything committed before this
    call is in it. The throwaway server commits asynchronously (its WAL writer flushes a little
    later), so a synchronous commit of a transaction that wrote WAL (a transactional logical
    message, which no table needs) forces the flush first. The insert position is no target:
    past a page header when idle at a page's start, no replay ever reaches it."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        async with conn.transaction():
            await conn.execute("SET LOCAL synchronous_commit = on")
            await conn.execute("SELECT pg_logical_emit_message(true, 'throwaway', 'flush')")
        return str(await conn.fetchval("SELECT pg_current_wal_flush_lsn()::text"))
    finally:
        await conn.close(timeout=5)


def _wait(condition_sql: str, url: str, *, timeout_s: float, what: str) -> None:
    """Poll ``condition_sql`` (one boolean) on ``url`` until it is true."""
    deadline = time.monotonic() + timeout_s
    while True:
        if run_async(lambda: _fetchval(url, condition_sql)) is True:
            return
        if time.monotonic() > deadline:
            raise ThrowawayError(f"{what}: not within {timeout_s}s")
        time.sleep(0.05)


class ThrowawayPgBouncer:
    """Debian's PgBouncer in front of ``server`` on a free loopback port. Synchronous API.

    ``users`` maps each user allowed through the pooler to its password (``auth_file``).
    """

    def __init__(
        self,
        server: ThrowawayPostgres,
        *,
        users: Mapping[str, str],
        pool_mode: PoolMode = "session",
        start_timeout_s: float = 15.0,
    ) -> None:
        if not users:
            raise ValueError("users: at least one user must be able to log in")
        for name, password in users.items():
            if '"' in name + password or "\n" in name + password:
                raise ValueError(f"user {name!r}: quotes and newlines cannot go in auth_file")
        self._server = server
        self._users = dict(users)
        self.pool_mode: PoolMode = pool_mode
        self._start_timeout_s = start_timeout_s
        self._tmp: Path | None = None
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> ThrowawayPgBouncer:
        if self._proc is not None and self._proc.poll() is None:
            return self
        binary = find_pgbouncer()
        run_as = _run_as_user()
        self._tmp = Path(tempfile.mkdtemp(prefix="retired-pod-gc-pgbouncer-"))
        atexit.register(self.stop)
        self._port = _free_port()
        auth_file = self._tmp / "userlist.txt"
        auth_file.write_text("".join(f'"{u}" "{p}"\n' for u, p in self._users.items()))
        config = self._tmp / "pgbouncer.ini"
        config.write_text(
            "\n".join(
                [
                    "[databases]",
                    f"* = host=127.0.0.1 port={self._server.port}",
                    "",
                    "[pgbouncer]",
                    "listen_addr = 127.0.0.1",
                    f"listen_port = {self._port}",
                    "unix_socket_dir =",
                    "auth_type = md5",
                    f"auth_file = {auth_file}",
                    f"pool_mode = {self.pool_mode}",
                    "",
                ]
            )
        )
        log = self.log_path
        log.touch()
        if run_as is not None:
            for path in (self._tmp, auth_file, config, log):
                os.chown(path, run_as.uid, run_as.gid)
        with log.open("ab") as out:
            self._proc = subprocess.Popen(
                [str(binary), str(config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                user=None if run_as is None else run_as.uid,
                group=None if run_as is None else run_as.gid,
                extra_groups=None if run_as is None else [],
            )
        self._wait_ready()
        return self

    def stop(self) -> None:
        """Stop PgBouncer (immediate shutdown) and remove its directory."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            # SIGTERM is PgBouncer's immediate shutdown (SIGINT waits for clients).
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
            atexit.unregister(self.stop)
        self._port = None

    def __enter__(self) -> ThrowawayPgBouncer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- addresses and log -----------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise ThrowawayError("pgbouncer not started")
        return self._port

    def url(self, user: str, database: str = "postgres") -> str:
        """URL of ``database`` through the pooler as ``user`` (with its password)."""
        return f"postgresql://{user}:{self._users[user]}@127.0.0.1:{self.port}/{database}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        if self._tmp is None:
            raise ThrowawayError("pgbouncer not started")
        return self._tmp / "pgbouncer.log"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except (OSError, ThrowawayError):
            return ""

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline and self._proc.poll() is None:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1),
            ):
                return
            time.sleep(0.02)
        tail = self.log_text()[-2000:]
        self.stop()
        raise ThrowawayError(f"pgbouncer did not listen on its port: {tail}")


class ThrowawayStandby(ThrowawayPostgres):
    """A streaming hot standby of ``primary`` (``pg_basebackup -R``), on its own free port.

    ``start()`` takes the base backup (the primary must be running) and starts the standby; it
    returns once the standby accepts read-only connections.
    """

    def __init__(
        self,
        primary: ThrowawayPostgres,
        *,
        settings: Mapping[str, str] | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        if primary.bin_dir is None or not primary.running:
            raise ThrowawayError("the primary must be running before its standby is made")
        super().__init__(
            bin_dir=primary.bin_dir, settings=settings, start_timeout_s=start_timeout_s
        )
        self._primary_port = primary.port

    def _prepare(self) -> None:
        # The parent makes the directory, the user and a fresh data dir; the base backup
        # replaces the data dir.
        super()._prepare()
        assert self._tmp is not None and self._bin is not None
        self._as_server_user(["rm", "-rf", "--", str(self._tmp / "data")], "remove")
        self._as_server_user(
            [
                str(self._bin / "pg_basebackup"),
                "--pgdata",
                str(self._tmp / "data"),
                "--host",
                "127.0.0.1",
                "--port",
                str(self._primary_port),
                "--username",
                "postgres",
                "--no-password",
                "--write-recovery-conf",
                "--wal-method",
                "stream",
                "--checkpoint",
                "fast",
                "--no-sync",
            ],
            "pg_basebackup",
        )

    def in_recovery(self) -> bool:
        return run_async(lambda: _fetchval(self.url, "SELECT pg_is_in_recovery()")) is True

    def wait_replayed(self, primary: ThrowawayPostgres, *, timeout_s: float = 30.0) -> None:
        """Wait until the standby has replayed everything ``primary`` has committed so far."""
        lsn = run_async(lambda: _flushed_lsn(primary.url))
        _wait(
            f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn",
            self.url,
            timeout_s=timeout_s,
            what=f"standby replay up to {lsn}",
        )

    def detach(self, *, timeout_s: float = 30.0) -> None:
        """Stop streaming from the primary (an empty ``primary_conninfo``, reloaded); returns once
        the WAL receiver is gone. The standby stays in recovery."""
        run_async(lambda: _fetchval(self.url, "ALTER SYSTEM SET primary_conninfo = ''"))
        run_async(lambda: _fetchval(self.url, "SELECT pg_reload_conf()"))
        _wait(
            "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_wal_receiver)",
            self.url,
            timeout_s=timeout_s,
            what="WAL receiver stopped",
        )

    def promote(self, *, timeout_s: float = 60.0) -> None:
        """Promote to a primary; returns once it accepts writes."""
        seconds = max(1, int(timeout_s))
        promoted = run_async(
            lambda: _fetchval(self.url, "SELECT pg_promote(true, $1)", seconds),
            timeout_s=timeout_s + 10,
        )
        if promoted is not True:
            raise ThrowawayError(f"standby on port {self.port} not promoted in {timeout_s}s")


def kill(server: ThrowawayPostgres, *, timeout_s: float = 10.0) -> None:
    """SIGKILL the server's postmaster and every backend, as a crashed host; returns once the
    postmaster is gone. ``server.stop()`` still removes its directory."""
    pid = server.pid
    if pid is None:
        raise ThrowawayError("kill() of a server that is not running")
    # The postmaster leads its own session (and process group), its backends included.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while server.running:
        if time.monotonic() > deadline:
            raise ThrowawayError(f"postgres (pid {pid}) still running after SIGKILL")
        time.sleep(0.01)


def require_password(server: ThrowawayPostgres, *, user: str, database: str = "all") -> None:
    """Make ``user`` (on ``database``) log in over TCP with its password (scram-sha-256) instead
    of the throwaway server's trust. A standby made afterwards inherits the entry."""
    root = server.root_dir
    if root is None or not server.running:
        raise ThrowawayError("require_password() of a server that is not running")
    hba = root / "data" / "pg_hba.conf"
    entry = _HBA_SCRAM.format(database=database, user=user)
    # Prepended: the first matching line decides. Rewritten in place (owner and mode kept).
    text = hba.read_text()
    with hba.open("w") as f:
        f.write(f"{entry}\n{text}")
    if run_async(lambda: _fetchval(server.url, "SELECT pg_reload_conf()")) is not True:
        raise ThrowawayError("pg_reload_conf() failed")
