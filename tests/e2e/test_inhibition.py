"""The shipped inhibition (deploy/monitoring/alertmanager-inhibit.yaml) in Debian's real
Alertmanager, rule by rule: for every inhibit rule and every shipped alert its matchers select, a
firing source and a target are posted through Alertmanager's API with exactly the labels
Prometheus gives them (deploy/monitoring/prometheusrule.yaml: the alert's name, the rule's labels,
the labels its expression keeps), and Alertmanager's own answer (``/api/v2/alerts``) must say the
target is inhibited by that source, while the same target in another namespace is not, and neither
once the source is resolved.

One Alertmanager serves every pair at once: each pair gets a namespace of its own, so pairs never
touch one another. Source and target differ in every label but ``namespace`` and ``component``
(another replica, another sandbox namespace), as the alerts of one installation do.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest

from .harness import REPO_ROOT, free_port
from .monitoring import alertmanager, get_json, shipped_alert_rules, shipped_inhibit_rules

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

SETTLE_S = 20.0
"""Only a bound on an Alertmanager that never reports the expected state."""
LEADING_AGGREGATION = re.compile(r"\s*(?:max|min|sum) by \(([a-z_, ]+)\)")
BARE_ABSENT = re.compile(r"\s*absent\([a-z_]+\)\s*")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)(=~|!~|!=|=)"(.*)"')

Labels = dict[str, str]


def alert_labels(rule: dict[str, Any], *, namespace: str, side: str) -> Labels:
    """The labels of an alert of ``rule`` as Prometheus sends it: its name, the rule's labels and
    the labels its expression keeps, those of its leading aggregation (a vector ``/``, a comparison,
    ``and`` and ``unless`` keep the left-hand side's; no shipped rule copies labels from the right;
    ``absent`` of a bare metric keeps none). ``namespace`` is the installation's; every other kept
    label gets a value of ``side``'s."""
    expr = rule["expr"]
    assert "group_right" not in expr and not re.search(r"group_left\s*\(", expr), rule["alert"]
    leading = LEADING_AGGREGATION.match(expr)
    if leading is None:
        assert BARE_ABSENT.fullmatch(expr), f"{rule['alert']}: which labels does {expr!r} keep?"
    kept = [] if leading is None else [name.strip() for name in leading.group(1).split(",")]
    values = {name: namespace if name == "namespace" else f"{name}-{side}" for name in kept}
    return {"alertname": rule["alert"], **rule["labels"], **values}


def matches(matcher: str, labels: Labels) -> bool:
    """Alertmanager's matcher semantics (an absent label is the empty string; regexes anchored)."""
    parsed = MATCHER.fullmatch(matcher)
    assert parsed is not None, matcher
    name, op, value = parsed.groups()
    tests: dict[str, Callable[[str], bool]] = {
        "=": lambda v: v == value,
        "!=": lambda v: v != value,
        "=~": lambda v: re.fullmatch(value, v) is not None,
        "!~": lambda v: re.fullmatch(value, v) is None,
    }
    return tests[op](labels.get(name, ""))


@dataclass(frozen=True)
class Pair:
    """One inhibit rule's source and one of its targets, in a namespace of their own."""

    rule: int
    source: Labels
    target: Labels
    control: Labels
    """The target in a namespace with no source: never inhibited."""

    def __str__(self) -> str:
        return f"rule {self.rule}: {self.source['alertname']} -> {self.target['alertname']}"


def pairs() -> list[Pair]:
    """Every (source, target) of every shipped inhibit rule, from the shipped alerts' labels."""
    alerts = shipped_alert_rules()
    out: list[Pair] = []
    for index, inhibit in enumerate(shipped_inhibit_rules()):

        def selected(side: str, inhibit: dict[str, Any] = inhibit) -> list[dict[str, Any]]:
            return [
                a
                for a in alerts
                if all(
                    matches(m, alert_labels(a, namespace="x", side="x"))
                    for m in inhibit[f"{side}_matchers"]
                )
            ]

        sources, targets = selected("source"), selected("target")
        assert sources and targets, f"inhibit rule {index} selects no shipped alert"
        for source in sources:
            for target in targets:
                namespace = f"gc-{len(out)}"
                out.append(
                    Pair(
                        rule=index,
                        source=alert_labels(source, namespace=namespace, side="source"),
                        target=alert_labels(target, namespace=namespace, side="target"),
                        control=alert_labels(target, namespace=f"{namespace}-other", side="target"),
                    )
                )
    return out


