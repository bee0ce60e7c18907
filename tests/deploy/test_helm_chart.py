"""The Helm chart (deploy/helm/retired-pod-gc), linted and rendered by the real helm: the same
objects as the kustomize tree, object by object, for the default, dry-run, live and two-namespace
values (and the monitoring and migrate objects behind their values); schema-valid; every setting
of docs/configuration.md reachable and typed; a bad value refused before anything is rendered.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from devtools import chartschema
from devtools.chartschema import CHART_OWNED
from service import config
from service.kit.env import Var
from tests.deploy.rendering import CHART, Obj, helm, render, render_chart
from tests.deploy.support import (
    DEPLOY,
    MONITORING,
    ROOT,
    container,
    container_env,
    migrate_job_bounds,
    of_kind,
    only,
)

K8S_VERSIONS = sorted({"1.29.0", "1.36.0", kubernetes_validate.latest_version()})
CASES: dict[str, dict[str, Any]] = {
    "base": {},
    "dry-run": {"mode": "dry-run"},
    "live": {"mode": "live"},
    "two-namespaces": {"sandboxNamespaces": ["sandboxes", "sandboxes-b"]},
}
"""The chart's values that render each kustomization of deploy/ (the base, then the overlays)."""
EVERYTHING_ON: dict[str, Any] = {
    "monitoring": {
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "dashboard": {"enabled": True},
        "alertmanagerConfig": {"enabled": True},
    },
    "migrate": {"enabled": True},
}
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "AlertmanagerConfig"}
"""Kinds of the prometheus-operator, absent from the Kubernetes schemas (compared with
deploy/monitoring's instead)."""
SCHEMA = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
CONFIG_PROPERTIES: dict[str, dict[str, Any]] = SCHEMA["properties"]["config"]["properties"]


@pytest.fixture(scope="module")
def chart_renders() -> dict[str, list[Obj]]:
    return {name: render_chart(values) for name, values in CASES.items()}


@pytest.fixture(scope="module")
def kustomize_renders(
    base_objects: list[Obj], overlay_objects: dict[str, list[Obj]]
) -> dict[str, list[Obj]]:
    return {"base": base_objects, **overlay_objects}


@pytest.fixture(scope="module")
def everything_on() -> list[Obj]:
    return render_chart(EVERYTHING_ON)


