"""The runbook, executed: every command block of README.md and docs/operations.md is run against
what it names — a real PostgreSQL, the API emulator through the real kubectl, ``retired-pod-gc``
itself, a running replica — or is marked illustrative in the doc, with the reason beside it.

The blocks are found by markdown-it-py (a CommonMark parser: fences inside list items too). Each
fenced block is a command block unless its info string is ``text`` (a diagram), and the HTML
comment right before it says how it is checked:

* ``<!-- runs: NAME -->``: the runner ``NAME`` of this module runs the block's text, as written
  (a few placeholders such as ``<pod>`` or a port filled in: every one must still appear in the
  block), and checks what it did. A shell block runs under ``bash -euo pipefail`` from the
  repository root, with ``kubectl`` (the pinned binary of ``tests/kubectl.py``), ``psql`` (the
  throwaway server's), ``retired-pod-gc`` and ``ADMIN_URL`` at hand; an SQL block runs on an
  asyncpg connection, in one transaction.
* ``<!-- illustrative: REASON -->``: not run, for that reason (a command that needs a real cluster
  or a Prometheus).

So a doc edit that breaks a command, or adds a block with neither marker, fails ``make test``.
The operations blocks run in the doc's order against one world: a PostgreSQL server of their own
(the uninstall drops roles, which belong to the whole server), the emulator with the demo's
population, and a dry-run replica started when a block first needs one. The uninstall's check
finds "the project's objects" in the catalog (everything named ``retired_pod_gc%``), not in a list,
and :func:`test_uninstall_without_any_one_of_its_drops_leaves_that_object_behind` shows it fails
when a line of the block is missing.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import kubernetes_validate
import pytest
import yaml
from markdown_it import MarkdownIt

from devtools.demo import POPULATION, UNRELATED, create_population_pods, seed_population_rows
from devtools.pg.throwaway import ThrowawayPostgres, find_bin_dir
from service.config import PREFIX
from service.domain import KEEP_ANNOTATION
from service.pg.migrate import SCHEMA_STEP, read_sql
from tests.e2e.harness import (
    LEASE_NAMESPACE,
    REPO_ROOT,
    SANDBOX_NAMESPACE,
    ServiceLauncher,
    ServiceProcess,
    free_port,
    outcomes,
)
from tests.kubectl import KubectlCluster, kubectl_binary

README = REPO_ROOT / "README.md"
OPERATIONS = REPO_ROOT / "docs" / "operations.md"
NOT_COMMANDS = {"text"}
"""Fence info strings of blocks that are no commands (diagrams)."""
LANGUAGES = {"sh", "sql", "promql"}
_MARKER = re.compile(r"^<!--\s*(runs|illustrative):\s*(.*?)\s*-->\s*$", re.DOTALL)

PROJECT_OBJECTS = """
SELECT 'function ' || p.oid::regprocedure::text FROM pg_proc p
 WHERE p.proname LIKE 'retired\\_pod\\_gc%'
