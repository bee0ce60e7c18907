"""``deploy/`` rendered by the real ``kubectl kustomize`` (the pinned kubectl of
``tests/kubectl.py``) and the Helm chart by the real ``helm template`` (the pinned helm of
``devtools/helm.py``).

``render(path)`` is what ``kubectl apply -k path`` would send: the objects of the kustomization, in
kustomize's order, as plain dicts. A kustomization kustomize rejects fails the test with
kustomize's own message. ``render_chart(values)`` is what ``helm install`` would send with those
values; a chart or values helm rejects fail the test with helm's message (``helm(...)`` with
``check=False`` to look at a refusal).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.helm import HELM_VERSION, is_helm_installed
from tests.kubectl import kubectl_binary

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "retired-pod-gc"

Obj = dict[str, Any]


def render(path: Path) -> list[Obj]:
    result = subprocess.run(
        [str(kubectl_binary()), "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize {path}: {result.stderr.strip()}", pytrace=False)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


# --- the Helm chart -----------------------------------------------------------------------------


@functools.cache
def helm_binary() -> Path:
    """The pinned helm beside the virtualenv's python (``make install``: ``devtools/helm.py``);
    fails the test when it is not there."""
    path = Path(sys.executable).parent / "helm"
    if not is_helm_installed(path):
        pytest.fail(
            f"{path} is not the pinned helm {HELM_VERSION}: run `make install`", pytrace=False
        )
    return path


@functools.cache
def _helm_home() -> Path:
    """Helm's cache, config and data directories: one temporary directory for the session, so
    nothing outside it is read or written."""
    return Path(tempfile.mkdtemp(prefix="rpg-helm-home-"))


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``helm ARGS`` (no cluster: lint and template only); ``check``: fail on a non-zero exit."""
    home = _helm_home()
    result = subprocess.run(
        [str(helm_binary()), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
            "KUBECONFIG": str(home / "no-kubeconfig"),
        },
    )
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)}: {result.stderr.strip()}", pytrace=False)
    return result


def render_chart(
    values: dict[str, Any] | None = None, *, release: str = "retired-pod-gc"
) -> list[Obj]:
    """What ``helm template`` renders of ``deploy/helm/retired-pod-gc`` for ``values`` (a values
    file's content), released as ``release`` in namespace ``retired-pod-gc``."""
    with tempfile.TemporaryDirectory(prefix="rpg-values-") as tmp:
        values_file = Path(tmp) / "values.yaml"
        values_file.write_text(yaml.safe_dump(values or {}), encoding="utf-8")
        result = helm(
            *("template", release, str(CHART)),
            *("--namespace", "retired-pod-gc", "--values", str(values_file)),
        )
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]