# --- lint -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values", [{}, {"mode": "live"}, EVERYTHING_ON], ids=["default", "live", "all"]
)
def test_helm_lint_strict_is_clean(values: dict[str, Any], tmp_path: Path) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values), encoding="utf-8")
    done = helm("lint", "--strict", str(CHART), "--values", str(values_file), check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout
    assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout, done.stdout


# --- the same objects as the kustomize tree ------------------------------------------------------

_HASH = re.compile(r"-[a-z0-9]{10}$")


def _plain_configmap_names(objects: list[Obj]) -> dict[str, str]:
    """Generated ConfigMap name (with kustomize's content hash) to the plain name."""
    return {
        o["metadata"]["name"]: _HASH.sub("", o["metadata"]["name"])
        for o in of_kind(objects, "ConfigMap")
        if _HASH.search(o["metadata"]["name"])
    }


def comparable(chart_obj: Obj, kustomize_obj: Obj, plain: dict[str, str]) -> tuple[Obj, Obj]:
    """The two objects with only what legitimately differs taken out: Helm's extra labels (the
    kustomize labels must all be there, with their values), the chart's hook and checksum
    annotations, the content hash of kustomize's generated ConfigMap names, and empty variables
    (unset and empty are the same to the service)."""
    ours, theirs = copy.deepcopy(chart_obj), copy.deepcopy(kustomize_obj)
    for a, b in _metadata_pairs(ours, theirs):
        labels = b.get("labels", {})
        assert {k: a.get("labels", {}).get(k) for k in labels} == labels, (a, b)
        a.pop("labels", None)
        b.pop("labels", None)
        annotations = a.pop("annotations", {})
        assert set(annotations) <= {
            "checksum/config",
            "helm.sh/hook",
            "helm.sh/hook-weight",
            "helm.sh/hook-delete-policy",
        }, annotations
        assert not b.pop("annotations", {}), b
    theirs["metadata"]["name"] = plain.get(theirs["metadata"]["name"], theirs["metadata"]["name"])
    for c in theirs.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
        for source in c.get("envFrom", []):
            ref = source["configMapRef"]
            ref["name"] = plain.get(ref["name"], ref["name"])
    if ours["kind"] == "ConfigMap":
        for obj in (ours, theirs):
            obj["data"] = {k: v for k, v in obj["data"].items() if v != ""}
    return ours, theirs


def _metadata_pairs(ours: Obj, theirs: Obj) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    pairs = [(ours["metadata"], theirs["metadata"])]
    if "template" in theirs.get("spec", {}):
        pairs.append((ours["spec"]["template"]["metadata"], theirs["spec"]["template"]["metadata"]))
    return pairs


def identity(obj: Obj, plain: dict[str, str]) -> tuple[str, str, str]:
    name = obj["metadata"]["name"]
    return obj["kind"], obj["metadata"].get("namespace", ""), plain.get(name, name)


def compare(chart_objects: list[Obj], kustomize_objects: list[Obj]) -> None:
    plain = _plain_configmap_names(kustomize_objects)
    ours = {identity(o, {}): o for o in chart_objects}
    theirs = {identity(o, plain): o for o in kustomize_objects}
    assert len(ours) == len(chart_objects) and len(theirs) == len(kustomize_objects)
    assert set(ours) == set(theirs)
    for key, obj in theirs.items():
        a, b = comparable(ours[key], obj, plain)
        assert a == b, key


@pytest.mark.parametrize("case", list(CASES))
def test_the_chart_renders_the_kustomize_objects_object_by_object(
    case: str, chart_renders: dict[str, list[Obj]], kustomize_renders: dict[str, list[Obj]]
) -> None:
    """Kind, name and namespace of each object, then the whole object (RBAC rules, container and
    pod security contexts, probes, volumes, the NetworkPolicy, the ConfigMap's variables, ...).
    The chart does not create its own namespace (docs in its README): the base's Namespace is
    the one object it leaves out."""
    kustomize = [o for o in kustomize_renders[case] if o["kind"] != "Namespace"]
    compare(chart_renders[case], kustomize)


@pytest.mark.parametrize("case", list(CASES))
def test_the_containers_start_with_the_same_settings(
    case: str,
    tmp_path: Path,
    chart_renders: dict[str, list[Obj]],
    kustomize_renders: dict[str, list[Obj]],
) -> None:
    """The environment each Deployment's container starts with, variable by variable, and the
    settings the service loads from it (no warning; the mode of the case)."""
    url_file = tmp_path / "url"
    url_file.write_text("postgresql://retired_pod_gc:secret@db:5432/space\n")
    loaded = []
    for objects in (chart_renders[case], kustomize_renders[case]):
        env = container_env(only(objects, "Deployment"), of_kind(objects, "ConfigMap"))
        env = {k: v for k, v in env.items() if v != ""}
        loaded.append((env, config.load(env | {config.DATABASE_URL_FILE.name: str(url_file)})))
    (chart_env, chart_settings), (kustomize_env, kustomize_settings) = loaded
    assert chart_env == kustomize_env
    assert chart_settings == kustomize_settings
    assert chart_settings.warnings == ()
    modes = {"base": "disabled", "dry-run": "dry_run", "live": "live", "two-namespaces": "disabled"}
    assert chart_settings.mode == modes[case]


def test_the_monitoring_objects_are_deploy_monitoring(everything_on: list[Obj]) -> None:
    """ServiceMonitor, PrometheusRule (every runbook_url from the chart's value, as the
    kustomization's replacement fills it) and the dashboard ConfigMap."""
    kinds = {"ServiceMonitor", "PrometheusRule", "AlertmanagerConfig"}
    chart = [
        o
        for o in everything_on
        if o["kind"] in kinds or o["metadata"]["name"] == "retired-pod-gc-dashboard"
    ]
    compare(chart, render(MONITORING))


def test_the_migrate_hook_is_deploy_migrate(everything_on: list[Obj]) -> None:
    chart = [o for o in everything_on if o["metadata"]["name"] == "retired-pod-gc-migrate"]
    for obj in chart:
        annotations = obj["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation"
    # What the Job needs exists before it runs: lower weights first.
    weights = {o["kind"]: int(o["metadata"]["annotations"]["helm.sh/hook-weight"]) for o in chart}
    assert weights["ConfigMap"] < weights["Job"] and weights["NetworkPolicy"] < weights["Job"]
    compare(chart, render(DEPLOY / "migrate"))


@pytest.mark.parametrize(
    "bounds",
    [
        {"MIGRATE_DEADLINE_SECONDS": 1},
        {"MIGRATE_DEADLINE_SECONDS": 90.5, "MIGRATE_LOCK_TIMEOUT_SECONDS": 0.25},
        {
            "MIGRATE_DEADLINE_SECONDS": 3600,
            "MIGRATE_LOCK_TIMEOUT_SECONDS": 1,
            "DB_CONNECT_TIMEOUT_SECONDS": 120,
            "DB_STATEMENT_TIMEOUT_SECONDS": 120,
        },
    ],
    ids=["shortest", "fractional", "longest"],
)
def test_the_migrate_hooks_deadline_follows_migrates_bounds(bounds: dict[str, float]) -> None:
    """The config values reach the hook Job's container, and its activeDeadlineSeconds is
    derived from them: every run the Job allows ends by itself, never cut short."""
    objects = [
        o
        for o in render_chart({"migrate": {"enabled": True}, "config": bounds})
        if o["metadata"]["name"] == "retired-pod-gc-migrate"
    ]
    env = container_env(only(objects, "Job"), of_kind(objects, "ConfigMap"))
    for suffix, value in bounds.items():
        assert float(env[config.PREFIX + suffix]) == value
    active_s, needed_s = migrate_job_bounds(objects)
    assert needed_s <= active_s < needed_s + 60


def test_monitoring_and_migrate_are_off_by_default(chart_renders: dict[str, list[Obj]]) -> None:
    kinds = {o["kind"] for o in chart_renders["base"]}
    assert not kinds & {"ServiceMonitor", "PrometheusRule", "AlertmanagerConfig", "Job"}
    assert [o["metadata"]["name"] for o in of_kind(chart_renders["base"], "ConfigMap")] == [
        "retired-pod-gc-config"
    ]


@pytest.mark.parametrize(
    "name", ["prometheusrule.yaml", "alertmanagerconfig.yaml", "grafana-dashboard.json"]
)
def test_the_charts_copies_of_the_monitoring_files_are_identical(name: str) -> None:
    """helm reads no file outside the chart, so the chart carries copies; they must not drift."""
    assert (CHART / "files" / name).read_bytes() == (MONITORING / name).read_bytes()


# --- Kubernetes schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_object_validates_against_the_kubernetes_schema(
    version: str, chart_renders: dict[str, list[Obj]], everything_on: list[Obj]
) -> None:
    for objects in [*chart_renders.values(), everything_on]:
        for obj in objects:
            if obj["kind"] not in CRD_KINDS:
                kubernetes_validate.validate(obj, version, strict=True)


# --- values -----------------------------------------------------------------------------------


def test_the_committed_schema_is_what_the_declarations_generate() -> None:
    """``config``'s properties of values.schema.json come from service/config.py (type, choices,
    range, default, description): the committed file is the generator's output, byte for byte,
    and a declaration changed without ``python -m devtools.chartschema --write`` fails here."""
    text = (CHART / "values.schema.json").read_text(encoding="utf-8")
    assert chartschema.render(text) == text
    suffixes = {v.suffix for v in config.VARIABLES}
    assert set(CONFIG_PROPERTIES) | set(CHART_OWNED) == suffixes
    assert not set(CONFIG_PROPERTIES) & set(CHART_OWNED)


@pytest.mark.parametrize("field", ["doc", "default", "hi"])
def test_the_schema_check_fails_when_one_declaration_changes(field: str) -> None:
    text = (CHART / "values.schema.json").read_text(encoding="utf-8")
    changed = {"doc": "Another description.", "default": 301.0, "hi": 86401}[field]
    variables = [
        dataclasses.replace(v, **{field: changed}) if v is config.THRESHOLD_SECONDS else v
        for v in config.VARIABLES
    ]
    assert chartschema.render(text, variables) != text


def test_every_choice_and_default_the_schema_gives_the_service_accepts() -> None:
    for var in config.VARIABLES:
        if var.suffix in CHART_OWNED:
            continue
        prop = CONFIG_PROPERTIES[var.suffix]
        for choice in prop.get("enum", []):
            assert var.parse(choice) == choice, var.suffix
        if "default" in prop:
            shown = str(prop["default"]).lower() if prop["type"] == "boolean" else prop["default"]
            assert var.parse(str(shown)) == var.default, var.suffix


def test_every_default_a_template_falls_back_to_is_the_declared_one() -> None:
    """The templates that need a value the user left unset (the migrate Job's bounds, the Lease
    name the Role grants) fall back to a literal: each is the default service/config.py declares."""
    by_suffix = {v.suffix: v for v in config.VARIABLES}
    fallbacks = [
        (literal, name)
        for template in sorted((CHART / "templates").iterdir())
        for literal, name in re.findall(
            r"default (\S+) (?:\$config|\.Values\.config)\.([A-Z_]+)",
            template.read_text(encoding="utf-8"),
        )
    ]
    assert len(fallbacks) >= 8, fallbacks
    for literal, name in fallbacks:
        var = by_suffix[name]
        assert var.parse(str(yaml.safe_load(literal))) == var.default, name


def sample(var: Var[Any]) -> Any:
    """A value of ``var`` other than its default where there is one, as a values file holds it."""
    prop = CONFIG_PROPERTIES[var.suffix]
    if prop["type"] == "boolean":
        return not var.default
    if "enum" in prop:
        return prop["enum"][-1]
    if prop["type"] in ("integer", "number"):
        # The low end of the range: the lease timings keep their order there (renew below the
        # lease, retry below renew), so nothing is adjusted on load.
        assert var.lo is not None, var.suffix
        return int(var.lo) if prop["type"] == "integer" else var.lo
    if isinstance(var.default, tuple):
        return "127.0.0.1:9091"
    return var.default


def test_every_config_value_reaches_the_service_as_that_setting(tmp_path: Path) -> None:
    """All of ``config`` set at once: each becomes its variable, and the service reads back the
    value given (no clamping: the schema's ranges are the service's)."""
    values = {v.suffix: sample(v) for v in config.VARIABLES if v.suffix not in CHART_OWNED}
    objects = render_chart({"config": values})
    env = container_env(only(objects, "Deployment"), of_kind(objects, "ConfigMap"))
    url_file = tmp_path / "url"
    url_file.write_text("postgresql://retired_pod_gc:secret@db:5432/space\n")
    settings = config.load(env | {config.DATABASE_URL_FILE.name: str(url_file)})
    assert settings.warnings == ()
    effective = {name: value for name, value, _ in config.effective(settings, env)}
    by_suffix = {v.suffix: v for v in config.VARIABLES}
    for suffix, given in values.items():
        var = by_suffix[suffix]
        shown = str(given).lower() if isinstance(given, bool) else str(given)
        assert var.parse(effective[var.name]) == var.parse(shown), suffix
        assert var.parse(shown) != var.default or isinstance(var.default, str), suffix


def test_the_listener_secret_is_mounted_as_its_file() -> None:
    objects = render_chart({"database": {"secretName": "db", "listenerSecretName": "db-direct"}})
    deployment = only(objects, "Deployment")
    env = container_env(deployment, of_kind(objects, "ConfigMap"))
    path = Path(env[config.LISTENER_DATABASE_URL_FILE.name])
    mounts = {m["mountPath"]: m for m in container(deployment)["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mount = mounts[str(path.parent)]
    assert mount["readOnly"] is True
    assert volumes[mount["name"]]["secret"]["secretName"] == "db-direct"
    assert (
        volumes[mounts[str(Path(env[config.DATABASE_URL_FILE.name]).parent)]["name"]]["secret"][
            "secretName"
        ]
        == "db"
    )
    assert config.LISTENER_DATABASE_URL.name not in env and config.DATABASE_URL.name not in env


def test_the_image_is_pinned_by_digest_when_one_is_given() -> None:
    digest = "sha256:" + "ab" * 32
    objects = render_chart(
        {"image": {"repository": "registry.example/retired-pod-gc", "digest": digest}}
        | EVERYTHING_ON
    )
    images = {container(o)["image"] for o in objects if o["kind"] in ("Deployment", "Job")}
    assert images == {f"registry.example/retired-pod-gc@{digest}"}


def test_the_chart_and_app_versions_are_the_projects() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert chart["version"] == chart["appVersion"] == project["project"]["version"]


@pytest.mark.parametrize(
    ("values", "refusal"),
    [
        ({"config": {"THRESHOLD_SECONDS": -5}}, "/config/THRESHOLD_SECONDS"),
        ({"config": {"WORKERS": 0}}, "/config/WORKERS"),
        ({"config": {"LIST_MODE": "fast"}}, "/config/LIST_MODE"),
        ({"config": {"DRY_RUN": False}}, "DRY_RUN"),
        ({"config": {"THRESHOLD_SECOND": 300}}, "THRESHOLD_SECOND"),
        ({"mode": "yolo"}, "/mode"),
        ({"sandboxNamespaces": []}, "/sandboxNamespaces"),
        ({"sandboxNamespaces": ["Sandboxes"]}, "/sandboxNamespaces/0"),
        ({"image": {"repository": "x", "digest": "sha256:abc"}}, "/image/digest"),
    ],
    ids=[
        "negative-threshold",
        "no-workers",
        "unknown-list-mode",
        "dry-run-is-the-mode",
        "misspelt",
        "unknown-mode",
        "no-namespace",
        "bad-namespace",
        "short-digest",
    ],
)
def test_the_schema_refuses_a_bad_value_before_anything_is_rendered(
    values: dict[str, Any], refusal: str, tmp_path: Path
) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values), encoding="utf-8")
    done = helm("template", "retired-pod-gc", str(CHART), "--values", str(values_file), check=False)
    assert done.returncode != 0
    assert done.stdout == ""
    assert "schema" in done.stderr and refusal in done.stderr, done.stderr


def test_another_release_name_keeps_every_reference_consistent(tmp_path: Path) -> None:
    """Released as ``gc``: the objects are named after the release, and what refers to what
    (the binding's subject, the envFrom ConfigMap, the Lease the Role grants) still matches."""
    objects = render_chart({"config": {"LEASE_NAME": "gc-lease"}}, release="gc")
    deployment = only(objects, "Deployment")
    assert deployment["metadata"]["name"] == "gc-retired-pod-gc"
    pod = deployment["spec"]["template"]["spec"]
    sa = only(objects, "ServiceAccount", pod["serviceAccountName"])
    for binding in of_kind(objects, "RoleBinding"):
        assert binding["subjects"] == [
            {
                "kind": "ServiceAccount",
                "name": sa["metadata"]["name"],
                "namespace": "retired-pod-gc",
            }
        ]
        only(objects, "Role", binding["roleRef"]["name"])
    env = container_env(deployment, of_kind(objects, "ConfigMap"))
    [lease_role] = [
        r for r in of_kind(objects, "Role") if r["metadata"]["namespace"] == "retired-pod-gc"
    ]
    granted = {n for rule in lease_role["rules"] for n in rule.get("resourceNames", [])}
    assert granted == {env[config.LEASE_NAME.name]} == {"gc-lease"}
    service = only(objects, "Service")
    assert service["metadata"]["name"] == "gc-retired-pod-gc-metrics"