UNION ALL
SELECT 'trigger ' || t.tgname FROM pg_trigger t WHERE t.tgname LIKE 'retired\\_pod\\_gc%'
UNION ALL
SELECT 'relation ' || c.relname FROM pg_class c WHERE c.relname LIKE 'retired\\_pod\\_gc%'
UNION ALL
SELECT 'role ' || r.rolname FROM pg_roles r WHERE r.rolname LIKE 'retired\\_pod\\_gc%'
ORDER BY 1
"""
"""Every object of the project in the database (and the server's roles), by its name."""


# ----------------------------------------------------------------------------------- blocks


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    """1-based line of the opening fence."""
    info: str
    text: str
    runs: str | None
    illustrative: str | None

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, with the marker of the HTML comment right before it."""
    tokens = MarkdownIt("commonmark").parse(path.read_text(encoding="utf-8"))
    out = []
    for i, token in enumerate(tokens):
        if token.type != "fence" or token.map is None:
            continue
        runs = illustrative = None
        before = tokens[i - 1] if i else None
        if (
            before is not None
            and before.type == "html_block"
            and before.map is not None
            and before.map[1] == token.map[0]
            and (m := _MARKER.match(before.content.strip()))
        ):
            if m.group(1) == "runs":
                runs = m.group(2).split()[0]
            else:
                illustrative = m.group(2)
        out.append(
            Block(
                doc=str(path.relative_to(REPO_ROOT)),
                line=token.map[0] + 1,
                info=token.info.strip(),
                text=token.content,
                runs=runs,
                illustrative=illustrative,
            )
        )
    return out


def command_blocks(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.info not in NOT_COMMANDS]


def fill(block: Block, values: dict[str, str]) -> str:
    """The block's text with each placeholder filled; each must still be in the block."""
    text = block.text
    for placeholder, value in values.items():
        assert placeholder in text, f"{block.where}: {placeholder!r} is no longer in the block"
        text = text.replace(placeholder, value)
    return text


# ------------------------------------------------------------------------------------ shell

_PRELUDE = r"""
kubectl() {
  # The emulator runs no containers: `kubectl ... exec TARGET -- CMD` runs CMD here, with the
  # environment the Deployment gives it.
  local args=("$@") i
  for ((i = 0; i < ${#args[@]}; i++)); do
    if [[ ${args[i]} == exec ]]; then
      for ((; i < ${#args[@]}; i++)); do
        if [[ ${args[i]} == -- ]]; then "${args[@]:i+1}"; return; fi
      done
    fi
  done
  # The emulator serves no Secrets: with RUNBOOK_CLIENT_DRY_RUN, `create` renders client-side.
  if [[ -n ${RUNBOOK_CLIENT_DRY_RUN:-} && ${args[*]} == *create* ]]; then
    command kubectl "$@" --dry-run=client -o yaml; return
  fi
  command kubectl "$@"
}
# The emulator serves no Deployments: with RUNBOOK_CLIENT_DRY_RUN, `helm install` renders
# client-side (helm install --dry-run=client) and prints what it would send.
helm() {
  if [[ -n ${RUNBOOK_CLIENT_DRY_RUN:-} && ${1:-} == install ]]; then
    command helm "$@" --dry-run=client; return
  fi
  command helm "$@"
}
make() { command make -o "$RUNBOOK_VENV/.installed-stamp" VENV="$RUNBOOK_VENV" "$@"; }
"""


@dataclass
class Shell:
    env: dict[str, str]

    def run(
        self,
        block: Block,
        text: str,
        *,
        cwd: Path = REPO_ROOT,
        timeout_s: float = 120.0,
        **env: str,
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", _PRELUDE + text],
            env={**self.env, **env},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        assert done.returncode == 0, (
            f"{block.where} exited {done.returncode}:\n{text}\n--- stdout\n{done.stdout}"
            f"\n--- stderr\n{done.stderr}"
        )
        return done


def _base_env(home: Path) -> dict[str, str]:
    venv_bin = Path(sys.executable).parent
    path = os.pathsep.join(
        [str(kubectl_binary().parent), str(venv_bin), str(find_bin_dir()), os.environ["PATH"]]
    )
    return {
        "PATH": path,
        "HOME": str(home),
        "KUBECACHEDIR": str(home / "kube-cache"),
        "LANG": "C.UTF-8",
        "RUNBOOK_VENV": str(venv_bin.parent),
    }


# ----------------------------------------------------------------------------------- the world


async def _sql(url: str, fn: Callable[[asyncpg.Connection], Any]) -> Any:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        return await fn(conn)
    finally:
        await conn.close()


def sql(url: str, fn: Callable[[asyncpg.Connection], Any]) -> Any:
    return anyio.run(_sql, url, fn)


def project_objects(url: str) -> list[str]:
    return [r[0] for r in sql(url, lambda c: c.fetch(PROJECT_OBJECTS))]


def run_in_one_transaction(url: str, text: str) -> None:
    async def go(conn: asyncpg.Connection) -> None:
        async with conn.transaction():
            await conn.execute(text)

    sql(url, go)


def platform_database(pg: ThrowawayPostgres, name: str) -> str:
    """A database holding the platform's tables (the dev schema) and the demo's rows: what the
    runbook's prerequisites name, before anything of the project is installed."""
    url = pg.create_database(name)

    async def seed(conn: asyncpg.Connection) -> None:
        await conn.execute(read_sql(SCHEMA_STEP))
        await seed_population_rows(conn)

    sql(url, seed)
    return url


def install(shell: Shell, url: str) -> None:
    """The project's objects, as the Install steps make them (roles, then the trigger)."""
    for command in (
        'psql "$ADMIN_URL" -v ON_ERROR_STOP=1 -q -f deploy/db-role/role.sql',
        f'{PREFIX}DATABASE_URL="$ADMIN_URL" retired-pod-gc migrate',
    ):
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command],
            env={**shell.env, "ADMIN_URL": url},
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def private_pg() -> Iterator[ThrowawayPostgres]:
    """A server of this module's own: the uninstall drops roles, which are the whole server's."""
    with ThrowawayPostgres() as pg:
        yield pg


@dataclass
class World:
    shell: Shell
    url: str
    cluster: KubectlCluster
    tmp_path: Path
    launcher: ServiceLauncher
    replica: ServiceProcess | None = None
    uids: dict[str, str] = field(default_factory=dict)

    def running_replica(self) -> ServiceProcess:
        """A dry-run leader with the live view on, once it has reported both retired shapes."""
        if self.replica is None:
            self.replica = self.launcher.start(
                "runbook-leader",
                ENABLED=True,
                DRY_RUN=True,
                THRESHOLD_SECONDS=1,
                DEBUG_PENDING=True,
            )
            deadline = time.monotonic() + 90
            reported: dict[str, int] = {}
            while sum(reported.values()) < 2:
                self.replica.assert_running()
                assert time.monotonic() < deadline, (
                    f"no dry-run reports: {reported}\n{self.replica.log_tail()}"
                )
                time.sleep(0.2)
                try:
                    with urllib.request.urlopen(self.replica.base_url + "/metrics", timeout=5) as r:
                        reported = outcomes(r.read().decode(), mode="dry_run")
                except OSError:
                    continue
        return self.replica


@pytest.fixture
def world(
    private_pg: ThrowawayPostgres, kubectl_cluster: KubectlCluster, tmp_path: Path
) -> Iterator[World]:
    url = platform_database(private_pg, "runbook")
    created = kubectl_cluster.call(create_population_pods)
    shell = Shell(
        {
            **_base_env(tmp_path / "home"),
            "KUBECONFIG": str(kubectl_cluster.kubeconfig),
            "ADMIN_URL": url,
            # The Deployment's environment (for `kubectl exec ... -- retired-pod-gc ...`).
            PREFIX + "DATABASE_URL": url,
            PREFIX + "NAMESPACE": SANDBOX_NAMESPACE,
            PREFIX + "LEASE_NAMESPACE": LEASE_NAMESPACE,
            PREFIX + "LOG_FORMAT": "json",
        }
    )
    launcher = ServiceLauncher(
        tmp_path=tmp_path, emulator_url=kubectl_cluster.url, database_url=url
    )
    try:
        yield World(
            shell=shell,
            url=url,
            cluster=kubectl_cluster,
            tmp_path=tmp_path,
            launcher=launcher,
            uids={name: pod["metadata"]["uid"] for name, pod in created.items()},
        )
    finally:
        launcher.close()
        private_pg.drop_database("runbook")


# ------------------------------------------------------------------- docs/operations.md runners

IDLE = "space-sbx-idle0001-g1"
ROLL = "space-sbx-roll0001-g2"
WIP = "space-sbx-wip00001-g1"
TRIGGERS_0003 = {f"retired_pod_gc_executions_{op}" for op in ("inserted", "updated", "deleted")}
TRIGGERS_0002 = {"retired_pod_gc_execution_inserted_deleted", "retired_pod_gc_execution_updated"}


def _triggers(url: str) -> set[str]:
    rows = sql(
        url,
        lambda c: c.fetch(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'sandbox_k8s_executions'::regclass "
            "AND NOT tgisinternal"
        ),
    )
    return {r[0] for r in rows}


def run_install_roles(world: World, block: Block) -> None:
    world.shell.run(block, block.text)
    roles = [o for o in project_objects(world.url) if o.startswith("role ")]
    assert roles == [
        "role retired_pod_gc",
        "role retired_pod_gc_canceller",
        "role retired_pod_gc_operator",
        "role retired_pod_gc_reader",
    ]


def run_install_trigger(world: World, block: Block) -> None:
    done = world.shell.run(block, block.text)
    assert done.stdout.startswith("applied: 0003_notify_statement_trigger"), done.stdout
    assert _triggers(world.url) == TRIGGERS_0003


def run_secret(world: World, block: Block) -> None:
    cwd = world.tmp_path / "workstation"
    cwd.mkdir()
    (cwd / "database-url").write_text("postgresql://retired_pod_gc:pw@db:5432/app\n")
    done = world.shell.run(block, block.text, cwd=cwd, RUNBOOK_CLIENT_DRY_RUN="1")
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(done.stdout) if o}
    deployment = (REPO_ROOT / "deploy" / "base" / "deployment.yaml").read_text(encoding="utf-8")
    secret_name = re.search(r"secretName: (\S+)", deployment)
    assert secret_name is not None
    secret = objects[("Secret", secret_name.group(1))]
    assert secret["metadata"]["namespace"] == "retired-pod-gc"
    assert set(secret["data"]) == {"url"}


