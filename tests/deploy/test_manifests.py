"""The kustomize base and overlays: schema-valid, least privilege, hardened, safe by default."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from service import config
from tests.deploy.rendering import Obj
from tests.deploy.support import (
    BASE,
    DEPLOY,
    OVERLAYS,
    ROOT,
    container,
    container_env,
    of_kind,
    only,
)

# The oldest release we claim to support, the one the wire samples come from, the newest bundled.
K8S_VERSIONS = sorted({"1.29.0", "1.36.0", kubernetes_validate.latest_version()})
VARIABLE_NAMES = {v.name for v in config.VARIABLES}
ENABLED = config.ENABLED.name
DRY_RUN = config.DRY_RUN.name
EXPECTED_KINDS = {
    "Namespace": 1,
    "ServiceAccount": 1,
    "Role": 2,
    "RoleBinding": 2,
    "ConfigMap": 1,
    "Deployment": 1,
    "Service": 1,
    "PodDisruptionBudget": 1,
    "NetworkPolicy": 1,
}


def all_renders(base: list[Obj], overlays: dict[str, list[Obj]]) -> dict[str, list[Obj]]:
    return {"base": base, **overlays}


def configmap_data(objects: list[Obj]) -> dict[str, str]:
    data: dict[str, str] = only(objects, "ConfigMap")["data"]
    return data


def walk(value: Any) -> list[Any]:
    """Every scalar inside a nested structure."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in walk(v)]
    if isinstance(value, list):
        return [x for v in value for x in walk(v)]
    return [value]


# --- rendering and schemas ------------------------------------------------------------------


RENDERS = ["base", "dry-run", "live", "two-namespaces"]
EXTRA_SANDBOX_NAMESPACES = {"two-namespaces": 1}
"""Renders that grant a sandbox namespace more than the base: one Role and RoleBinding each."""


@pytest.mark.parametrize("which", RENDERS)
def test_render_has_exactly_the_expected_objects(
    which: str, base_objects: list[Obj], overlay_objects: dict[str, list[Obj]]
) -> None:
    objects = all_renders(base_objects, overlay_objects)[which]
    counts: dict[str, int] = {}
    for obj in objects:
        counts[obj["kind"]] = counts.get(obj["kind"], 0) + 1
    extra = EXTRA_SANDBOX_NAMESPACES.get(which, 0)
    assert counts == EXPECTED_KINDS | {
        "Role": EXPECTED_KINDS["Role"] + extra,
        "RoleBinding": EXPECTED_KINDS["RoleBinding"] + extra,
    }


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("which", RENDERS)
def test_every_object_validates_against_the_kubernetes_schema(
    which: str, version: str, base_objects: list[Obj], overlay_objects: dict[str, list[Obj]]
) -> None:
    objects = all_renders(base_objects, overlay_objects)[which]
    assert objects, f"{which} renders nothing"
    for obj in objects:
        # strict: unknown fields are errors too (a typo such as `readOnlyRootFileSystem`).
        kubernetes_validate.validate(obj, version, strict=True)


def test_schema_validation_rejects_a_misspelt_field(base_objects: list[Obj]) -> None:
    deployment = copy.deepcopy(only(base_objects, "Deployment"))
    container(deployment)["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_every_object_is_namespaced_explicitly_except_the_namespace(
    base_objects: list[Obj],
) -> None:
    for obj in base_objects:
        if obj["kind"] == "Namespace":
            continue
        assert obj["metadata"].get("namespace"), f"{obj['kind']} {obj['metadata']['name']}"


# --- RBAC -----------------------------------------------------------------------------------


def rendered_settings(objects: list[Obj], tmp_path: Path) -> config.Settings:
    """The settings the rendered Deployment's container would load."""
    env = container_env(only(objects, "Deployment"), of_kind(objects, "ConfigMap"))
    url_file = tmp_path / "url"
    url_file.write_text("postgresql://retired_pod_gc:secret@db:5432/space\n")
    return config.load(env | {config.DATABASE_URL_FILE.name: str(url_file)})


SANDBOX_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "delete"]},
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
]
"""Events: create only (one Event per pod, never updated: no patch for series), and only in the
modern group (no core/v1 events)."""


@pytest.mark.parametrize("which", RENDERS)
def test_no_cluster_scoped_rbac_and_no_wildcards(
    which: str, base_objects: list[Obj], overlay_objects: dict[str, list[Obj]]
) -> None:
    objects = all_renders(base_objects, overlay_objects)[which]
    kinds = {o["kind"] for o in objects}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}
    for binding in of_kind(objects, "RoleBinding"):
        assert binding["roleRef"]["kind"] == "Role"  # never a ClusterRole bound in a namespace
    for role in of_kind(objects, "Role"):
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                assert all("*" not in str(v) for v in rule.get(key, [])), (role, key)


