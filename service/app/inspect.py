"""Operator commands that look without acting: ``scan`` (every pod, now) and ``explain`` (one pod).

Both classify with the same pure function the controller uses, against rows read the same way,
so their verdicts are the controller's verdicts minus the observation clock (which lives in the
running leader's memory: "reapable" here means "would start or continue a clock").
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
from msgspec import structs

from service.app.pending import utc
from service.classifier import classify, prefilter
from service.config import Settings
from service.domain import (
    KEEP_ANNOTATION,
    Decision,
    ExecutionRow,
    PodSnapshot,
    SkipReason,
    split_key,
)
from service.engine.kept.model import kept_decision, severity_of
from service.kube.client import KubePodClient
from service.kube.informer import MultiNamespaceInformer
from service.ports import ExecutionStore, RetiredRow, RetiredRowSource


@dataclass
class ScanReport:
    namespaces: list[str]
    """Every configured sandbox namespace, in the order configured."""
    pods: int
    """Pods listed, all namespaces together."""
    pods_by_namespace: dict[str, int] = field(default_factory=dict)
    verdicts: dict[str, int] = field(default_factory=dict)
    skips: dict[str, int] = field(default_factory=dict)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    retired_kept_by_reason: dict[str, int] = field(default_factory=dict)
    """Retired but kept (``service/engine/kept/``), counted by the classifier's reason."""
    retired_kept: list[dict[str, Any]] = field(default_factory=list)
    """Every pod whose execution row is retired but that is kept, the longest retired first."""


async def list_pods(informer: MultiNamespaceInformer, *, timeout_s: float) -> list[PodSnapshot]:
    """One list of every sandbox namespace through the informers' own code path, then stop."""
    # The deadline wraps the task group, or its TimeoutError would reach an ExceptionGroup.
    with anyio.fail_after(timeout_s):
        async with anyio.create_task_group() as tg:
            await tg.start(informer.run)
            await informer.wait_synced()
            tg.cancel_scope.cancel()
    return [pod for key in list(informer.keys()) if (pod := informer.get(key)) is not None]


def retired_kept_entry(pod: PodSnapshot, retired: RetiredRow, now: float) -> dict[str, Any] | None:
    """The scan's entry of a pod whose row is retired, when the classifier keeps it; else
    ``None``. Since when is the row's ``retired_at`` (``None`` when the column is NULL)."""
    decision = kept_decision(pod, retired.row)
    if decision is None or decision.reason is None:
        return None
    since = retired.retired_at_s
    return {
        "pod": pod.key,
        "uid": pod.uid,
        "reason": str(decision.reason),
        "severity": severity_of(decision.reason),
        "phase": str(pod.phase),
        "row_state": str(retired.row.state),
        "retired_at": None if since is None else utc(since, fraction=False),
        "kept_for_s": None if since is None else round(max(0.0, now - since)),
        "rule": decision.rule,
    }


async def scan_retired_kept(
    settings: Settings, *, pods: list[PodSnapshot], rows: RetiredRowSource, report: ScanReport
) -> None:
    """Fill ``report``'s retired-but-kept section: one row query a namespace, as the sweep."""
    now = time.time()  # noqa: TID251 (wall clock: retired_at is wall time)
    entries: list[dict[str, Any]] = []
    for namespace in settings.kube.namespaces:
        mine = {pod.key: pod for pod in pods if pod.namespace == namespace}
        found = await rows.retired_rows(namespace, [pod.name for pod in mine.values()], kind="scan")
        entries += filter(
            None, (retired_kept_entry(mine[k], r, now) for k, r in found.items() if k in mine)
        )
    entries.sort(key=lambda e: (-(e["kept_for_s"] or 0), str(e["pod"])))
    report.retired_kept = entries
    report.retired_kept_by_reason = dict(sorted(Counter(str(e["reason"]) for e in entries).items()))


async def scan(
    settings: Settings,
    *,
    pods: list[PodSnapshot],
    store: ExecutionStore,
    retired: RetiredRowSource | None = None,
) -> ScanReport:
    namespaces = list(settings.kube.namespaces)
    by_namespace = Counter(pod.namespace for pod in pods)
    report = ScanReport(
        namespaces=namespaces,
        pods=len(pods),
        pods_by_namespace={ns: by_namespace.get(ns, 0) for ns in namespaces},
    )
    early = {pod.key: prefilter(pod) for pod in pods}
    decisions = {key: decision for key, decision in early.items() if decision is not None}
    need_rows = [pod for pod in pods if early[pod.key] is None]
    rows = await store.lookup_many([p.key for p in need_rows])
    now = time.time()  # noqa: TID251 (wall clock: pod ages from their wall timestamps)
    for pod in need_rows:
        decision = classify(pod, rows.get(pod.key))
        decisions[pod.key] = decision
        if decision.verdict is not None:
            report.candidates.append(
                {
                    "pod": pod.key,
                    "uid": pod.uid,
                    "verdict": str(decision.verdict),
                    "phase": str(pod.phase),
                    "age_s": None if pod.created_at_s is None else round(now - pod.created_at_s),
                    "rule": decision.rule,
                }
            )
    verdicts = Counter(str(d.verdict) for d in decisions.values() if d.verdict is not None)
    skips = Counter(str(d.reason) for d in decisions.values() if d.reason is not None)
    report.verdicts = dict(sorted(verdicts.items()))
    report.skips = dict(sorted(skips.items()))
    report.candidates.sort(key=lambda c: str(c["pod"]))
    if retired is not None:
        await scan_retired_kept(settings, pods=pods, rows=retired, report=report)
    return report


