"""The alerts' expressions evaluated by Prometheus's own ``promtool test rules``.

The rule groups are taken from deploy/monitoring/prometheusrule.yaml as written (the source file,
not a copy), and fed series shaped as the service exports them (``service/engine/kept.py``: the
leader's age of the oldest retired-but-kept pod of each reason, and ``KEPT_BOUND_SECONDS``).
promtool is Debian's ``prometheus`` package (``make promtool`` installs it).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.support import MONITORING

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
NAMESPACE = "retired-pod-gc"
LEADER = "retired-pod-gc-0"
FOLLOWER = "retired-pod-gc-1"


def _rule_groups() -> dict[str, Any]:
    source = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text(encoding="utf-8"))
    return {"groups": source["spec"]["groups"]}


def _series(name: str, values: str, pod: str = LEADER, **labels: str) -> dict[str, str]:
    shown = ",".join(
        f'{k}="{v}"' for k, v in {"namespace": NAMESPACE, "pod": pod, **labels}.items()
    )
    return {"series": f"{name}{{{shown}}}", "values": values}


def _oldest(reason: str, values: str, pod: str = LEADER) -> dict[str, str]:
    return _series("retired_pod_gc_retired_kept_oldest_seconds", values, pod, reason=reason)


def _bound(seconds: int, pod: str = LEADER) -> dict[str, str]:
    return _series("retired_pod_gc_retired_kept_bound_seconds", f"{seconds}x60", pod)


def _alert(reason: str, severity: str, summary: str, runbook: str) -> dict[str, Any]:
    return {
        "exp_labels": {
            "namespace": NAMESPACE,
            "pod": LEADER,
            "reason": reason,
            "severity": severity,
            "component": "retired-pod-gc",
        },
        "exp_annotations": {"summary": summary, "description": _description(runbook)},
    }


def _description(alert: str) -> str:
    for group in _rule_groups()["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                return str(rule["annotations"]["description"])
    raise AssertionError(alert)


def _run(tmp_path: Path, tests: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(_rule_groups()), encoding="utf-8")
    spec = tmp_path / "test.yaml"
    spec.write_text(
        yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests}),
        encoding="utf-8",
    )
    return subprocess.run(
        [PROMTOOL, "test", "rules", spec.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _with_runbook(expected: list[dict[str, Any]], alert: str) -> list[dict[str, Any]]:
    for entry in expected:
        entry["exp_annotations"]["runbook_url"] = f"docs/operations.md#{alert.lower()}"
    return expected


def _kept_tests() -> list[dict[str, Any]]:
    kept = "RetiredPodGcRetiredPodsKept"
    annotated = "RetiredPodGcRetiredPodsKeptAnnotated"
    # The leader's oldest Running pod of a retired execution ages a minute a minute from 0; the
    # follower exports zeros; a pending_restore_pod is shown on the dashboard but not alerted.
    series = [
        _oldest("pod_running", "0+60x59"),
        _oldest("pod_running", "0x59", FOLLOWER),
        _oldest("keep_annotation", "0+60x59"),
        _oldest("pending_restore_pod", "0+60x59"),
        _oldest("terminal_container_not_terminated", "0x59"),
        _bound(1800),
        _bound(1800, FOLLOWER),
    ]
    return [
        {
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {"eval_time": "29m", "alertname": kept, "exp_alerts": []},
                {"eval_time": "29m", "alertname": annotated, "exp_alerts": []},
                {
                    "eval_time": "31m",
                    "alertname": kept,
                    "exp_alerts": _with_runbook(
                        [
                            _alert(
                                "pod_running",
                                "warning",
                                "pod_running: a pod whose execution is retired has been kept "
                                "for 31m 0s.",
                                kept,
                            )
                        ],
                        kept,
                    ),
                },
                {
                    "eval_time": "31m",
                    "alertname": annotated,
                    "exp_alerts": _with_runbook(
                        [
                            _alert(
                                "keep_annotation",
                                "info",
                                "A pod kept by the keep annotation outlived its retired "
                                "execution by 31m 0s.",
                                annotated,
                            )
                        ],
                        annotated,
                    ),
                },
            ],
        },
        {
            # A bound of 10 minutes (KEPT_BOUND_SECONDS=600): the alert follows the setting.
            "interval": "1m",
            "input_series": [_oldest("row_inconsistent", "0+60x59"), _bound(600)],
            "alert_rule_test": [
                {"eval_time": "9m", "alertname": kept, "exp_alerts": []},
                {
                    "eval_time": "11m",
                    "alertname": kept,
                    "exp_alerts": _with_runbook(
                        [
                            _alert(
                                "row_inconsistent",
                                "warning",
                                "row_inconsistent: a pod whose execution is retired has been "
                                "kept for 11m 0s.",
                                kept,
                            )
                        ],
                        kept,
                    ),
                },
            ],
        },
    ]


@pytest.fixture(scope="module")
def promtool() -> str:
    if not Path(PROMTOOL).exists():
        pytest.fail("promtool is not installed: run 'make promtool' (apt-get install prometheus)")
    return PROMTOOL


def test_the_retired_but_kept_alerts_fire_past_the_bound_at_their_severity(
    promtool: str, tmp_path: Path
) -> None:
    result = _run(tmp_path, _kept_tests())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_rule_test_fails_when_the_alert_would_not_fire(promtool: str, tmp_path: Path) -> None:
    # The same expectations against a bound that is never reached: promtool must say so (the
    # rule test above can fail).
    tests = _kept_tests()
    for test in tests:
        for entry in test["input_series"]:
            if "bound_seconds" in entry["series"]:
                entry["values"] = "100000x60"
    result = _run(tmp_path, tests)
    assert result.returncode != 0
    assert "FAILED" in result.stdout + result.stderr


def _unreachable_tests(minutes_down: int) -> list[dict[str, Any]]:
    alert = "RetiredPodGcApiUnreachable"
    # The leader's gauge drops to 0 at minute 2 for ``minutes_down`` minutes; the follower's stays
    # 1 but for one minute (a blip, shorter than the alert's 5 minutes).
    down = f"1x1 0x{minutes_down - 1} 1x20"
    return [
        {
            "interval": "1m",
            "input_series": [
                _series("retired_pod_gc_api_reachable", down),
                _series("retired_pod_gc_api_reachable", "1x3 0 1x20", FOLLOWER),
            ],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": alert, "exp_alerts": []},
                {
                    "eval_time": "8m",
                    "alertname": alert,
                    "exp_alerts": _with_runbook(
                        [
                            {
                                "exp_labels": {
                                    "namespace": NAMESPACE,
                                    "pod": LEADER,
                                    "severity": "warning",
                                    "component": "retired-pod-gc",
                                },
                                "exp_annotations": {
                                    "summary": f"{LEADER}: the Kubernetes API server has not "
                                    "answered for 5 minutes.",
                                    "description": _description(alert),
                                },
                            }
                        ],
                        alert,
                    ),
                },
            ],
        }
    ]


def test_the_unreachable_alert_fires_after_five_minutes_without_an_answer(
    promtool: str, tmp_path: Path
) -> None:
    result = _run(tmp_path, _unreachable_tests(minutes_down=10))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    # Four minutes down (back before the alert's five): the same expectations fail.
    result = _run(tmp_path, _unreachable_tests(minutes_down=4))
    assert result.returncode != 0
    assert "FAILED" in result.stdout + result.stderr
