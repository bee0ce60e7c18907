"""Helpers of the deployment tests: paths, object lookups, exposition and PromQL parsing.

Kept out of ``conftest.py`` so tests import plain functions, not a conftest module.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from service import config
from service.app.commands import MIGRATE_LOCK_NOT_GRANTED
from tests.deploy.rendering import Obj

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "base"
OVERLAYS = {
    "dry-run": DEPLOY / "overlays" / "dry-run",
    "live": DEPLOY / "overlays" / "live",
    "two-namespaces": DEPLOY / "overlays" / "two-namespaces",
}
MONITORING = DEPLOY / "monitoring"

_TYPE_LINE = re.compile(r"# TYPE (\S+) (\S+)")
_SAMPLE_LINE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s")
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class ExportedMetrics(frozenset[str]):
    """The series names of an exposition, plus the label values its samples carry.

    Names come from ``# TYPE`` lines as well as samples, so a labelled family that has no child
    yet (e.g. ``watch_restarts`` before the first restart) still counts as exported: counters as
    ``<name>_total``, histograms as ``_bucket``, ``_sum`` and ``_count``.
    """

    labels: dict[str, dict[str, set[str]]]
    """Per series name, label name to the values present (label sets created at zero)."""

    def __new__(cls, text: str) -> ExportedMetrics:
        names: set[str] = set()
        labels: dict[str, dict[str, set[str]]] = {}
        for line in text.splitlines():
            if match := _TYPE_LINE.fullmatch(line):
                family, kind = match.groups()
                if kind == "counter":
                    names.add(family if family.endswith("_total") else f"{family}_total")
                elif kind in ("histogram", "summary"):
                    names.update(f"{family}{s}" for s in ("_bucket", "_sum", "_count"))
                else:
                    names.add(family)
            elif line and not line.startswith("#") and (match := _SAMPLE_LINE.match(line)):
                name, label_text = match.groups()
                names.add(name)
                per_name = labels.setdefault(name, {})
                for key, value in _LABEL_PAIR.findall(label_text or ""):
                    per_name.setdefault(key, set()).add(value)
        self = super().__new__(cls, names)
        self.labels = labels
        return self


# --- PromQL -----------------------------------------------------------------------------------
# No PromQL parser installs from the registries we can reach, so this is a tokenizer good enough
# to find series names and label matchers in the expressions we write (functions, aggregations
# with by/without, binary operators with on/ignoring, range selectors, Grafana variables).

_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "offset",
        "bool",
        "atan2",
        "inf",
        "nan",
    }
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{([^}]*)\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*')
_SELECTOR = re.compile(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")


def promql_metric_names(expr: str) -> set[str]:
    """Series names an expression selects (function, keyword and label names excluded)."""
    text = _MATCHERS.sub(" ", expr)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _STRING.sub(" ", text)
    names = set()
    for name, call in _IDENT.findall(text):
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def promql_matchers(expr: str) -> list[tuple[str, str, str, str]]:
    """(metric, label, operator, value) of every matcher written as ``metric{...}``."""
    found = []
    for metric, body in _SELECTOR.findall(expr):
        for part in filter(None, (p.strip() for p in body.split(","))):
            match = _MATCHER.fullmatch(part)
            assert match is not None, f"cannot parse matcher {part!r} in {expr!r}"
            label, op, value = match.groups()
            found.append((metric, label, op, value))
    return found


def balanced(expr: str) -> bool:
    """Brackets nest correctly (outside string literals)."""
    pairs = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for char in _STRING.sub('""', expr):
        if char in "([{":
            stack.append(char)
        elif char in pairs and (not stack or stack.pop() != pairs[char]):
            return False
    return not stack


# --- objects ----------------------------------------------------------------------------------


def only(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    """The single object of ``kind`` (and ``name`` when given); fails otherwise."""
    found = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def container(deployment: Obj) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one container expected"
    result: dict[str, Any] = containers[0]
    return result


def container_env(deployment: Obj, configmaps: list[Obj]) -> dict[str, str]:
    """The environment the container starts with: envFrom ConfigMaps, then literal env values.

    ``valueFrom`` entries (downward API) are resolved to representative values.
    """
    c = container(deployment)
    by_name = {cm["metadata"]["name"]: cm for cm in configmaps}
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        assert ref in by_name, f"envFrom names ConfigMap {ref!r}, which is not rendered"
        env.update(by_name[ref]["data"])
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            field_path = item["valueFrom"]["fieldRef"]["fieldPath"]
            env[item["name"]] = {
                "metadata.namespace": deployment["metadata"]["namespace"],
                "metadata.name": "retired-pod-gc-6d9f7c-abcde",
            }[field_path]
    return env


MIGRATE_POD_START_S = 30.0
"""What the migrate Job gives a pod to start (image pull, interpreter) beyond migrate's bounds."""
MIGRATE_BOUNDS = (
    config.MIGRATE_DEADLINE_SECONDS,
    config.MIGRATE_LOCK_TIMEOUT_SECONDS,
    config.DB_CONNECT_TIMEOUT_SECONDS,
    config.DB_STATEMENT_TIMEOUT_SECONDS,
)
"""The variables one migrate run's length follows from: the Job sets each, not the code."""


def migrate_job_bounds(objects: list[Obj]) -> tuple[float, int]:
    """The migrate Job's activeDeadlineSeconds, and the least that lets every run it allows end
    by itself (backoffLimit + 1 runs, each connect + deadline + one lock_timeout + one statement
    + the pod's start, and the Job's pod backoff between them: 10 s doubling, capped at 6 min);
    checks on the way that the Job sets each of :data:`MIGRATE_BOUNDS` within its range and that
    exit 3 (the lock not granted by the deadline) fails the Job at once."""
    job = only(objects, "Job")
    env = container_env(job, of_kind(objects, "ConfigMap"))
    assert {v.name for v in MIGRATE_BOUNDS} <= set(env), sorted(env)
    env = {k: v for k, v in env.items() if k != config.DATABASE_URL_FILE.name}
    settings = config.load(env | {config.DATABASE_URL.name: "postgresql://owner@db:5432/app"})
    assert settings.warnings == ()  # nothing clamped: the container runs with the Job's values
    db = settings.database
    run_s = (
        db.connect_timeout_s
        + db.migrate_deadline_s
        + db.migrate_lock_timeout_s
        + db.statement_timeout_s
        + MIGRATE_POD_START_S
    )
    spec = job["spec"]
    limit = spec["backoffLimit"]
    needed_s = (limit + 1) * run_s + sum(min(10 * 2**i, 360) for i in range(limit))
    assert {
        "action": "FailJob",
        "onExitCodes": {
            "containerName": container(job)["name"],
            "operator": "In",
            "values": [MIGRATE_LOCK_NOT_GRANTED],
        },
    } in spec["podFailurePolicy"]["rules"]
    return float(spec["activeDeadlineSeconds"]), math.ceil(needed_s)