@pytest.mark.parametrize("which", RENDERS)
def test_each_sandbox_namespace_gets_exactly_the_pod_role_and_no_other_namespace_does(
    which: str, tmp_path: Path, base_objects: list[Obj], overlay_objects: dict[str, list[Obj]]
) -> None:
    objects = all_renders(base_objects, overlay_objects)[which]
    settings = rendered_settings(objects, tmp_path)
    own_ns = only(objects, "Deployment")["metadata"]["namespace"]
    assert len(settings.kube.namespaces) == 1 + EXTRA_SANDBOX_NAMESPACES.get(which, 0)
    roles_by_ns: dict[str, list[Obj]] = {}
    for role in of_kind(objects, "Role"):
        roles_by_ns.setdefault(role["metadata"]["namespace"], []).append(role)
    # Roles only where the service works: its sandbox namespaces and its own (the Lease).
    assert set(roles_by_ns) == {*settings.kube.namespaces, own_ns}
    bound = {
        (b["metadata"]["namespace"], b["roleRef"]["name"]) for b in of_kind(objects, "RoleBinding")
    }
    for namespace in settings.kube.namespaces:
        [role] = roles_by_ns[namespace]
        assert role["rules"] == SANDBOX_RULES, namespace
        assert (namespace, role["metadata"]["name"]) in bound, namespace


def test_lease_role_allows_only_get_create_update_of_the_one_lease(
    base_objects: list[Obj],
) -> None:
    data = configmap_data(base_objects)
    deployment = only(base_objects, "Deployment")
    own_ns = deployment["metadata"]["namespace"]
    roles = [r for r in of_kind(base_objects, "Role") if r["metadata"]["namespace"] == own_ns]
    assert len(roles) == 1
    rules = roles[0]["rules"]
    for rule in rules:
        assert rule["apiGroups"] == ["coordination.k8s.io"]
        assert rule["resources"] == ["leases"]
    assert {v for r in rules for v in r["verbs"]} == {"get", "create", "update"}
    # RBAC cannot restrict create by name; everything else is limited to the configured Lease.
    for rule in rules:
        if rule["verbs"] != ["create"]:
            assert rule["resourceNames"] == [data[config.LEASE_NAME.name]]
    # The Lease namespace the service uses is the pod's own namespace.
    env = container_env(deployment, of_kind(base_objects, "ConfigMap"))
    assert env[config.LEASE_NAMESPACE.name] == own_ns


def test_role_bindings_bind_the_deployment_service_account_to_roles_in_their_namespace(
    base_objects: list[Obj],
) -> None:
    deployment = only(base_objects, "Deployment")
    sa_name = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    sa = only(base_objects, "ServiceAccount", sa_name)
    roles = {
        (r["metadata"]["namespace"], r["metadata"]["name"]) for r in of_kind(base_objects, "Role")
    }
    bound = set()
    for binding in of_kind(base_objects, "RoleBinding"):
        ns = binding["metadata"]["namespace"]
        assert binding["roleRef"]["kind"] == "Role"
        assert (ns, binding["roleRef"]["name"]) in roles
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": sa_name, "namespace": sa["metadata"]["namespace"]}
        ]
        bound.add((ns, binding["roleRef"]["name"]))
    assert bound == roles


# --- the Deployment -------------------------------------------------------------------------