def run_helm(world: World, block: Block) -> None:
    """The chart as the docs install it: the namespace labelled, the chart linted, rendered to a
    file and installed (client-side: the test adds --dry-run=client). What it would send is the
    base's objects, disabled and in dry run, valid against the Kubernetes schemas."""
    cwd = world.tmp_path / "helm-workstation"
    cwd.mkdir()
    world.cluster.call(lambda emu: emu.ensure_namespace(LEASE_NAMESPACE))
    text = fill(block, {"deploy/": f"{REPO_ROOT}/deploy/"})
    done = world.shell.run(block, text, cwd=cwd, RUNBOOK_CLIENT_DRY_RUN="1")
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout, done.stdout
    namespace = world.cluster.run("get", "namespace", LEASE_NAMESPACE, "-o", "json").stdout
    labels = json.loads(namespace)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    rendered = [o for o in yaml.safe_load_all((cwd / "rendered.yaml").read_text()) if o]
    assert "STATUS: pending-install" in done.stdout and "Dry run complete" in done.stdout
    installed = [o for o in yaml.safe_load_all(done.stdout.split("MANIFEST:", 1)[1]) if o]
    for objects in (rendered, installed):
        kinds = sorted(o["kind"] for o in objects)
        assert kinds == sorted(
            [
                "ConfigMap",
                "Deployment",
                "NetworkPolicy",
                "PodDisruptionBudget",
                "Role",
                "Role",
                "RoleBinding",
                "RoleBinding",
                "Service",
                "ServiceAccount",
            ]
        ), kinds
        for obj in objects:
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        [cm] = [o for o in objects if o["kind"] == "ConfigMap"]
        assert cm["data"][PREFIX + "ENABLED"] == "false"
        assert cm["data"][PREFIX + "DRY_RUN"] == "true"