def scan_lines(report: ScanReport) -> list[str]:
    """The scan report as ``scan`` prints it: counts by namespace, verdict and skip reason, the
    candidates, then the retired-but-kept pods."""
    lines = [f"namespace {ns}: {count} pods" for ns, count in report.pods_by_namespace.items()]
    for heading, counts in (
        ("reapable shapes (a clock would run; deletion after the threshold):", report.verdicts),
        ("skipped, by reason:", report.skips),
    ):
        lines.append(heading)
        lines += [f"  {name:<34} {count}" for name, count in (counts or {"(none)": 0}).items()]
    if report.candidates:
        lines.append("candidates:")
        lines += [
            f"  {c['pod']:<50} {c['verdict']:<24} age {c['age_s']}s" for c in report.candidates
        ]
    lines.append(
        f"retired but kept (execution retired, pod kept; docs/operations.md): "
        f"{len(report.retired_kept)} pods"
    )
    lines += [f"  {reason:<34} {count}" for reason, count in report.retired_kept_by_reason.items()]
    for k in report.retired_kept:
        since = k["retired_at"] or "retired_at unknown"
        lines.append(
            f"  {k['pod']:<50} {k['reason']:<34} {k['severity']:<8} {k['row_state']} since {since}"
        )
    return lines


@dataclass
class Explanation:
    key: str
    pod: PodSnapshot | None
    row: ExecutionRow | None
    decision: Decision | None
    threshold_s: float
    mode: str
    retired_kept: dict[str, Any] | None = None
    """The pod's retired-but-kept entry (:func:`retired_kept_entry`), when it is one."""


class NamespaceNotConfigured(ValueError):
    """``explain`` was asked about a pod of a namespace the controller never acts on."""


async def explain(
    settings: Settings,
    *,
    key: str,
    pods: KubePodClient,
    store: ExecutionStore,
    rows: RetiredRowSource | None = None,
) -> Explanation:
    namespace, name = split_key(key)
    if namespace not in settings.kube.namespaces:
        raise NamespaceNotConfigured(
            f"namespace {namespace!r} is not a configured sandbox namespace "
            f"({', '.join(settings.kube.namespaces)}): the controller never acts on it"
        )
    with anyio.fail_after(settings.kube.api_timeout_s):
        pod = await pods.get_pod(namespace, name)
    with anyio.fail_after(settings.database.statement_timeout_s):
        row = await store.read_fresh(key)
    kept = None
    if rows is not None and pod is not None and row is not None and not row.active:
        with anyio.fail_after(settings.database.statement_timeout_s):
            retired = (await rows.retired_rows(namespace, [name], kind="scan")).get(key)
        if retired is not None:
            kept = retired_kept_entry(pod, retired, time.time())  # noqa: TID251 (wall time)
    decision = None if pod is None else classify(pod, row)
    return Explanation(key, pod, row, decision, settings.threshold_s, settings.mode, kept)


def explanation_lines(exp: Explanation) -> list[str]:
    lines = [f"pod {exp.key}"]
    if exp.pod is None:
        lines.append("  not found in the API server: nothing to do")
    else:
        for name, value in structs.asdict(exp.pod).items():
            # A Unix time (``created_at_s``) as a UTC time (``created_at``).
            wall = name.endswith("_at_s") and isinstance(value, int | float)
            shown = (name[:-2], utc(value, fraction=False)) if wall else (name, value)
            lines.append("  pod.{:<26} {}".format(*shown))
    if exp.row is None:
        lines.append("  execution row: none in this namespace among Kubernetes-managed sandboxes")
    else:
        lines += [f"  row.{name:<26} {value}" for name, value in structs.asdict(exp.row).items()]
    if exp.decision is not None:
        outcome = "REAPABLE" if exp.decision.reapable else "skip"
        lines += [f"decision: {outcome} {exp.decision.label}", f"  rule: {exp.decision.rule}"]
        if exp.decision.reason is SkipReason.KEEP_ANNOTATION:
            namespace, name = split_key(exp.key)
            lines.append(
                f"  kept until: kubectl annotate pod -n {namespace} {name} {KEEP_ANNOTATION}- "
                "(a full threshold of observation starts then)"
            )
        if exp.decision.reapable:
            lines.append(
                f"  the running leader deletes it after {exp.threshold_s:g}s of continuous "
                f"observation in this shape (mode now: {exp.mode})"
            )
    kept = exp.retired_kept
    if kept is not None:
        since = kept["retired_at"] or "an unknown time (retired_at is NULL)"
        lines.append(
            f"retired but kept: {kept['reason']} (severity {kept['severity']}): the execution "
            f"is retired ({kept['row_state']}) since {since} but nothing will delete this pod; "
            f'see docs/operations.md, "Retired but kept", {kept["reason"]}'
        )
    return lines
