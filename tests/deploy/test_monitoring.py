"""Alerts, the ServiceMonitor and the Grafana dashboard name only what the service exports."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.domain import Outcome, Verdict
from tests.deploy.rendering import Obj, render
from tests.deploy.support import (
    MONITORING,
    ROOT,
    ExportedMetrics,
    balanced,
    only,
    promql_matchers,
    promql_metric_names,
)

REQUIRED_ALERTS = {
    "RetiredPodGcCacheNotSynced",
    "RetiredPodGcListenerDisconnected",
    "RetiredPodGcDeletesFailing",
    "RetiredPodGcReapBacklogGrowing",
    "RetiredPodGcReconcileErrors",
    "RetiredPodGcReconcileBugs",
    "RetiredPodGcRetiredPodsKept",
    "RetiredPodGcRetiredPodsKeptAnnotated",
}
SEVERITIES = {"critical", "warning", "info"}
COMPONENT = "retired-pod-gc"
INHIBIT_EQUAL = ["namespace", "component"]
# Labels Prometheus attaches from the scrape target (ServiceMonitor), not the service.
TARGET_LABELS = {"namespace", "pod", "job", "instance", "service", "container", "endpoint"}


def rules(monitoring_objects: list[Obj]) -> list[dict[str, Any]]:
    rule_obj = only(monitoring_objects, "PrometheusRule")
    return [r for group in rule_obj["spec"]["groups"] for r in group["rules"]]


def dashboard() -> dict[str, Any]:
    result: dict[str, Any] = json.loads(
        (MONITORING / "grafana-dashboard.json").read_text(encoding="utf-8")
    )
    return result


def dashboard_exprs() -> list[str]:
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            match = re.fullmatch(r"label_values\((.+),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)", query)
            assert match is not None, query
            exprs.append(match.group(1))
    return exprs


def check_expr(expr: str, exported: ExportedMetrics) -> list[str]:
    """Problems of one expression: unknown series, unknown label values, unbalanced brackets."""
    problems = []
    if not balanced(expr):
        problems.append(f"unbalanced brackets in {expr!r}")
    names = promql_metric_names(expr)
    if not names:
        problems.append(f"no series selected in {expr!r}")
    problems += [f"{n} is not exported" for n in sorted(names - exported)]
    for metric, label, op, value in promql_matchers(expr):
        if label in TARGET_LABELS or metric not in exported.labels:
            continue
        known = exported.labels[metric]
        if label not in known:
            problems.append(f"{metric} has no label {label!r}")
            continue
        if op in ("=", "=~") and "$" not in value:
            wanted = value.split("|") if op == "=~" else [value]
            problems += [
                f"{metric}{{{label}}} never has value {v!r}"
                for v in wanted
                if v not in known[label]
            ]
    return problems


# --- the checker itself ------------------------------------------------------------------------


def test_promql_name_extraction_skips_functions_keywords_labels_and_durations() -> None:
    expr = (
        'sum by (namespace, pod) (rate(foo_total{result="error", a=~"x|y"}[15m] offset 5m))'
        " / on (namespace) group_left max without (le) (bar) > 1e-9 and absent(baz_seconds_count)"
        ' + histogram_quantile(0.99, rate(q_bucket{namespace="$namespace"}[$__rate_interval]))'
    )
    assert promql_metric_names(expr) == {"foo_total", "bar", "baz_seconds_count", "q_bucket"}
    assert ("foo_total", "a", "=~", "x|y") in promql_matchers(expr)


def test_checker_flags_unknown_series_labels_and_values(
    exported_metric_names: ExportedMetrics,
) -> None:
    assert check_expr("retired_pod_gc_cache_synced == 0", exported_metric_names) == []
    assert check_expr("retired_pod_gc_cache_sync == 0", exported_metric_names) == [
        "retired_pod_gc_cache_sync is not exported"
    ]
    # A counter is exported with its _total suffix only.
    assert check_expr("rate(retired_pod_gc_deletes[5m])", exported_metric_names) != []
    assert check_expr('retired_pod_gc_deletes_total{result="eror"}', exported_metric_names) != []
    assert check_expr('retired_pod_gc_deletes_total{reason="error"}', exported_metric_names) != []
    assert check_expr("sum(rate(retired_pod_gc_deletes_total[5m])", exported_metric_names) != []


def test_exported_names_include_unchilded_labelled_families_and_histogram_series(
    exported_metric_names: ExportedMetrics,
) -> None:
    assert "retired_pod_gc_watch_restarts_total" in exported_metric_names
    assert "retired_pod_gc_reconcile_duration_seconds_bucket" in exported_metric_names
    assert "retired_pod_gc_reconcile_duration_seconds" not in exported_metric_names
    verdicts = exported_metric_names.labels["cluster_reconciler_outcome_total"]["verdict"]
    assert verdicts == {str(v) for v in Verdict} | {
        str(o) for o in Outcome if o is not Outcome.INACTIVE
    }


# --- PrometheusRule -----------------------------------------------------------------------------


def test_prometheus_rule_has_the_required_alerts(monitoring_objects: list[Obj]) -> None:
    names = [r["alert"] for r in rules(monitoring_objects)]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert set(names) >= REQUIRED_ALERTS


def test_every_alert_is_complete(monitoring_objects: list[Obj]) -> None:
    operations = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#{1,6} (.+)$", operations, flags=re.MULTILINE)
    }
    for rule in rules(monitoring_objects):
        assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        # The label the inhibition matches on, beside the target's namespace.
        assert rule["labels"]["component"] == COMPONENT, rule["alert"]
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], rule["alert"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        if "keep_firing_for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["keep_firing_for"]), rule["alert"]
        # Every alert links to its section of the runbook (the one base URL of runbook.yaml, the
        # anchor of the alert's heading), and that section exists.
        assert set(annotations) == {"summary", "description", "runbook_url"}, rule["alert"]
        assert annotations["runbook_url"] == f"{runbook_base()}#{rule['alert'].lower()}"
        assert rule["alert"].lower() in anchors, f"docs/operations.md lacks ### {rule['alert']}"


def runbook_base(monitoring: Path = MONITORING) -> str:
    """The runbook URL set in deploy/monitoring/runbook.yaml (kept out of the rendered output)."""
    source = yaml.safe_load((monitoring / "runbook.yaml").read_text(encoding="utf-8"))
    assert source["metadata"]["annotations"] == {"config.kubernetes.io/local-config": "true"}
    url: str = source["data"]["url"]
    assert url.startswith("https://") and url.endswith("/docs/operations.md"), url
    return url


def test_the_runbook_url_is_set_in_one_place(tmp_path: Path) -> None:
    # Changing runbook.yaml alone moves every alert's link; nothing else names the base.
    copy = tmp_path / "monitoring"
    shutil.copytree(MONITORING, copy)
    elsewhere = "https://runbooks.example.org/gc/docs/operations.md"
    runbook = copy / "runbook.yaml"
    runbook.write_text(runbook.read_text().replace(runbook_base(), elsewhere))
    objects = render(copy)
    assert "retired-pod-gc-runbook" not in {o["metadata"]["name"] for o in objects}
    urls = {r["alert"]: r["annotations"]["runbook_url"] for r in rules(objects)}
    assert urls == {alert: f"{elsewhere}#{alert.lower()}" for alert in urls}
    assert runbook_base() not in (copy / "prometheusrule.yaml").read_text()


def test_every_alert_expression_names_only_exported_series(
    monitoring_objects: list[Obj], exported_metric_names: ExportedMetrics
) -> None:
    problems = {
        rule["alert"]: check_expr(rule["expr"], exported_metric_names)
        for rule in rules(monitoring_objects)
    }
    assert {k: v for k, v in problems.items() if v} == {}


def test_outcome_alerts_select_the_service_loop(monitoring_objects: list[Obj]) -> None:
    for rule in rules(monitoring_objects):
        for metric, label, _op, value in promql_matchers(rule["expr"]):
            if metric == "cluster_reconciler_outcome_total" and label == "loop":
                assert value == "retired_execution_pod_gc"


def test_service_monitor_scrapes_the_metrics_service(
    monitoring_objects: list[Obj], base_objects: list[Obj]
) -> None:
    monitor = only(monitoring_objects, "ServiceMonitor")
    service = only(base_objects, "Service")
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    labels = service["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert "metrics" in port_names
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


# --- Grafana dashboard --------------------------------------------------------------------------


def test_dashboard_is_well_formed() -> None:
    board = dashboard()
    assert board["uid"] == "retired-pod-gc"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        ref_ids = [t["refId"] for t in panel.get("targets", [])]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        if panel["type"] != "row":
            assert ref_ids, f"panel {panel['title']!r} has no query"


def test_every_dashboard_query_names_only_exported_series(
    exported_metric_names: ExportedMetrics,
) -> None:
    problems = {e: check_expr(e, exported_metric_names) for e in dashboard_exprs()}
    assert {k: v for k, v in problems.items() if v} == {}


@pytest.mark.parametrize("mode", ["live", "dry_run"])
def test_dashboard_shows_reaps_of_both_modes_by_verdict(mode: str) -> None:
    # The rollout compares dry-run would-reaps per verdict: the dashboard must not filter a mode
    # out.
    outcome_exprs = [e for e in dashboard_exprs() if "cluster_reconciler_outcome_total" in e]
    assert outcome_exprs
    for expr in outcome_exprs:
        assert "by (mode, verdict)" in expr
        for _metric, label, _op, value in promql_matchers(expr):
            assert label != "mode" or mode in value


def test_dashboard_configmap_carries_the_json_and_the_sidecar_label(
    monitoring_objects: list[Obj],
) -> None:
    cm = only(monitoring_objects, "ConfigMap")
    assert cm["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert json.loads(cm["data"]["retired-pod-gc.json"]) == dashboard()


# --- Alertmanager inhibition --------------------------------------------------------------------


def _matcher(text: str) -> tuple[str, str, str]:
    match = re.fullmatch(r'([a-z_]+)(=~|=)"(.*)"', text)
    assert match is not None, text
    name, op, value = match.groups()
    return name, op, value


def inhibit_rules() -> list[dict[str, Any]]:
    """deploy/monitoring/alertmanager-inhibit.yaml's rules, as (source, target, equal) matchers."""
    fragment = yaml.safe_load((MONITORING / "alertmanager-inhibit.yaml").read_text("utf-8"))
    assert set(fragment) == {"inhibit_rules"}
    rules_: list[dict[str, Any]] = fragment["inhibit_rules"]
    return rules_