def run_population_sql(world: World, block: Block) -> None:
    rows = sql(world.url, lambda c: c.fetch(block.text))
    expected: dict[tuple[str, str], int] = {}
    for p in POPULATION:
        if not p.active:
            expected[(p.state, p.kind)] = expected.get((p.state, p.kind), 0) + 1
    assert {(r[0], r[1]): r[2] for r in rows} == expected


def run_population_kubectl(world: World, block: Block) -> None:
    done = world.shell.run(block, block.text)
    terminal = sum(1 for p in POPULATION if p.shape.value == "succeeded")
    pending_no_ip = sum(1 for p in POPULATION if p.shape.value == "pending_stuck")
    assert done.stdout.split() == [str(terminal), str(pending_no_ip)], done.stdout


def run_scan(world: World, block: Block) -> None:
    done = world.shell.run(block, block.text)
    report = json.loads(done.stdout)
    assert report["verdicts"] == {"replaced_never_started": 1, "terminal_retired": 1}
    assert {c["pod"] for c in report["candidates"]} == {
        f"{SANDBOX_NAMESPACE}/{IDLE}",
        f"{SANDBOX_NAMESPACE}/{ROLL}",
    }


def run_uninstall_sql(world: World, block: Block) -> None:
    assert uninstall(world.url, block.text) == []


def uninstall(url: str, text: str) -> list[str]:
    """Run ``text`` in one transaction on a database where the project is installed; what of
    the project is left afterwards."""
    before = project_objects(url)
    for kind in ("function", "trigger", "relation", "role"):
        assert any(o.startswith(kind + " ") for o in before), (kind, before)
    run_in_one_transaction(url, text)
    return project_objects(url)


def run_keep(world: World, block: Block) -> None:
    world.shell.run(block, fill(block, {"<name>": WIP}))
    pod = world.cluster.call(lambda emu: emu.get_pod(SANDBOX_NAMESPACE, WIP))
    assert pod["metadata"]["annotations"][KEEP_ANNOTATION] == "true"
    explained = world.shell.run(block, f"retired-pod-gc explain {SANDBOX_NAMESPACE}/{WIP}")
    assert "decision: skip keep_annotation" in explained.stdout