def _documented() -> set[tuple[str, str]]:
    """(source, target) as docs/operations.md's table of alerts gives them ("inhibited by")."""
    text = (REPO_ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (RetiredPodGc\w+) \| \w+ \| (?:yes|no) \| (.+) \|$", text, re.MULTILINE)
    assert rows
    return {
        (f"RetiredPodGc{source}", target)
        for target, sources in rows
        if not sources.startswith("—")
        for source in sources.split(", ")
    }


def test_the_pairs_are_those_the_operations_guide_promises() -> None:
    listed = pairs()
    assert {p.rule for p in listed} == set(range(len(shipped_inhibit_rules())))
    assert {(p.source["alertname"], p.target["alertname"]) for p in listed} == _documented()


def _config() -> dict[str, Any]:
    return {
        "route": {"receiver": "none", "group_by": ["alertname", "namespace"]},
        "receivers": [{"name": "none"}],
        "inhibit_rules": shipped_inhibit_rules(),
    }


async def _post(url: str, alerts: list[dict[str, Any]]) -> None:
    timeout = aiohttp.ClientTimeout(total=5)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(url + "/api/v2/alerts", json=alerts) as response,
    ):
        assert response.status == 200, (response.status, await response.text())


def _key(labels: Labels) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


async def _settled(
    url: str, expect: Callable[[dict[tuple[tuple[str, str], ...], dict[str, Any]]], list[str]]
) -> None:
    """Poll Alertmanager's alerts until ``expect`` finds nothing wrong with them."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        listed = await get_json(url + "/api/v2/alerts")
        wrong = expect({_key(a["labels"]): a for a in listed})
        if not wrong:
            return
        if time.monotonic() >= deadline:
            raise AssertionError("\n".join(wrong))
        await anyio.sleep(0.1)


def _state(alert: dict[str, Any] | None) -> str:
    if alert is None:
        return "absent"
    status = alert["status"]
    return f"{status['state']} inhibitedBy={status['inhibitedBy']}"


async def test_each_shipped_inhibit_rule_mutes_its_targets_in_the_same_namespace_only(
    tmp_path: Path,
) -> None:
    listed = pairs()
    with alertmanager(tmp_path / "alertmanager", _config(), free_port()) as url:
        # No startsAt/endsAt: Alertmanager starts them now and keeps them its resolve_timeout.
        await _post(
            url,
            [{"labels": labels} for p in listed for labels in (p.source, p.target, p.control)],
        )

        def inhibited(alerts: dict[tuple[tuple[str, str], ...], dict[str, Any]]) -> list[str]:
            wrong = []
            for p in listed:
                source, target, control = (
                    alerts.get(_key(x)) for x in (p.source, p.target, p.control)
                )
                if source is None or source["status"]["state"] != "active":
                    wrong.append(f"{p}: source {_state(source)}")
                    continue
                if target is None or source["fingerprint"] not in target["status"]["inhibitedBy"]:
                    wrong.append(f"{p}: target {_state(target)}, not inhibited by the source")
                if control is None or control["status"]["state"] != "active":
                    wrong.append(f"{p}: the target of another namespace {_state(control)}")
            return wrong

        await _settled(url, inhibited)

        # The sources resolved (ended when they started, Alertmanager's own time): no target
        # stays muted.
        alerts = {_key(a["labels"]): a for a in await get_json(url + "/api/v2/alerts")}
        await _post(
            url,
            [
                {"labels": p.source, "startsAt": start, "endsAt": start}
                for p in listed
                for start in [alerts[_key(p.source)]["startsAt"]]
            ],
        )

        def released(alerts: dict[tuple[tuple[str, str], ...], dict[str, Any]]) -> list[str]:
            wrong = []
            for p in listed:
                if _key(p.source) in alerts:
                    wrong.append(f"{p}: source still listed after it was resolved")
                target = alerts.get(_key(p.target))
                if target is None or target["status"]["state"] != "active":
                    wrong.append(f"{p}: target {_state(target)} after the source was resolved")
            return wrong

        await _settled(url, released)