def _alertnames(matchers: list[tuple[str, str, str]], names: set[str]) -> set[str]:
    (matcher,) = matchers
    name, op, value = matcher
    assert name == "alertname"
    return {n for n in names if (re.fullmatch(value, n) if op == "=~" else n == value)}


def _am_matcher(name: str, op: str, value: str) -> dict[str, str]:
    """An AlertmanagerConfig matcher: equality is its default (no matchType)."""
    return {"name": name, "value": value} | ({"matchType": op} if op != "=" else {})


def test_the_alertmanagerconfig_carries_the_same_inhibition(monitoring_objects: list[Obj]) -> None:
    config = only(monitoring_objects, "AlertmanagerConfig")
    assert (
        config["metadata"]["namespace"]
        == only(monitoring_objects, "PrometheusRule")["metadata"]["namespace"]
    )
    expected = [
        {
            "sourceMatch": [
                _am_matcher(n, op, v) for n, op, v in map(_matcher, rule["source_matchers"])
            ],
            "targetMatch": [
                _am_matcher(n, op, v) for n, op, v in map(_matcher, rule["target_matchers"])
            ],
            "equal": rule["equal"],
        }
        for rule in inhibit_rules()
    ]
    assert config["spec"] == {"inhibitRules": expected}


def test_every_inhibition_pairs_alerts_that_carry_the_labels_it_matches_on(
    monitoring_objects: list[Obj],
) -> None:
    by_name = {r["alert"]: r for r in rules(monitoring_objects)}
    names = set(by_name)
    muted: set[str] = set()
    for rule in inhibit_rules():
        assert rule["equal"] == INHIBIT_EQUAL
        sources = _alertnames([_matcher(m) for m in rule["source_matchers"]], names)
        targets = _alertnames([_matcher(m) for m in rule["target_matchers"]], names)
        # Every name a matcher lists exists (a renamed alert would silently stop matching).
        for matcher in (*rule["source_matchers"], *rule["target_matchers"]):
            listed = set(_matcher(matcher)[2].split("|"))
            assert listed <= names, listed - names
        assert len(sources) == 1 and targets and not sources & targets
        (source,) = sources
        # The cause pages; each alert it mutes keeps namespace in its aggregation, as the
        # source does (an alert without the label is never matched by `equal`).
        assert by_name[source]["labels"]["severity"] in {"warning", "critical"}
        for alert in (source, *targets):
            expr = by_name[alert]["expr"]
            outer = re.findall(r"\b(?:max|min|sum) by \(([a-z_, ]+)\)", expr)
            assert outer and all("namespace" in group for group in outer), alert
        muted |= targets
    # The causes that page are never muted themselves.
    assert not muted & {"RetiredPodGcDatabaseDown", "RetiredPodGcApiUnreachable"}