def run_pending(world: World, block: Block) -> None:
    replica = world.running_replica()
    text = fill(block, {"http://127.0.0.1:8081": replica.debug_url, "<pod>": ROLL})
    out = world.shell.run(block, text).stdout
    for name in (IDLE, ROLL):
        assert re.search(rf"^{SANDBOX_NAMESPACE}/{name}\s", out, re.MULTILINE), out
    assert '"waits_for": "reported"' in out
    assert f"live clock ({replica.debug_url}): uid {world.uids[ROLL]}" in out


def run_events(world: World, block: Block) -> None:
    world.running_replica()
    text = fill(
        block,
        {
            "<sandbox id>": "idle0001",
            "<generation>": "1",
            "<pod uid>": world.uids[IDLE],
            "<name>": IDLE,
        },
    )
    out = world.shell.run(block, text).stdout
    # `get events` prints the real server's columns (OBJECT `pod/<pod>`): both reported pods.
    for name in (IDLE, ROLL):
        assert re.search(rf"\sRetiredPodWouldDelete\s+pod/{name}\s", out), out
    assert f"uid: {world.uids[IDLE]}" in out
    assert "reason: RetiredPodWouldDelete" in out
    assert re.search(rf"^Name:\s+{IDLE}$", out, re.MULTILINE), out


def run_rollback_0002(world: World, block: Block) -> None:
    # As the doc says: after step 1, i.e. with 0003 installed (the uninstall above removed it).
    install(world.shell, world.url)
    assert _triggers(world.url) == TRIGGERS_0003
    world.shell.run(block, block.text)
    assert _triggers(world.url) == TRIGGERS_0002
    migrated = world.shell.run(block, f'{PREFIX}DATABASE_URL="$ADMIN_URL" retired-pod-gc migrate')
    assert migrated.stdout.startswith("applied: 0003_notify_statement_trigger"), migrated.stdout
    assert _triggers(world.url) == TRIGGERS_0003


OPERATIONS_RUNNERS: dict[str, Callable[[World, Block], None]] = {
    "install-roles": run_install_roles,
    "install-trigger": run_install_trigger,
    "secret": run_secret,
    "population-sql": run_population_sql,
    "population-kubectl": run_population_kubectl,
    "scan": run_scan,
    "uninstall-sql": run_uninstall_sql,
    "keep": run_keep,
    "pending": run_pending,
    "helm": run_helm,
    "events": run_events,
    "rollback-0002": run_rollback_0002,
}


# ------------------------------------------------------------------------------ README runners


def run_demo(shell: Shell, block: Block) -> None:
    out = shell.run(block, block.text, timeout_s=240).stdout
    assert "demo finished" in out and ": OK" in out, out
    _nothing_of_the_demo_is_left(out)
    summary = out.split("== summary ==", 1)[1]
    for name, why in (
        (IDLE, "terminal_retired"),
        (ROLL, "replaced_never_started"),
        (WIP, "pending_with_ip"),
        ("space-sbx-live0001-g1", "pod_running"),
        ("space-sbx-rest0001-g3", "pending_restore_pod"),
        (UNRELATED, "not selected"),
    ):
        assert re.search(rf"^{name}\s.*\s{why}", summary, re.MULTILINE), (name, summary)


_STOPPED = re.compile(
    r"^stopped: PostgreSQL \(pid (\d+), (\S+)\) and the API emulator \((http://\S+)\)",
    re.MULTILINE,
)


def _nothing_of_the_demo_is_left(out: str) -> None:
    """When ``make demo`` has returned, no process of its PostgreSQL runs (none carries its
    postmaster's session: the postmaster starts one of its own, and its backends inherit it), its
    data directory is gone, and the emulator's port refuses connections. Looked at once, right
    after the return: nothing is waited for."""
    found = _STOPPED.search(out)
    assert found is not None, out
    pid, data_dir, api = int(found[1]), Path(found[2]), found[3]
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rpartition(")")[2].split()
        if fields[0] != "Z" and pid in (int(stat.parent.name), int(fields[3])):
            left.append(text.strip())
    assert left == [], f"processes of the demo's PostgreSQL still run: {left}"
    assert not data_dir.exists(), data_dir
    host, port = api.removeprefix("http://").rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=5).close()