def test_deployment_runs_two_replicas_with_leader_election(base_objects: list[Obj]) -> None:
    deployment = only(base_objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    env = container_env(deployment, of_kind(base_objects, "ConfigMap"))
    settings = config.load(env | {config.DATABASE_URL_FILE.name: ""})
    assert settings.leader.enabled
    assert settings.leader.lease_name == "retired-pod-gc"


def test_pod_and_container_security_context_are_restricted(base_objects: list[Obj]) -> None:
    deployment = only(base_objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    pod_sc = pod["securityContext"]
    assert pod_sc["runAsNonRoot"] is True
    assert pod_sc["runAsUser"] > 0
    assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(deployment)["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == pod_sc["runAsUser"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc.get("privileged", False) is False
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    assert all("hostPath" not in v for v in pod.get("volumes", []))


def test_only_the_pod_opts_in_to_the_service_account_token(base_objects: list[Obj]) -> None:
    deployment = only(base_objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    sa = only(base_objects, "ServiceAccount", pod["serviceAccountName"])
    assert sa["automountServiceAccountToken"] is False
    assert pod["automountServiceAccountToken"] is True


def test_image_user_matches_the_pod_user(base_objects: list[Obj]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    users = re.findall(r"^USER\s+(\d+):(\d+)\s*$", dockerfile, flags=re.MULTILINE)
    assert len(users) == 1
    sc = only(base_objects, "Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert (int(users[0][0]), int(users[0][1])) == (sc["runAsUser"], sc["runAsGroup"])


def test_probes_hit_healthz_and_readyz_on_the_configured_port(base_objects: list[Obj]) -> None:
    deployment = only(base_objects, "Deployment")
    c = container(deployment)
    env = container_env(deployment, of_kind(base_objects, "ConfigMap"))
    port = config.load(env | {config.DATABASE_URL_FILE.name: ""}).bind_port
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": port}
    for probe, path in (
        ("livenessProbe", "/healthz"),
        ("startupProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        assert c[probe]["httpGet"]["path"] == path
        assert ports[c[probe]["httpGet"]["port"]] == port


def test_resources_have_requests_and_a_memory_limit(base_objects: list[Obj]) -> None:
    resources = container(only(base_objects, "Deployment"))["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert "memory" in resources["limits"]
    mib = {"Mi": 1, "Gi": 1024}

    def to_mib(quantity: str) -> int:
        return int(quantity[:-2]) * mib[quantity[-2:]]

    assert to_mib(resources["requests"]["memory"]) <= to_mib(resources["limits"]["memory"])


def test_termination_grace_covers_the_shutdown_timeout(base_objects: list[Obj]) -> None:
    deployment = only(base_objects, "Deployment")
    env = container_env(deployment, of_kind(base_objects, "ConfigMap"))
    settings = config.load(env | {config.DATABASE_URL_FILE.name: ""})
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings.shutdown_timeout_s


def test_database_url_comes_from_the_mounted_secret_file(base_objects: list[Obj]) -> None:
    deployment = only(base_objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    c = container(deployment)
    env = container_env(deployment, of_kind(base_objects, "ConfigMap"))
    assert config.DATABASE_URL.name not in env, "the URL must never be a plain env value"
    path = Path(env[config.DATABASE_URL_FILE.name])
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = [m for m in c["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    assert len(mounts) == 1 and mounts[0]["readOnly"] is True
    secret = volumes[mounts[0]["name"]]["secret"]
    assert secret["secretName"] == "retired-pod-gc-database"
    assert secret.get("optional", False) is False
    assert {"key": "url", "path": path.name} in secret["items"]
    # No Secret is shipped: the operator creates it (docs/operations.md).
    assert not of_kind(base_objects, "Secret")


def test_container_environment_is_only_known_variables(base_objects: list[Obj]) -> None:
    deployment = only(base_objects, "Deployment")
    env = container_env(deployment, of_kind(base_objects, "ConfigMap"))
    assert set(env) <= VARIABLE_NAMES, set(env) - VARIABLE_NAMES
    assert set(configmap_data(base_objects)) <= VARIABLE_NAMES


@pytest.mark.parametrize("which", RENDERS)
def test_rendered_environment_loads_without_warnings(
    which: str,
    tmp_path: Path,
    base_objects: list[Obj],
    overlay_objects: dict[str, list[Obj]],
) -> None:
    objects = all_renders(base_objects, overlay_objects)[which]
    settings = rendered_settings(objects, tmp_path)
    assert settings.warnings == ()
    modes = {"base": "disabled", "dry-run": "dry_run", "live": "live", "two-namespaces": "disabled"}
    assert settings.mode == modes[which]


def test_base_configmap_is_disabled_and_dry_run(base_objects: list[Obj]) -> None:
    data = configmap_data(base_objects)
    assert config.ENABLED.parse(data[ENABLED]) is False
    assert config.DRY_RUN.parse(data[DRY_RUN]) is True


def test_configmap_holds_no_secret(base_objects: list[Obj]) -> None:
    data = configmap_data(base_objects)
    secret_names = {v.name for v in config.VARIABLES if v.secret}
    assert not set(data) & secret_names
    assert not any("://" in value and "@" in value for value in data.values())


# --- Service, PDB, NetworkPolicy, Namespace ---------------------------------------------------


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_metrics_service_and_pdb_select_the_controller_pods(base_objects: list[Obj]) -> None:
    deployment = only(base_objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    service = only(base_objects, "Service")
    assert selects(service["spec"]["selector"], pod_labels)
    port_names = {p["name"] for p in container(deployment)["ports"]}
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["metrics"]
    assert "metrics" in port_names
    pdb = only(base_objects, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    assert 1 <= pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]


def test_network_policy_allows_only_dns_api_server_and_postgres_egress(
    base_objects: list[Obj],
) -> None:
    deployment = only(base_objects, "Deployment")
    policy = only(base_objects, "NetworkPolicy")
    spec = policy["spec"]
    assert selects(
        spec["podSelector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"]
    )
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
    egress = {(p["protocol"], p["port"]) for rule in spec["egress"] for p in rule["ports"]}
    assert egress == {("UDP", 53), ("TCP", 53), ("TCP", 443), ("TCP", 6443), ("TCP", 5432)}
    assert all("ports" in rule for rule in spec["egress"]), (
        "an egress rule without ports allows all"
    )
    ingress = {(p["protocol"], p["port"]) for rule in spec["ingress"] for p in rule["ports"]}
    assert ingress == {("TCP", container(deployment)["ports"][0]["containerPort"])}

    # Only Prometheus's namespace may scrape: every ingress rule names its peers, and those are
    # the namespace `monitoring` (by the label each namespace carries with its own name).
    assert [rule["from"] for rule in spec["ingress"]] == [
        [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    ]


def test_controller_namespace_enforces_restricted_pod_security(base_objects: list[Obj]) -> None:
    namespace = only(base_objects, "Namespace")
    assert (
        namespace["metadata"]["name"] == only(base_objects, "Deployment")["metadata"]["namespace"]
    )
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# --- overlays -------------------------------------------------------------------------------


def normalise(objects: list[Obj]) -> dict[tuple[str, str, str], Obj]:
    """Objects keyed by identity, with the generated ConfigMap's hash suffix removed."""
    cm_name = only(objects, "ConfigMap")["metadata"]["name"]
    plain = re.sub(r"-[a-z0-9]{10}$", "", cm_name)
    out = {}
    for obj in copy.deepcopy(objects):
        if obj["kind"] == "ConfigMap":
            obj["metadata"]["name"] = plain
        for source in (
            obj.get("spec", {})
            .get("template", {})
            .get("spec", {})
            .get("containers", [{}])[0]
            .get("envFrom", [])
        ):
            if source["configMapRef"]["name"] == cm_name:
                source["configMapRef"]["name"] = plain
        meta = obj["metadata"]
        out[(obj["kind"], meta.get("namespace", ""), meta["name"])] = obj
    return out


@pytest.mark.parametrize(("overlay", "dry_run"), [("dry-run", "true"), ("live", "false")])
def test_overlay_flips_exactly_enabled_and_dry_run(
    overlay: str, dry_run: str, base_objects: list[Obj], overlay_objects: dict[str, list[Obj]]
) -> None:
    base = normalise(base_objects)
    over = normalise(overlay_objects[overlay])
    assert set(base) == set(over)
    changed = [key for key in base if base[key] != over[key]]
    assert [key[0] for key in changed] == ["ConfigMap"]
    base_data, over_data = base[changed[0]]["data"], over[changed[0]]["data"]
    diff = {
        k: over_data.get(k)
        for k in base_data.keys() | over_data.keys()
        if base_data.get(k) != over_data.get(k)
    }
    expected = {ENABLED: "true"}
    if base_data[DRY_RUN] != dry_run:
        expected[DRY_RUN] = dry_run
    assert diff == expected
    assert over_data[ENABLED] == "true" and over_data[DRY_RUN] == dry_run


def test_each_mode_gets_its_own_configmap_name_so_a_switch_rolls_the_pods(
    base_objects: list[Obj], overlay_objects: dict[str, list[Obj]]
) -> None:
    names = set()
    for objects in all_renders(base_objects, overlay_objects).values():
        cm_name = only(objects, "ConfigMap")["metadata"]["name"]
        ref = container(only(objects, "Deployment"))["envFrom"][0]["configMapRef"]["name"]
        assert ref == cm_name
        names.add(cm_name)
    assert len(names) == len(all_renders(base_objects, overlay_objects))


def test_kustomization_files_never_contain_a_secret_value() -> None:
    for path in DEPLOY.rglob("*.yaml"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"postgres(ql)?://[^\s:/@]+:[^\s@]+@", text), path
        assert "kind: Secret\n" not in text, path


def test_overlays_are_listed(base_objects: list[Obj]) -> None:
    # The overlay directories on disk are exactly the ones tested above.
    on_disk = {p.parent.name for p in (DEPLOY / "overlays").glob("*/kustomization.yaml")}
    assert on_disk == set(OVERLAYS)
    assert (BASE / "kustomization.yaml").is_file()
    assert all(v is not None for v in walk(base_objects)), "a null field in the render"
