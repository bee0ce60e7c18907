"""``deploy/`` rendered by the real ``kubectl kustomize`` (the pinned kubectl of ``tests/kubectl.py``).

``render(path)`` is what ``kubectl apply -k path`` would send: the objects of the kustomization, in
kustomize's order, as plain dicts. A kustomization kustomize rejects fails the test with
kustomize's own message.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kubectl import kubectl_binary

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
