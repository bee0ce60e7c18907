"""The operator commands as real processes (``python -m service.cli``) against the emulator and a
real PostgreSQL: help, scan, explain, migrate, cancel-create, and their failures — one clear line
on stderr and a non-zero exit, never a traceback. Also: the product's command line loads and
offers no dev tool, and the demo's own entry point (``python -m devtools.demo``)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import anyio
import pytest

from devtools.emulator import RunningEmulator
from service import cli
from service.config import PREFIX
from tests.e2e.harness import (
    REPO_ROOT,
    CliResult,
    base_env,
    closed_port,
    run_cli,
    run_cli_async,
    seed_population,
    write_kubeconfig,
)
from tests.pgfixtures import PgServer

pytestmark = pytest.mark.anyio

ROLL = "sandboxes/space-sbx-roll0001-g2"


def _error_line(result: CliResult) -> str:
    """The one human line on stderr (JSON log lines aside); fails on a traceback or several."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith("{")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("retired-pod-gc: "), lines[0]
    return lines[0]


@pytest.fixture
def env(tmp_path: Path, emulator: RunningEmulator, pg_url: str) -> dict[str, str]:
    return base_env(
        kubeconfig=write_kubeconfig(tmp_path / "kc.yaml", emulator.url), database_url=pg_url
    )


# ------------------------------------------------------------------------------------ help


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_command_help_exits_0_and_explains_it(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: retired-pod-gc {command}")
    description = _commands()[command].description
    assert description
    # argparse rewraps the description; compare its words.
    assert " ".join(description.split()[:6]) in " ".join(out.split())


def test_top_level_help_lists_every_command() -> None:
    result = run_cli("--help", env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert result.code == 0
    for command in _commands():
        assert re.search(rf"^\s+{command}\s", result.stdout, re.MULTILINE), command


def test_version_prints_the_version_of_the_package_metadata() -> None:
    result = run_cli("--version", env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert result.code == 0, result.stderr
    with (REPO_ROOT / "pyproject.toml").open("rb") as f:
        declared = tomllib.load(f)["project"]["version"]
    assert result.stdout == f"retired-pod-gc {metadata.version('retired-pod-gc')}\n"
    assert metadata.version("retired-pod-gc") == declared


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (("scan", "--timeout", "-5"), "argument --timeout: must be a positive number"),
        (("scan", "--timeout", "soon"), "argument --timeout: not a number"),
        (("pending", "--limit", "0"), "argument --limit: must be 1 or more"),
        (("pending", "--timeout", "0"), "argument --timeout: must be a positive number"),
        (("pending", "--url", "127.0.0.1:1"), "argument --url: needs http://"),
        (("explain", ROLL, "--url", "127.0.0.1:1"), "argument --url: needs http://"),
        (("explain", ROLL, "--timeout", "-1"), "argument --timeout: must be a positive number"),
    ],
)
def test_bad_arguments_are_argparse_errors_exit_2(
    argv: tuple[str, ...], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"retired-pod-gc {argv[0]}: error: {complaint}" in err, err


def test_pending_help_points_at_the_leader_pod_not_the_deployment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["pending", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "deploy/retired-pod-gc" not in out
    assert "{.spec.holderIdentity}" in out
    assert "port-forward pod/${LEADER%_*} 8081" in out


def test_config_without_a_database_url_exits_0_and_says_what_will_refuse() -> None:
    result = run_cli("config", env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert result.code == 0, result.stderr
    assert re.search(r"^# no database URL: run, scan, .* refuse to start", result.stdout, re.M)
    assert "# sandbox namespaces: sandboxes\n" in result.stdout
    with_url = run_cli(
        "config",
        env={"PATH": "/usr/bin:/bin", PREFIX + "DATABASE_URL": "postgresql://x@127.0.0.1:1/x"},
    )
    assert with_url.code == 0 and "no database URL" not in with_url.stdout


def test_config_shows_each_default_as_docs_configuration_md_does() -> None:
    result = run_cli("config", env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert result.code == 0, result.stderr
    shown = dict(re.findall(rf"^{PREFIX}(\S+)\s+(.*?)\s+\(default\)$", result.stdout, re.MULTILINE))
    docs = (REPO_ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    documented = dict(re.findall(r"^\| `([A-Z_]+)` \| `([^`]*)` \|", docs, re.MULTILINE))
    assert shown["NAMESPACES"] == "(empty)"
    assert shown == documented


# ------------------------------------------------------------------ the product, not its dev tools

# Import every product module, then name the loaded modules that are dev tools
# (devtools/__init__.py), by package or by name wherever they live.
_DEV_TOOL_MODULES = """
import importlib, pkgutil, sys
import service, service.cli
for info in pkgutil.walk_packages(service.__path__, "service."):
    if not info.name.endswith(".__main__"):
        importlib.import_module(info.name)
words = ("emulator", "throwaway", "devdata", "demo")
print(sorted(m for m in sys.modules if m.startswith("devtools") or any(w in m for w in words)))
"""


def _run(*argv: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_importing_the_whole_product_loads_no_dev_tool() -> None:
    # The image carries only `service` (Dockerfile); a dev tool the product loaded would fail there.
    assert _run(sys.executable, "-c", "import devtools.emulator, devtools.demo").returncode == 0
    done = _run(sys.executable, "-c", _DEV_TOOL_MODULES)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_installed_command_offers_only_what_works_in_the_image(tmp_path: Path) -> None:
    assert set(_commands()) == {
        "run",
        "scan",
        "explain",
        "pending",
        "migrate",
        "cancel-create",
        "config",
    }
    script = str(Path(sys.executable).parent / "retired-pod-gc")
    helped = _run(script, "--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert re.search(r"^\s+run\s", helped.stdout, re.MULTILINE)
    assert not re.search(r"\bdemo\b", helped.stdout)
    refused = _run(script, "demo", cwd=tmp_path)
    assert refused.returncode == 2
    assert "invalid choice: 'demo'" in refused.stderr


def test_the_demo_entry_point_takes_the_threshold_and_the_phase_seconds() -> None:
    done = _run(sys.executable, "-m", "devtools.demo", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m devtools.demo")
    assert "--threshold" in done.stdout
    assert "--phase-seconds" in done.stdout


# ------------------------------------------------------------------------- scan / explain


async def test_scan_prints_counts_by_verdict_and_reason_and_the_candidates(
    emulator: RunningEmulator, pg_url: str, env: dict[str, str]
) -> None:
    created = await seed_population(pg_url, emulator.emulator)
    text, as_json = await _both(
        run_cli_async("scan", env=env), run_cli_async("scan", "--output", "json", env=env)
    )
    assert text.code == 0, text.stderr
    out = text.stdout
    assert "namespace sandboxes: 5 pods" in out
    for label, count in (
        ("replaced_never_started", 1),
        ("terminal_retired", 1),
        ("pending_restore_pod", 1),
        ("pending_with_ip", 1),
        ("pod_running", 1),
    ):
        assert re.search(rf"^\s+{label}\s+{count}$", out, re.MULTILINE), (label, out)
    candidates = out.split("candidates:", 1)[1]
    assert "space-sbx-idle0001-g1" in candidates
    assert "space-sbx-roll0001-g2" in candidates
    assert "space-sbx-live0001-g1" not in candidates

    assert as_json.code == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["pods"] == 5
    assert report["verdicts"] == {"replaced_never_started": 1, "terminal_retired": 1}
    assert report["skips"] == {"pending_restore_pod": 1, "pending_with_ip": 1, "pod_running": 1}
    by_pod = {c["pod"]: c for c in report["candidates"]}
    assert set(by_pod) == {"sandboxes/space-sbx-idle0001-g1", ROLL}
    assert by_pod[ROLL]["uid"] == created["space-sbx-roll0001-g2"]["metadata"]["uid"]
    assert by_pod[ROLL]["verdict"] == "replaced_never_started"


async def test_explain_prints_the_inputs_and_the_deciding_rule(
    emulator: RunningEmulator, pg_url: str, env: dict[str, str]
) -> None:
    await seed_population(pg_url, emulator.emulator)
    reapable, kept, missing = await _both(
        run_cli_async("explain", ROLL, env=env),
        run_cli_async("explain", "sandboxes/space-sbx-wip00001-g1", env=env),
        run_cli_async("explain", "sandboxes/space-sbx-nope-g1", env=env),
    )
    assert reapable.code == 0, reapable.stderr
    out = reapable.stdout
    for line in (
        r"pod\.phase\s+Pending",
        r"pod\.pod_ip\s+None",
        r"pod\.ready_to_start\s+False",
        r"pod\.kind\s+create",
        r"row\.state\s+replaced",
        r"row\.active\s+False",
        r"^decision: REAPABLE replaced_never_started$",
        r"^  pod\.created_at\s+\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$",
        r"rule: Pending fresh-create pod, no IP, PodReadyToStartContainers=False",
    ):
        assert re.search(line, out, re.MULTILINE), (line, out)
    assert "created_at_s" not in out
    assert kept.code == 0
    assert re.search(r"^decision: skip pending_with_ip$", kept.stdout, re.MULTILINE), kept.stdout
    assert missing.code == 0
    assert "not found in the API server" in missing.stdout
    assert "execution row: none" in missing.stdout


def test_explain_needs_namespace_slash_pod(tmp_path: Path) -> None:
    env = base_env(kubeconfig=tmp_path / "absent.yaml", database_url="postgresql://x@127.0.0.1:1/x")
    result = run_cli("explain", "space-sbx-roll0001-g2", env=env)
    assert result.code == 2
    assert "NAMESPACE/POD" in _error_line(result)


# ----------------------------------------------------------------------------------- migrate


@pytest.fixture
def empty_database(pg_server: PgServer) -> Iterator[str]:
    name = "rpg_cli_migrate_empty"
    pg_server.drop_database(name)
    url = pg_server.create_database(name)
    try:
        yield url
    finally:
        pg_server.drop_database(name)


def test_migrate_twice_applies_then_has_nothing_to_apply(
    tmp_path: Path, empty_database: str
) -> None:
    env = base_env(kubeconfig=tmp_path / "absent.yaml", database_url=empty_database)
    first = run_cli("migrate", "--with-schema", env=env)
    assert first.code == 0, first.stderr
    assert first.stdout.startswith("applied: ")
    assert "0001" in first.stdout and "0003" in first.stdout
    second = run_cli("migrate", "--with-schema", env=env)
    assert second.code == 0, second.stderr
    assert second.stdout.strip() == "nothing to apply: the database is up to date"


# ----------------------------------------------------------------------------- cancel-create


async def test_cancel_create_deletes_a_retired_pod_and_leaves_an_active_one(
    emulator: RunningEmulator, pg_url: str, env: dict[str, str]
) -> None:
    await seed_population(pg_url, emulator.emulator)
    retired, active = await _both(
        run_cli_async("cancel-create", "idle0001", "1", "0", env=env),
        # The live sandbox's row is active at attempt 0; attempt 7 is not it: fenced.
        run_cli_async("cancel-create", "live0001", "1", "7", env=env),
    )
    assert retired.code == 0, retired.stderr
    assert retired.stdout.strip() == "deleted: pod space-sbx-idle0001-g1 (retired by this call: no)"
    assert active.code == 0, active.stderr
    assert active.stdout.strip().startswith("left_alone_active: pod space-sbx-live0001-g1")
    deleted = [e.path.rsplit("/", 1)[-1] for e in emulator.emulator.audit_log(method="DELETE")]
    assert deleted == ["space-sbx-idle0001-g1"]


# ------------------------------------------------------------------------------- failures


def _bad_api_env(tmp_path: Path, pg_url: str) -> dict[str, str]:
    kubeconfig = write_kubeconfig(tmp_path / "closed.yaml", f"http://127.0.0.1:{closed_port()}")
    return base_env(kubeconfig=kubeconfig, database_url=pg_url, API_TIMEOUT_SECONDS=2)


def _bad_db_env(env: dict[str, str]) -> dict[str, str]:
    return {
        **env,
        PREFIX + "DATABASE_URL": f"postgresql://gc:hunter2@127.0.0.1:{closed_port()}/db",
        PREFIX + "DB_CONNECT_TIMEOUT_SECONDS": "2",
    }


ONE_SHOT = {
    "scan": ("scan", "--timeout", "5"),
    "explain": ("explain", ROLL),
    "migrate": ("migrate",),
    "cancel-create": ("cancel-create", "roll0001", "2", "0"),
}


async def test_an_unreachable_api_server_is_one_line_and_exit_1(
    tmp_path: Path, emulator: RunningEmulator, pg_url: str
) -> None:
    await seed_population(pg_url, emulator.emulator)
    env = _bad_api_env(tmp_path, pg_url)
    commands = {k: v for k, v in ONE_SHOT.items() if k != "migrate"}  # migrate needs no API
    results = await _all({k: run_cli_async(*args, env=env) for k, args in commands.items()})
    for command, result in results.items():
        assert result.code == 1, (command, result)
        line = _error_line(result)
        assert "Cannot connect to host 127.0.0.1" in line, (command, line)
    # cancel-create reached the database first, then failed on the API: re-running is safe.
    assert "cancel-create failed" in _error_line(results["cancel-create"])


async def test_an_unreachable_database_is_one_line_and_exit_1(
    emulator: RunningEmulator, pg_url: str, env: dict[str, str]
) -> None:
    await seed_population(pg_url, emulator.emulator)
    bad = _bad_db_env(env)
    results = await _all({k: run_cli_async(*args, env=bad) for k, args in ONE_SHOT.items()})
    for command, result in results.items():
        assert result.code == 1, (command, result)
        line = _error_line(result)
        assert "127.0.0.1" in line, (command, line)
        assert "hunter2" not in result.stderr
        assert "gc:***@" in line, (command, line)
    assert emulator.emulator.audit_log(method="DELETE") == []


async def test_scan_that_cannot_list_in_time_is_one_line(
    emulator: RunningEmulator, pg_url: str, env: dict[str, str]
) -> None:
    await seed_population(pg_url, emulator.emulator)
    # The probe (first list) gets through slowly; the informer's list then exceeds --timeout.
    emulator.emulator.add_latency(1.5, method="GET", path_contains="/pods")
    result = await run_cli_async("scan", "--timeout", "1", env=env)
    assert result.code == 1
    assert _error_line(result) == "retired-pod-gc: Kubernetes API: could not list pods within 1s"


@pytest.mark.parametrize("command", ["run", "scan", "explain"])
async def test_no_kubeconfig_at_all_is_one_line_saying_so(
    command: str, tmp_path: Path, pg_url: str
) -> None:
    env = base_env(kubeconfig=tmp_path / "absent.yaml", database_url=pg_url)
    result = await run_cli_async(*ONE_SHOT.get(command, (command,)), env=env)
    assert result.code == 1
    line = _error_line(result)
    assert "no kubeconfig and no in-cluster configuration found" in line, line
    assert f"KUBECONFIG={tmp_path / 'absent.yaml'} does not exist" in line, line


@pytest.fixture
def database_without_tables(pg_server: PgServer) -> Iterator[str]:
    name = "rpg_cli_no_tables"
    pg_server.drop_database(name)
    url = pg_server.create_database(name)
    try:
        yield url
    finally:
        pg_server.drop_database(name)


@pytest.mark.parametrize("command", ["scan", "explain"])
async def test_a_database_without_the_tables_is_one_line_naming_them(
    command: str, tmp_path: Path, emulator: RunningEmulator, database_without_tables: str
) -> None:
    env = base_env(
        kubeconfig=write_kubeconfig(tmp_path / "kc.yaml", emulator.url),
        database_url=database_without_tables,
    )
    result = await run_cli_async(*ONE_SHOT[command], env=env)
    assert result.code == 1
    line = _error_line(result)
    assert "has no table sandboxes, sandbox_k8s_executions" in line, line
    assert "rpg_cli_no_tables" in line


async def test_a_database_that_does_not_exist_is_one_line_saying_so(
    emulator: RunningEmulator, pg_url: str, env: dict[str, str]
) -> None:
    missing = pg_url.rsplit("/", 1)[0] + "/rpg_no_such_database"
    results = await _all(
        {
            k: run_cli_async(*args, env={**env, PREFIX + "DATABASE_URL": missing})
            for k, args in ONE_SHOT.items()
        }
    )
    for command, result in results.items():
        assert result.code == 1, (command, result)
        line = _error_line(result)
        assert 'database "rpg_no_such_database" does not exist' in line, (command, line)
        assert line.endswith("; check the database name at the end of the URL"), (command, line)


async def test_a_failing_row_lookup_is_one_line_and_exit_1(
    emulator: RunningEmulator, pg_url: str, pg_conn: Any, env: dict[str, str]
) -> None:
    await seed_population(pg_url, emulator.emulator)
    # The tables are there, but not as the queries expect them: the server answers an error.
    await pg_conn.execute("ALTER TABLE sandbox_k8s_executions RENAME COLUMN pod_name TO renamed")
    scanned, explained = await _both(
        run_cli_async("scan", env=env), run_cli_async("explain", ROLL, env=env)
    )
    assert scanned.code == 1, scanned
    assert "scan: row lookup (" in _error_line(scanned)
    assert "UndefinedColumnError" in _error_line(scanned)
    assert explained.code == 1, explained
    assert "explain: row read (" in _error_line(explained)
    assert "UndefinedColumnError" in _error_line(explained)


@pytest.fixture
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Config errors are decided before any I/O: run those commands in-process (fast), with none
    of this process's own variables of ours."""
    for name in list(os.environ):
        if name.startswith(PREFIX):
            monkeypatch.delenv(name)
    monkeypatch.setenv(PREFIX + "DATABASE_URL", "postgresql://x@127.0.0.1:1/x")
    return monkeypatch


@pytest.mark.parametrize("command", ["run", *ONE_SHOT, "config"])
def test_bad_configuration_exits_2_naming_the_variable(
    command: str, clean_environ: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_environ.setenv(PREFIX + "DELETES_PER_MINUTE", "lots")
    code = cli.main(list(ONE_SHOT.get(command, (command,))))
    captured = capsys.readouterr()
    assert code == 2
    line = _error_line(CliResult(code, captured.out, captured.err))
    assert f"{PREFIX}DELETES_PER_MINUTE" in line
    assert "'lots'" in line


@pytest.mark.parametrize("command", ["run", *ONE_SHOT])
def test_a_missing_database_url_exits_2_naming_it(
    command: str, clean_environ: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_environ.delenv(PREFIX + "DATABASE_URL")
    code = cli.main(list(ONE_SHOT.get(command, (command,))))
    captured = capsys.readouterr()
    assert code == 2
    assert f"{PREFIX}DATABASE_URL" in _error_line(CliResult(code, captured.out, captured.err))


UNPARSABLE_URLS = (
    "notaurl",
    "mysql://gc:hunter2@db/app",
    "postgresql://gc:hunter2@db:port/app",
    "postgresql://gc:hunter2@[::1/app",
)


def test_a_database_url_with_a_bad_port_says_the_port_is_bad(
    clean_environ: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_environ.setenv(PREFIX + "DATABASE_URL", "postgresql://gc:hunter2@127.0.0.1:notaport/db")
    code = cli.main(["scan"])
    captured = capsys.readouterr()
    assert code == 2
    line = _error_line(CliResult(code, captured.out, captured.err))
    assert "port 'notaport' of host '127.0.0.1' is not a number" in line, line
    assert "hunter2" not in captured.err


@pytest.mark.parametrize("url", UNPARSABLE_URLS)
@pytest.mark.parametrize("command", ["run", "config"])
def test_a_database_url_that_cannot_be_parsed_exits_2_naming_it_with_the_password_masked(
    url: str,
    command: str,
    clean_environ: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    clean_environ.setenv(PREFIX + "DATABASE_URL", url)
    code = cli.main([command])
    captured = capsys.readouterr()
    assert code == 2
    line = _error_line(CliResult(code, captured.out, captured.err))
    assert f"{PREFIX}DATABASE_URL:" in line
    assert "hunter2" not in captured.err + captured.out


def test_a_database_url_file_holding_no_url_exits_2_naming_the_file_variable(
    clean_environ: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    secret = tmp_path / "url"
    secret.write_text("host=db password=hunter2\n")
    clean_environ.delenv(PREFIX + "DATABASE_URL")
    clean_environ.setenv(PREFIX + "DATABASE_URL_FILE", str(secret))
    code = cli.main(["config"])
    captured = capsys.readouterr()
    assert code == 2
    assert f"{PREFIX}DATABASE_URL_FILE:" in _error_line(CliResult(code, captured.out, captured.err))
    assert "hunter2" not in captured.err + captured.out


def test_bad_configuration_of_the_real_process_exits_2(tmp_path: Path) -> None:
    env = base_env(kubeconfig=tmp_path / "absent.yaml", database_url="postgresql://x@127.0.0.1:1/x")
    env[PREFIX + "THRESHOLD_SECONDS"] = "soon"
    result = run_cli("run", env=env)
    assert result.code == 2
    assert f"{PREFIX}THRESHOLD_SECONDS" in _error_line(result)


# ----------------------------------------------------------------------------------- helpers


async def _both(*calls: Any) -> list[CliResult]:
    results = await _all(dict(enumerate(calls)))
    return [results[i] for i in range(len(calls))]


async def _all(calls: dict[Any, Any]) -> dict[Any, CliResult]:
    """Run the CLI processes concurrently (each in its own worker thread)."""
    out: dict[Any, CliResult] = {}

    async def one(key: Any, call: Any) -> None:
        out[key] = await call

    async with anyio.create_task_group() as tg:
        for key, call in calls.items():
            tg.start_soon(one, key, call)
    return out