def run_emulator_kubectl(shell: Shell, block: Block) -> None:
    port = str(free_port())
    lines = fill(block, {"8001": port, ".venv/bin/python": sys.executable}).splitlines()
    server, commands = lines[0], lines[1:]
    assert "devtools.emulator" in server, server
    emulator = subprocess.Popen(
        ["bash", "-c", f"exec {server}"],
        env=shell.env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert emulator.stdout is not None
        first = emulator.stdout.readline()
        assert "listening" in first, first
        pods = [f"space-sbx-00000000000{i}-g1" for i in range(3)]
        for command in commands:
            if " -w" in command:
                _watch_shows(shell, command, pods)
                continue
            out = shell.run(block, command).stdout
            if "get pods" in command:
                assert re.match(r"NAME\s+READY\s+STATUS\s+RESTARTS\s+AGE\n", out), out
                assert all(p in out for p in pods), out
            if "api-resources" in command:
                assert re.search(r"^pods\s+po\s+v1\s+true\s+Pod$", out, re.MULTILINE), out
    finally:
        emulator.terminate()
        emulator.communicate(timeout=30)


def _watch_shows(shell: Shell, command: str, pods: list[str]) -> None:
    """A watch runs until stopped: it is stopped once it has shown every pod."""
    watch = subprocess.Popen(
        ["bash", "-c", command],
        env=shell.env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watch.stdout is not None
        seen: list[str] = []
        while not all(any(p in line for line in seen) for p in pods):
            line = watch.stdout.readline()
            assert line, f"the watch ended: {seen}, {watch.stderr.read() if watch.stderr else ''}"
            seen.append(line)
    finally:
        watch.terminate()
        watch.communicate(timeout=30)


README_RUNNERS: dict[str, Callable[[Shell, Block], None]] = {
    "demo": run_demo,
    "emulator-kubectl": run_emulator_kubectl,
}


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize(
    ("doc", "runners"), [(README, README_RUNNERS), (OPERATIONS, OPERATIONS_RUNNERS)]
)
def test_every_command_block_is_run_or_marked_illustrative_with_a_reason(
    doc: Path, runners: dict[str, Any]
) -> None:
    found = command_blocks(doc)
    assert found
    for block in found:
        assert block.info in LANGUAGES, f"{block.where}: fence info {block.info!r}"
        assert (block.runs is None) != (block.illustrative is None), (
            f"{block.where}: put <!-- runs: NAME --> or <!-- illustrative: REASON --> before it"
        )
        if block.runs is not None:
            assert block.runs in runners, f"{block.where}: no runner {block.runs!r}"
        else:
            assert block.illustrative and len(block.illustrative.split()) >= 3, block.where
    # Every runner has its block (a renamed marker would otherwise leave a block unrun).
    assert {b.runs for b in found if b.runs} == set(runners)


@pytest.mark.timeout(300)
def test_readme_command_blocks_run(tmp_path: Path) -> None:
    shell = Shell(_base_env(tmp_path))
    ran = []
    for block in command_blocks(README):
        if block.runs is not None:
            README_RUNNERS[block.runs](shell, block)
            ran.append(block.runs)
    # Each runner checks its block's output; every README runner ran.
    assert sorted(ran) == sorted(README_RUNNERS)


@pytest.mark.timeout(300)
def test_operations_command_blocks_run_in_order(world: World) -> None:
    ran = []
    for block in command_blocks(OPERATIONS):
        if block.runs is not None:
            OPERATIONS_RUNNERS[block.runs](world, block)
            ran.append(block.runs)
    assert ran == [b.runs for b in command_blocks(OPERATIONS) if b.runs]


def _uninstall_block() -> Block:
    (block,) = [b for b in command_blocks(OPERATIONS) if b.runs == "uninstall-sql"]
    return block


@pytest.mark.timeout(300)
def test_uninstall_without_any_one_of_its_drops_leaves_that_object_behind(
    private_pg: ThrowawayPostgres, tmp_path: Path
) -> None:
    block = _uninstall_block()
    shell = Shell(_base_env(tmp_path))
    drops = [ln for ln in block.text.splitlines() if re.match(r"DROP (FUNCTION|TRIGGER|TABLE)", ln)]
    assert len(drops) >= 7, drops
    for i, dropped in enumerate(drops):
        url = platform_database(private_pg, f"runbook_mutant_{i}")
        try:
            install(shell, url)
            mutant = block.text.replace(dropped + "\n", "")
            try:
                left = uninstall(url, mutant)
            except asyncpg.PostgresError:
                continue  # the block fails (e.g. a trigger still needs its function): caught
            name = dropped.split()[2].rstrip(";(")
            assert any(name in o for o in left), (dropped, left)
        finally:
            private_pg.drop_database(f"runbook_mutant_{i}")
