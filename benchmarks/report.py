"""Renders ``RESULTS.md`` and the PNG plots from ``results/*.json``
(``python -m benchmarks.report``).

``RESULTS.md`` opens with one table of the current figures, one row per measured quantity, each
taken from the canonical run of its benchmark (``CANONICAL``); then one section per benchmark
with that run's tables. How each figure is measured, and what limits it, is ``NOTES.md``. A new
run becomes current when ``CANONICAL`` names it for its benchmarks; a results file no benchmark
names is not rendered.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# The run whose figures are current, per benchmark (a key of a results file).
CANONICAL: dict[str, str] = {
    "B1": "final-35",
    "B1L": "rss-after",
    "B2": "final-35",
    "B2B": "trigger",
    "B3": "final-35",
    "B4": "limit",
    "B5": "limit",
    "B6": "default",
    "B7": "trigger",
    "B7_share": "trigger",
    "B8": "kept",
    "B9": "throttled",
    "B10": "blackhole",
    "B11": "blackhole-all",
    "B13": "writers",
    "B13i": "trigger-instructions",
}

# The command of each canonical run whose results file predates ``run.py`` recording it.
COMMANDS: dict[str, str] = {
    "default": "make bench",
    "limit": "python -m benchmarks.run --pods 100000 --limit-pods 150000 --only "
    "B1L,B2,B3,B4,B5 --repeats 1 --idle-s 30 --backlog-s 30 --name limit",
    "rss-after": "python -m benchmarks.run --only B1L --limit-pods 150000 --name rss-after",
}

LABELS: dict[str, str] = {"B1L": "B1 at 150k", "B2B": "B2b", "B7_share": "B7 share"}

B13_SHIPPED = "shipped"
"""B13's variant for the trigger ``migrate`` installs; ``none`` is no trigger."""

HEADINGS: dict[str, str] = {
    "B1": "B1 cold start",
    "B1L": "B1 at the limit, by list mode",
    "B2": "B2 retirement to clock start",
    "B2B": "B2b mass retirement in one statement",
    "B3": "B3 threshold expiry to DELETE",
    "B4": "B4 idle cost",
    "B5": "B5 churn",
    "B6": "B6 decode",
    "B7": "B7 writer overhead",
    "B7_share": "B7 trigger share",
    "B8": "B8 retired but kept",
    "B9": "B9 a throttled priority level",
    "B10": "B10 a silent connection to the API server",
    "B11": "B11 every connection to the API server black-holed for 3 minutes",
    "B13": "B13 concurrent writers",
    "B13i": "B13i the writer's instructions",
}


def _f(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _ratio(base: float, event: float) -> str:
    if not event or math.isnan(event) or math.isnan(base):
        return "-"
    return f"{base / event:,.0f}x"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading (tests/unit/test_doc_links.py checks every link to one)."""
    text = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return "#" + text.replace(" ", "-")


def _started(r: dict[str, Any]) -> str:
    return str(r["started"]).removesuffix(" UTC").rsplit(":", 1)[0] + " UTC"


# --- The current figures: one row per quantity, from the benchmark's canonical run. ---------


@dataclass(frozen=True, slots=True)
class Figure:
    bench: str
    measures: str
    target: str
    value: Callable[[dict[str, Any]], str]


def _b1_largest(r: dict[str, Any]) -> dict[str, Any]:
    return max(r["B1"], key=lambda s: s["pods"])


def _by_mode(r: dict[str, Any], value: Callable[[dict[str, Any]], str]) -> str:
    short = {"streaming list": "stream", "list from the watch cache": "watch cache"}
    return ", ".join(f"{short.get(m['label'], m['label'])} {value(m)}" for m in r["B1L"]["modes"])


def _b1_sync(r: dict[str, Any]) -> str:
    s = _b1_largest(r)
    return (
        f"**{s['synced_s']:.2f} s** at {s['pods']:,} pods ({s['cpu_synced_s']:.2f} CPU-s); "
        f"caught up {s['catchup_done_s']:.2f} s"
    )


def _b1_rss(r: dict[str, Any]) -> str:
    s = _b1_largest(r)
    return f"**{s['rss_per_pod_bytes']:,.0f} B** at {s['pods']:,} pods"


def _b1l_sync(r: dict[str, Any]) -> str:
    return _by_mode(r, lambda m: f"{m['synced_s']:.1f} s ({m['cpu_synced_s']:.1f} CPU-s)")


def _b1l_rss(r: dict[str, Any]) -> str:
    return _by_mode(r, lambda m: f"**{m['rss_per_pod_bytes']:,.0f} B**")


def _b1l_relist(r: dict[str, Any]) -> str:
    return _by_mode(
        r, lambda m: f"{m['relist_peak_ratio']:.2f}x ({m['peak_rss_relist_kib'] / 1024:,.0f} MiB)"
    )


def _b1l_requests(r: dict[str, Any]) -> str:
    return _by_mode(r, lambda m: _f(m["sync"]["api_requests"]))


def _b2_one(r: dict[str, Any]) -> str:
    e, p = r["B2"]["event"]["1"], r["B2"]["baseline"].get("1", {})
    return f"**{e['p99_ms']:.1f} ms** (polling {_f(p.get('p99_ms'), 0)} ms)"


def _b2_many(r: dict[str, Any]) -> str:
    size = str(max(r["B2"]["sizes"]))
    e, p = r["B2"]["event"][size], r["B2"]["baseline"].get(size, {})
    return (
        f"**{e['all_started_s']:.2f} s** for {int(size):,} rows "
        f"(polling {_f(p.get('all_started_s'), 1)} s)"
    )


def _b2b(r: dict[str, Any]) -> str:
    e, p = r["B2B"]["event"]["10000"], r["B2B"]["baseline"].get("10000", {})
    ahead = _ratio(p.get("all_started_s", float("nan")), e["all_started_s"])
    return f"**{e['all_started_s']:.2f} s**, {ahead} ahead of polling"


def _b3(r: dict[str, Any]) -> str:
    e, p = r["B3"]["event"], r["B3"]["baseline"]
    return f"**{e['p99_ms']:.1f} ms** (polling {p['p99_ms'] / 1000:.1f} s)"


def _b3_backlog(r: dict[str, Any]) -> str:
    k = r["B3"]["backlog"]
    return (
        f"max {k['max_in_any_60s_window']} in any 60 s at a cap of {k['cap_per_min']}/min; "
        f"steady {100 * k['steady_utilisation']:.0f} % of the cap"
    )


def _b4(r: dict[str, Any]) -> str:
    e, p = r["B4"]["event"], r["B4"]["baseline"]
    return (
        f"**{e['row_queries_per_min']:,.0f}** row queries/min at {e['pods']:,} pods "
        f"(polling {p['row_queries_per_min']:,.0f}); CPU {e['cpu_percent']:.1f} % "
        f"(polling {p['cpu_percent']:.1f} %)"
    )


def _b5(r: dict[str, Any]) -> str:
    return f"**{r['B5']['highest_sustained_rate']:,.0f}** events/s sustained"


def _b6(r: dict[str, Any]) -> str:
    b = r["B6"]
    low = min(p["speedup"] for p in b["pods"])
    high = max(p["speedup"] for p in b["pods"])
    return f"median **{b['median_speedup']:,.0f}x** ({low:,.0f}-{high:,.0f}x per fixture)"


def _b7_statement(r: dict[str, Any]) -> str:
    b = r["B7"]
    v = b["variants"]["0003"]["statement_10k"]
    paired = v.get("paired_ratio_to_none")
    also = f"; paired by round {paired['median']:.2f}x" if paired else ""
    return f"**{v['ratio_to_none']:.2f}x** (ratio of medians{also}), {_f(v['notifies'])} NOTIFYs"


def _b7_one_row(r: dict[str, Any]) -> str:
    return f"{r['B7']['variants']['0003']['one_row']['ratio_to_none']:.2f}x"


def _b7_share_figure(r: dict[str, Any]) -> str:
    s = r["B7_share"]
    figures = []
    for server, res in s["servers"].items():
        cases = res.get("cases") or {str(s["rows"]): {"variants": res["variants"]}}
        for size, case in cases.items():
            ratio = case["variants"]["0003"]["statement"]["ratio_median"]
            figures.append(f"{server}, {int(size):,} sandboxes **{ratio:.2f}x**")
    return "; ".join(figures)


def _b7_share_one_row(r: dict[str, Any]) -> str:
    s = r["B7_share"]
    res = s["servers"]["debian15"]
    per = res["cases"][str(s["rows"])]["variants"]
    figures = [f"0003 **{per['0003']['one_row']['ratio_median']:.2f}x**"]
    for name, path in s.get("others", {}).items():
        if name.startswith("floor_"):
            figures.append(f"`{Path(path).name}` {per[name]['one_row']['ratio_median']:.2f}x")
    return "debian15, " + "; ".join(figures)


def _b9(r: dict[str, Any]) -> str:
    b = r["B9"]
    ctl, seq = b["controller"], b["sequential"]
    warnings = ctl["log"]["by_level"].get("WARNING", 0)
    return (
        f"**{b['controller_vs_sequential']:.2f}x** ({ctl['deletes_per_s']:.1f} against "
        f"{seq['deletes_per_s']:.1f} deletes/s); {ctl['deleted']}/{b['rows']} deleted, "
        f"{ctl['events']}/{b['rows']} Events; {ctl['answers_429']} answers 429; "
        f"{ctl['log']['lines']} log lines at info+, {warnings} of them warnings"
    )


def _b10_seconds(value: float | None) -> str:
    return "not within 400 s" if value is None else f"{value:.1f} s"


def _b10_new(r: dict[str, Any]) -> str:
    b = r["B10"]
    return (
        f"**{_b10_seconds(b['new_pod_delete_s'])}** (target {b['new_pod_target_s']:g} s); "
        f"watch restarts: silent {b['watch_restarts']['silent']:g}"
    )


def _b10_cached(r: dict[str, Any]) -> str:
    b = r["B10"]
    return (
        f"**{_b10_seconds(b['cached_pod_delete_s'])}** (target {b['cached_pod_target_s']:g} s); "
        f"pool replacements {b['pool_replacements']:g}"
    )


def _b11_restore(r: dict[str, Any]) -> str:
    b = r["B11"]
    return (
        f"**{_b10_seconds(b['restore_to_delete_s'])}** (target {b['restore_target_s']:g} s); "
        f"/readyz 503 {_b10_seconds(b['unready_after_s'])} into the outage; "
        f"{len(b['warnings'])} warning lines"
    )


def _b13_slower(mix: str) -> Callable[[dict[str, Any]], str]:
    def figure(r: dict[str, Any]) -> str:
        rows = [
            s
            for s in r["B13"]["summary"]
            if s["mix"] == mix
            and (s["variant"] == B13_SHIPPED or s["variant"].startswith("floor-"))
        ]
        by_writers: dict[int, list[str]] = {}
        for s in sorted(rows, key=lambda s: (s["writers"], s["variant"] != B13_SHIPPED)):
            label = "" if s["variant"] == B13_SHIPPED else "floor "
            by_writers.setdefault(s["writers"], []).append(f"{label}{s['slower']:.2f}x")
        return "; ".join(f"{w} writers **{', '.join(v)}**" for w, v in sorted(by_writers.items()))

    return figure


def _b13i(r: dict[str, Any]) -> str:
    res = r["B13i"]["results"]
    base, shipped = res["none"], res[B13_SHIPPED]
    return (
        f"common write **{shipped['common_per_tx'] / base['common_per_tx']:.3f}x**; "
        f"10,000-row retirement **{shipped['mass'] / base['mass']:.3f}x**"
    )


FIGURES: tuple[Figure, ...] = (
    Figure(
        "B1",
        "cold start: list complete (readiness), then every candidate reconciled",
        "synced < 5 s at 100k",
        _b1_sync,
    ),
    Figure("B1", "RSS per cached pod", "< 1 KiB", _b1_rss),
    Figure("B1L", "cold sync of 150,000 pods", "< 3 s", _b1l_sync),
    Figure("B1L", "steady RSS per cached pod at 150,000", "< 700 B", _b1l_rss),
    Figure("B1L", "relist peak RSS over steady", "< 1.5x", _b1l_relist),
    Figure("B1L", "API requests per sync at 150,000", "-", _b1l_requests),
    Figure("B2", "one retirement: COMMIT to clock started, p99", "< 50 ms", _b2_one),
    Figure("B2", "rows retired in one transaction: every clock started", "< 2 s", _b2_many),
    Figure(
        "B2B",
        "10,000 rows retired in one statement (trigger 0003): every clock started",
        "< 0.1 s, >= 50x polling",
        _b2b,
    ),
    Figure("B3", "threshold expiry to DELETE at the API server, p99", "< 50 ms", _b3),
    Figure("B3", "a backlog against the delete budget", "<= the cap", _b3_backlog),
    Figure("B4", "idle cost", "0 row queries", _b4),
    Figure("B5", "pod events through the informer (one event loop)", ">= 10,000/s", _b5),
    Figure("B6", "pod decode against kubernetes_asyncio's V1Pod", ">= 100x", _b6),
    Figure(
        "B7",
        "the writer's 10,000-row statement, trigger 0003 over no trigger",
        "<= 1.2x",
        _b7_statement,
    ),
    Figure(
        "B7", "the writer's one-row transaction, 0003 over no trigger", "within noise", _b7_one_row
    ),
    Figure(
        "B7_share",
        "the trigger's share of the 10,000-row statement (EXPLAIN ANALYZE)",
        "<= 1.25x",
        _b7_share_figure,
    ),
    Figure(
        "B7_share",
        "the trigger's share of a one-row statement, beside the floors (benchmarks/b7_floors)",
        "<= 1.25x",
        _b7_share_one_row,
    ),
    Figure(
        "B8",
        "retired but kept: the sweep at 150,000 cached pods, extra memory, idle queries",
        "1 row query a resync period a namespace",
        lambda r: _b8(r),
    ),
    Figure(
        "B9",
        "a priority level of one seat (429 beyond it): the controller's delete rate over one "
        "sequential client's, each pod with its Event",
        ">= 0.5x, every Event, <= 20 log lines",
        _b9,
    ),
    Figure(
        "B10",
        "connections black-holed, default settings: a pod created then with its row retired, "
        "black hole to DELETE",
        "<= 90 s + threshold",
        _b10_new,
    ),
    Figure(
        "B10",
        "the same: a cached pod whose row is retired then, black hole to DELETE",
        "<= threshold + API_TIMEOUT_SECONDS + 5 s",
        _b10_cached,
    ),
    Figure(
        "B11",
        "every connection black-holed for 3 minutes, default settings: restore to the DELETE of "
        "a cached pod whose row was retired in the outage",
        "<= threshold + 10 s",
        _b11_restore,
    ),
    Figure(
        "B13",
        "the platform's common writes under concurrent writers (pgbench, Debian's PostgreSQL 15):"
        " how many times slower with the trigger",
        "<= 1.10x at 8 and 32 writers",
        _b13_slower("common"),
    ),
    Figure(
        "B13",
        "every write a retirement or re-activation (each must NOTIFY), beside the constant-NOTIFY"
        " floor",
        "-",
        _b13_slower("retire"),
    ),
    Figure(
        "B13i",
        "the writer backend's instructions with the trigger over none (callgrind)",
        "-",
        _b13i,
    ),
)


def _summary(runs: dict[str, dict[str, Any]]) -> list[str]:
    rows = []
    for fig in FIGURES:
        name = CANONICAL[fig.bench]
        r = runs.get(name)
        if r is None or fig.bench not in r:
            continue
        heading = HEADINGS[fig.bench]
        rows.append(
            [
                f"[{LABELS.get(fig.bench, fig.bench)}]({_anchor(heading)})",
                fig.measures,
                fig.value(r),
                fig.target,
                f"`{name}`, {_started(r)}: `{_command(name, r)}`",
            ]
        )
    return [
        "## Current figures",
        "",
        _table(["benchmark", "measures", "current figure", "target", "run"], rows),
        "",
    ]


# --- One section per benchmark: its canonical run's tables. ---------------------------------


def _command(name: str, r: dict[str, Any]) -> str:
    return str(r.get("command") or COMMANDS.get(name, "-"))


def _provenance(name: str, r: dict[str, Any]) -> list[str]:
    m, cfg = r["machine"], r["config"]
    return [
        f"Run `{name}`, {r['started']}: `{_command(name, r)}`. "
        f"{m['nproc']} CPUs, {m['cpu_model']}; "
        f"Python {m['python']}; " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ". "
        f"Load average at start {r['load_average_start']}, at end "
        f"{r.get('load_average_end', '-')}; repeats {cfg['repeats']} (medians shown).",
        "",
    ]


def _render_b1(r: dict[str, Any]) -> list[str]:
    rows = [
        [
            _f(s["pods"]),
            _f(s["synced_s"], 2),
            _f(s["cpu_synced_s"], 2),
            _f(s["catchup_done_s"], 2),
            _f(s["cpu_catchup_s"], 2),
            _f(s["rss_base_mib"]),
            _f(s["rss_after_catchup_mib"]),
            _f(s["rss_per_pod_bytes"], 0),
            s["load_average"],
        ]
        for s in r["B1"]
    ]
    header = ["pods", "synced s", "CPU s to sync", "caught up s", "CPU s to catch up"]
    header += ["RSS empty MiB", "RSS after MiB", "RSS B/pod", "load avg"]
    return [
        _table(header, rows),
        "",
        "_synced_: the informer's list complete (readiness); _caught up_: the resync after it has "
        "reconciled every cached candidate; _RSS B/pod_: (RSS after - RSS empty) / pods.",
    ]


def _render_b1l(r: dict[str, Any]) -> list[str]:
    lim = r["B1L"]
    rows = [
        [
            m["label"],
            _f(m["synced_s"], 2),
            _f(m["cpu_synced_s"], 2),
            _f(m["sync"]["api_requests"]),
            _f(m["rss_per_pod_bytes"]),
            _f(m["peak_rss_sync_kib"] / 1024),
            _f(m["rss_before_relist_kib"] / 1024),
            _f(m["peak_rss_relist_kib"] / 1024),
            f"{m['relist_peak_ratio']:.2f}x",
            _f(m["relist"]["api_requests"]),
        ]
        for m in lim["modes"]
    ]
    header = ["list mode", "synced s", "CPU s to sync", "API requests", "steady RSS B/pod"]
    header += ["peak in sync MiB", "before relist MiB", "peak in relist MiB", "relist peak"]
    header += ["relist API requests"]
    return [
        f"{lim['pods']:,} pods; each mode a fresh service process against one emulator "
        f"(emulator RSS {lim['emulator_rss_mib']:.0f} MiB).",
        "",
        _table(header, rows),
    ]


def _render_b2(r: dict[str, Any]) -> list[str]:
    b = r["B2"]
    rows = []
    for size in b["sizes"]:
        e, p = b["event"].get(str(size), {}), b["baseline"].get(str(size), {})
        rows.append(
            [
                _f(size),
                _f(e.get("p50_ms")),
                _f(e.get("p99_ms")),
                _f(e.get("all_started_s"), 2),
                _f(p.get("p50_ms"), 0),
                _f(p.get("p99_ms"), 0),
                _ratio(p.get("p99_ms", float("nan")), e.get("p99_ms", float("nan"))),
            ]
        )
    header = ["rows in one tx", "event p50 ms", "event p99 ms", "event all started s"]
    header += ["polling p50 ms", "polling p99 ms", "p99 ratio"]
    return [
        _table(header, rows),
        "",
        f"From just before COMMIT; {r['pods']:,} pods cached. Load avg {b['load_average']}.",
    ]


def _render_b2b(r: dict[str, Any]) -> list[str]:
    b = r["B2B"]
    e, p = b["event"]["10000"], b["baseline"].get("10000", {})

    def row(label: str, x: dict[str, Any]) -> list[str]:
        return [
            label,
            _f(x["p50_ms"]),
            _f(x["p99_ms"]),
            _f(x["all_started_s"], 3),
            _f(int(x.get("notifications", 0))),
            _f(x.get("cpu_to_all_started_s"), 3),
        ]

    rows = [row(str(i + 1), run) for i, run in enumerate(e["runs"])] + [row("median", e)]
    rows.append(["polling (median)", _f(p.get("p50_ms"), 0), _f(p.get("p99_ms"), 0)])
    rows[-1] += [_f(p.get("all_started_s"), 2), "-", "-"]
    header = ["run", "p50 ms", "p99 ms", "last clock s", "NOTIFYs", "CPU-s to last clock"]
    return [
        f"{r['pods']:,} pods cached; 10,000 rows retired in one statement.",
        "",
        _table(header, rows),
        "",
        f"Ahead of polling: {_ratio(p.get('all_started_s', float('nan')), e['all_started_s'])} "
        f"(median runs). Load avg {b['load_average']}.",
    ]


def _render_b3(r: dict[str, Any]) -> list[str]:
    b = r["B3"]
    e, p, k = b["event"], b["baseline"], b["backlog"]
    rows = [
        ["event-driven", _f(e["deleted"]), _f(e["p50_ms"]), _f(e["p99_ms"]), _f(e["max_ms"])],
        ["polling", _f(p["deleted"]), _f(p["p50_ms"], 0), _f(p["p99_ms"], 0), _f(p["max_ms"], 0)],
    ]
    return [
        _table(["design", "deleted", "p50 ms", "p99 ms", "max ms"], rows),
        "",
        f"{b['count']} pods retired 100 ms apart, threshold {b['threshold_s']:g} s. Backlog: "
        f"{k['backlog']} pods due at once, cap {k['cap_per_min']}/min, {_f(k['run_s'], 0)} s: "
        f"{k['deletes']} deletes, max {k['max_in_any_60s_window']} in any 60 s, steady "
        f"{_f(k['steady_rate_per_min'], 0)}/min.",
    ]


def _render_b4(r: dict[str, Any]) -> list[str]:
    b = r["B4"]
    rows = [
        [
            design,
            _f(x["row_queries_per_min"]),
            _f(x["api_requests_per_min"]),
            _f(x["cpu_percent"], 2),
        ]
        for design, x in (("event-driven", b["event"]), ("polling", b["baseline"]))
    ]
    return [
        f"{b['event']['pods']:,} cached pods, {b['idle_s']:g} s window each.",
        "",
        _table(["design", "row queries/min", "API requests/min", "CPU % of one core"], rows),
    ]


def _render_b5(r: dict[str, Any]) -> list[str]:
    b = r["B5"]
    rows = [
        [
            _f(s["target_rate"]),
            _f(s["offered_rate"], 0),
            _f(s["processed_rate"], 0),
            _f(s["max_backlog"]),
            _f(s["cpu_percent"], 0),
            "yes" if s["sustained"] else "no",
        ]
        for s in b["steps"]
    ]
    header = ["target/s", "offered/s", "processed/s", "max backlog", "CPU %", "sustained"]
    return [
        _table(header, rows),
        "",
        f"Highest sustained: **{_f(b['highest_sustained_rate'], 0)} events/s** "
        f"({r['pods']:,} pods cached). Load avg {b['load_average']}.",
    ]


def _render_b6(r: dict[str, Any]) -> list[str]:
    b = r["B6"]
    rows = [
        [
            p["fixture"],
            _f(p["bytes"]),
            _f(p["msgspec_us"], 2),
            _f(p["model_us"], 0),
            f"{p['speedup']:,.0f}x",
        ]
        for p in b["pods"]
    ]
    return [
        _table(["fixture", "compact bytes", "PodDecoder µs", "V1Pod µs", "speedup"], rows),
        "",
        f"Median {_f(b['median_msgspec_us'], 2)} µs against {_f(b['median_model_us'], 0)} µs.",
    ]


def _render_b7(r: dict[str, Any]) -> list[str]:
    b7 = r["B7"]
    names = {"none": "no trigger", "capture": "floor: capture", "compare": "floor: compare"}
    variants = [v for v in ("none", "0002", "0003", "capture", "compare") if v in b7["variants"]]
    kinds = (
        ("one_row", "one row"),
        ("statement_10k", f"{b7['rows']:,} rows in one statement"),
        ("single_row_statements_10k", f"{b7['rows']:,} one-row statements in one tx"),
    )
    rows = []
    for kind, label in kinds:
        cells = [b7["variants"][v][kind] for v in variants]
        digits = 3 if kind == "one_row" else 1
        rows.append(
            [label] + [f"{_f(c['median_ms'], digits)} ({c['ratio_to_none']:.2f}x)" for c in cells]
        )
    return [
        _table(["the writer's transaction", *(f"{names.get(v, v)} ms" for v in variants)], rows),
        "",
        f"Medians over {b7['rounds']} rounds, `BEGIN; ...; COMMIT` in one round trip. "
        f"Load avg {b7['load_average']}.",
    ]


def _render_b7_share(r: dict[str, Any]) -> list[str]:
    return _b7_share(r["B7_share"])[2:-1]


def _render_b8(r: dict[str, Any]) -> list[str]:
    b = r["B8"]
    w, wo, short = b["with"], b["without"], b["short_period"]
    ms = [
        ["the sweep's row query alone", *_ms3(w["query_s"])],
        [
            "the same, from its 7th execution (generic plan)",
            *_ms3(w["query_s"][5:] or w["query_s"]),
        ],
        ["a whole sweep (query and applying the answer)", *_ms3(w["sweep_s"])],
    ]
    return [
        f"{w['pods']:,} cached pods (a quarter Running), {w['kept']:,} of them retired and kept "
        f"(`pod_running`), {b['args']['history']:,} more retired rows of pods long gone; one "
        "namespace.",
        "",
        _table(["", "median ms", "min ms", "max ms"], ms),
        "",
        _table(
            ["", "RSS idle MiB", "idle row queries/min (default period, 600 s)"],
            [
                ["without the view", _f(wo["rss_kib"] / 1024), _f(wo["idle_row_queries_per_min"])],
                ["with the view", _f(w["rss_kib"] / 1024), _f(w["idle_row_queries_per_min"])],
            ],
        ),
        "",
        f"The view's own structures: {w['view_bytes'] / 1024:,.0f} KiB. At a resync period of "
        f"{short['period_s']:g} s: {short['sweeps_per_min']:.1f} sweeps/min "
        f"({short['row_queries_per_min']:.1f} row queries/min in all, the resync's lookups "
        f"included); idle windows of {b['args']['idle_s']:g} s.",
    ]


def _ms3(values: list[float]) -> list[str]:
    ordered = sorted(values)
    return [_f(ordered[len(ordered) // 2] * 1000), _f(ordered[0] * 1000), _f(ordered[-1] * 1000)]


def _b8(r: dict[str, Any]) -> str:
    w = r["B8"]["with"]
    query = sorted(w["query_s"])[len(w["query_s"]) // 2] * 1000
    generic_s = sorted(w["query_s"][5:] or w["query_s"])
    generic = generic_s[len(generic_s) // 2] * 1000
    extra = (w["rss_kib"] - r["B8"]["without"]["rss_kib"]) / 1024
    return (
        f"sweep query **{query:,.0f} ms** at {w['pods']:,} pods ({generic:,.0f} ms with the "
        f"generic plan); RSS {extra:+.1f} MiB; idle {w['idle_row_queries_per_min']:.1f} row "
        "queries/min at the default 600 s"
    )


def _render_b9(r: dict[str, Any]) -> list[str]:
    b = r["B9"]
    rows = []
    for label, c in (
        ("one sequential client (GET, DELETE, Event)", b["sequential"]),
        ("the controller (32 workers)", b["controller"]),
    ):
        rows.append(
            [
                label,
                f"{c['deleted']}/{b['rows']}",
                f"{c['events']}/{b['rows']}",
                _f(c["delete_span_s"], 2),
                _f(c["deletes_per_s"]),
                _f(c["answers_429"]),
                _f(c["log"]["lines"]) if "log" in c else "-",
                _f(c["log"]["by_level"].get("WARNING", 0)) if "log" in c else "-",
            ]
        )
    ctl = b["controller"]
    return [
        f"{b['seats']} seat(s); each request holds its seat {b['latency_ms']:g} ms beyond its "
        "handling.",
        "",
        _table(
            [
                "client",
                "deleted",
                "Events",
                "first to last DELETE s",
                "deletes/s",
                "answers 429",
                "log lines (info+)",
                "warnings",
            ],
            rows,
        ),
        "",
        f"The controller: first DELETE {_f(ctl['first_delete_after_retire_s'], 2)} s after the "
        f"retirement (threshold 1 s), last Event {_f(ctl['last_event_after_retire_s'], 2)} s "
        f"after it; concurrency limit at the end {_f(ctl['concurrency_limit_at_end'], 0)}. "
        f"Its info lines are the start-up lines and the deletes' summary (`deleted N pods in "
        f"the last 60s (...)`, one a minute at most); each delete's own line is debug.",
    ]


def _render_b10(r: dict[str, Any]) -> list[str]:
    b = r["B10"]
    st = b["settings"]
    restarts = ", ".join(f"{k} {v:g}" for k, v in b["watch_restarts"].items())
    return [
        _table(
            ["pod", "black hole to DELETE", "target"],
            [
                [
                    "created in the black hole, row already retired",
                    _b10_seconds(b["new_pod_delete_s"]),
                    f"{b['new_pod_target_s']:g} s",
                ],
                [
                    "cached, row retired in the black hole",
                    _b10_seconds(b["cached_pod_delete_s"]),
                    f"{b['cached_pod_target_s']:g} s",
                ],
            ],
        ),
        "",
        f"THRESHOLD_SECONDS {st['THRESHOLD_SECONDS']:g}, API_TIMEOUT_SECONDS "
        f"{st['API_TIMEOUT_SECONDS']:g}, WATCH_SILENCE_SECONDS {st['WATCH_SILENCE_SECONDS']:g}, "
        f"WATCH_TIMEOUT_SECONDS {st['WATCH_TIMEOUT_SECONDS']:g}, the rest at their defaults; "
        f"a bookmark every {st['bookmark_interval_s']:g} s. {b['connections_black_holed']} "
        f"connection(s) black-holed, {b['bookmark_wait_s']:.1f} s after the service was ready and "
        f"leading (once a periodic bookmark had come). During it: watch restarts {restarts}; "
        f"pool replacements {b['pool_replacements']:g}; relists {b['relists']:g}; "
        f"other pods deleted: {len(b['wrongly_deleted'])}; {len(b['warnings'])} warning line(s):",
        "",
        *(f"- `{line}`" for line in b["warnings"]),
    ]


def _render_b11(r: dict[str, Any]) -> list[str]:
    b = r["B11"]
    st = b["settings"]
    restarts = ", ".join(f"{k} {v:g}" for k, v in b["watch_restarts"].items())
    return [
        _table(
            ["event", "seconds", "target"],
            [
                [
                    "black hole to `/readyz` 503 (`kubernetes api: no answer ...`)",
                    _b10_seconds(b["unready_after_s"]),
                    "RETRY_PERIOD_SECONDS + the Lease attempt bound",
                ],
                [
                    "black hole to `retired_pod_gc_api_reachable` 0",
                    _b10_seconds(b["unreachable_gauge_after_s"]),
                    "the same",
                ],
                [
                    "restore to the DELETE of the pod retired in the outage",
                    _b10_seconds(b["restore_to_delete_s"]),
                    f"{b['restore_target_s']:g} s",
                ],
                ["restore to `/readyz` 200", _b10_seconds(b["restore_to_ready_s"]), "-"],
            ],
        ),
        "",
        f"THRESHOLD_SECONDS {st['THRESHOLD_SECONDS']:g}, API_TIMEOUT_SECONDS "
        f"{st['API_TIMEOUT_SECONDS']:g}, RETRY_PERIOD_SECONDS {st['RETRY_PERIOD_SECONDS']:g}, "
        f"WATCH_SILENCE_SECONDS {st['WATCH_SILENCE_SECONDS']:g}, the rest at their defaults; a "
        f"bookmark every {st['bookmark_interval_s']:g} s. Every connection black-holed for "
        f"{b['outage_s']:g} s ({b['connections_black_holed']} open then), new ones too; restored "
        f"with the black-holed ones left dead. `/readyz` said: `{b['readyz_body']}`; at the "
        f"restore: `{b['readyz_at_restore']}`, last answer "
        f"{b['last_answer_age_at_restore_s']:.0f} s old. Deleted during the outage: "
        f"{b['deleted_during_outage']}; other pods deleted: {len(b['wrongly_deleted'])}. Watch "
        f"restarts (whole run) {restarts}; pool replacements {b['pool_replacements']:g}; relists "
        f"{b['relists']:g}; {len(b['warnings'])} warning line(s) from the black hole on:",
        "",
        *(f"- `{line}`" for line in b["warnings"]),
    ]


def _render_b13(r: dict[str, Any]) -> list[str]:
    b = r["B13"]
    rows = [
        [
            s["mix"],
            str(s["writers"]),
            f"`{s['variant']}`",
            f"{s['tps']:,.0f}",
            f"{s['latency_ms']:.2f}",
            f"{s['notifications']:,.0f}",
            f"**{s['slower']:.2f}x**",
        ]
        for s in sorted(b["summary"], key=lambda s: (s["mix"], s["writers"], s["variant"]))
    ]
    header = ["mix", "writers", "variant", "tps", "latency ms", "NOTIFYs a run", "slower"]
    return [
        f"{b['server']}. Medians over the rounds; `slower` is `none`'s median tps over the"
        " variant's.",
        "",
        _table(header, rows),
    ]


def _render_b13i(r: dict[str, Any]) -> list[str]:
    res = r["B13i"]["results"]
    base = res["none"]
    keys = ("common_per_tx", "retire_per_tx", "mass")
    rows = [
        [f"`{name}`", *(f"{v[k]:,.0f} ({v[k] / base[k]:.3f}x)" for k in keys)]
        for name, v in res.items()
    ]
    header = ["variant", "a common write", "a one-row retirement", "10,000 rows retired"]
    return [r["B13i"]["server"] + "; instructions of the backend.", "", _table(header, rows)]


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "B1": _render_b1,
    "B1L": _render_b1l,
    "B2": _render_b2,
    "B2B": _render_b2b,
    "B3": _render_b3,
    "B4": _render_b4,
    "B5": _render_b5,
    "B6": _render_b6,
    "B7": _render_b7,
    "B7_share": _render_b7_share,
    "B8": _render_b8,
    "B9": _render_b9,
    "B10": _render_b10,
    "B11": _render_b11,
    "B13": _render_b13,
    "B13i": _render_b13i,
}


def _sections(runs: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for bench, render_bench in RENDERERS.items():
        name = CANONICAL[bench]
        r = runs.get(name)
        if r is None or bench not in r:
            continue
        out += [f"## {HEADINGS[bench]}", "", *_provenance(name, r), *render_bench(r), ""]
    return out


def _cdf(ax: Any, latencies_s: list[float], *, label: str, color: str) -> None:
    lat = sorted(max(x * 1000, 0.1) for x in latencies_s)
    if not lat:
        return
    ys = [(i + 1) / len(lat) for i in range(len(lat))]
    marker = "o" if len(lat) < 5 else None
    ax.plot(lat, ys, drawstyle="steps-post", marker=marker, label=label, color=color)


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path.name


def _plot_b2(plots: Path, name: str, r: dict[str, Any]) -> str:
    b = r["B2"]
    fig, axes = plt.subplots(1, len(b["sizes"]), figsize=(5 * len(b["sizes"]), 4))
    for ax, size in zip(axes, b["sizes"], strict=True):
        for label, data, color in (
            ("event-driven", b["event"].get(str(size), {}), "tab:blue"),
            ("polling (10 s tick)", b["baseline"].get(str(size), {}), "tab:red"),
        ):
            _cdf(ax, data.get("latencies_s", []), label=label, color=color)
        ax.set_xscale("log")
        ax.set_xlabel("COMMIT → clock started (ms, log)")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("fraction of pods")
        ax.set_title(f"{size:,} retired in one tx ({r['pods']:,} pods cached)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
    return _save(fig, plots / f"b2_retirement_cdf_{name}.png")


def _plot_b3(plots: Path, name: str, r: dict[str, Any]) -> str:
    b = r["B3"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, data, color in (
        ("event-driven", b["event"], "tab:blue"),
        ("polling (10 s tick)", b["baseline"], "tab:red"),
    ):
        _cdf(ax, data.get("latencies_s", []), label=label, color=color)
    ax.set_xscale("log")
    ax.set_xlabel("threshold expiry → DELETE received (ms, log)")
    ax.set_ylabel("fraction of pods")
    ax.set_title(f"B3 expiry reaction ({r['pods']:,} pods cached)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, plots / f"b3_expiry_cdf_{name}.png")


def _plot_b5(plots: Path, name: str, r: dict[str, Any]) -> str:
    steps = sorted(r["B5"]["steps"], key=lambda s: s["offered_rate"])
    fig, ax = plt.subplots(figsize=(6, 4))
    offered = [s["offered_rate"] for s in steps]
    ax.plot(offered, [s["processed_rate"] for s in steps], "o-", label="processed")
    ax.plot([0, max(offered)], [0, max(offered)], "--", color="grey", label="offered = processed")
    ax.set_xlabel("offered pod events/s")
    ax.set_ylabel("processed pod events/s")
    ax.set_title("B5 churn (one event loop)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, plots / f"b5_churn_{name}.png")


def _plot_b1l(plots: Path, name: str, r: dict[str, Any]) -> str:
    modes = r["B1L"]["modes"]
    labels = [m["label"].replace(" ", "\n", 1) for m in modes]
    x = range(len(modes))
    left = [i - 0.2 for i in x]
    right = [i + 0.2 for i in x]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(left, [m["rss_before_relist_kib"] / 1024 for m in modes], 0.4, label="steady RSS")
    ax1.bar(right, [m["peak_rss_relist_kib"] / 1024 for m in modes], 0.4, label="relist peak")
    ax1.set_xticks(list(x), labels)
    ax1.set_ylabel("MiB")
    ax1.legend()
    ax1.set_title(f"B1 RSS at {r['B1L']['pods']:,} pods")
    ax2.bar(left, [m["cpu_synced_s"] for m in modes], 0.4, label="CPU s to sync")
    ax2.bar(right, [m["synced_s"] for m in modes], 0.4, label="wall s to sync")
    ax2.axhline(3.0, color="tab:red", alpha=0.4, label="3 s target")
    ax2.set_xticks(list(x), labels)
    ax2.set_ylabel("seconds")
    ax2.legend()
    ax2.set_title("B1 cold sync by list mode")
    return _save(fig, plots / f"b1_limit_{name}.png")


def _plot_b1_rss(plots: Path, name: str, r: dict[str, Any]) -> str:
    by_size = {s["pods"]: s for s in r["B1"]}
    sizes = sorted(by_size)
    fig, ax1 = plt.subplots(figsize=(6, 4))
    total = [by_size[n]["rss_after_catchup_mib"] for n in sizes]
    ax1.plot(sizes, total, "o-", label="total RSS (MiB)")
    empty = [by_size[n]["rss_base_mib"] for n in sizes]
    ax1.plot(sizes, empty, "s--", label="empty service RSS (MiB)")
    ax1.set_xscale("log")
    ax1.set_xlabel("cached pods (log)")
    ax1.set_ylabel("MiB")
    ax2 = ax1.twinx()
    per_pod = [by_size[n]["rss_per_pod_bytes"] for n in sizes]
    ax2.plot(sizes, per_pod, "^:", color="tab:green", label="bytes per cached pod")
    ax2.axhline(1024, color="tab:green", alpha=0.3)
    ax2.set_ylabel("bytes per pod (line: 1 KiB target)")
    lines, more = ax1.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax1.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left")
    ax1.set_title("B1 service RSS against pod count")
    ax1.grid(True, which="both", alpha=0.3)
    return _save(fig, plots / f"b1_rss_{name}.png")


PLOTS: dict[str, Callable[[Path, str, dict[str, Any]], str]] = {
    "B1": _plot_b1_rss,
    "B1L": _plot_b1l,
    "B2": _plot_b2,
    "B3": _plot_b3,
    "B5": _plot_b5,
}


def _plots(here: Path, runs: dict[str, dict[str, Any]]) -> list[str]:
    """One plot per canonical benchmark that has one, named after its run."""
    plots = here / "plots"
    plots.mkdir(exist_ok=True)
    made = []
    for bench, plot in PLOTS.items():
        name = CANONICAL[bench]
        if name in runs and bench in runs[name]:
            made.append(plot(plots, name, runs[name]))
    return made


def _b7_share(share: dict[str, Any]) -> list[str]:
    """B7's trigger share (benchmarks/share.py): one row per server, variant and statement."""
    variant_names = {"0003": "0003 (shipped)", **share.get("others", {})}
    rows = []
    for server, result in share["servers"].items():
        info = result["server"]
        where = (
            f"{server}: PostgreSQL {info['version'].split()[0]}, jit {info['jit']}, "
            f"JIT {'available' if info['jit_available'] else 'not available'}"
        )
        # By size of `sandboxes`; a run from before the sizes had one: `rows`.
        cases = result.get("cases") or {str(share["rows"]): {"variants": result["variants"]}}
        for size, case in cases.items():
            for variant, per in case["variants"].items():
                for kind, label in (
                    ("statement", f"{share['rows']:,} rows"),
                    ("one_row", "one row"),
                ):
                    e = per[kind]
                    rows.append(
                        [
                            where,
                            f"{int(size):,}",
                            f"`{variant_names.get(variant, variant)}`",
                            label,
                            f"**{e['ratio_median']:.3f}x** "
                            f"[{e['ratio_min']:.3f}-{e['ratio_max']:.3f}]",
                            _f(e["trigger_ms_median"], 3),
                            _f(e["total_ms_median"], 3),
                            _f(e["statements"]),
                        ]
                    )
    return [
        f"### B7 trigger share: the trigger's time inside the writer's statement "
        f"({share['rows']:,} rows, a schema the project did not write)",
        "",
        _table(
            [
                "server",
                "sandboxes",
                "trigger",
                "statement",
                "with / without trigger, median [range]",
                "trigger ms",
                "statement ms",
                "statements",
            ],
            rows,
        ),
        "",
        "Per statement, `EXPLAIN (ANALYZE)`'s execution time over the same time less the "
        "trigger's (benchmarks/share.py); medians of those ratios; the times are medians too. "
        f"{share['rounds']} statements of {share['rows']:,} rows per server and trigger; "
        f"load avg {share['load_average']}.",
        "",
    ]


def load_runs(here: Path) -> dict[str, dict[str, Any]]:
    """The canonical runs' results files that are present, by run name, each holding only the
    benchmarks it is canonical for (a run's other measurements are not current figures)."""
    runs = {}
    for name in dict.fromkeys(CANONICAL.values()):
        path = here / "results" / f"{name}.json"
        if path.exists():
            r = json.loads(path.read_text())
            runs[name] = {k: v for k, v in r.items() if CANONICAL.get(k, name) == name}
    return runs


def render(here: Path) -> None:
    runs = load_runs(here)
    plots = _plots(here, runs)
    parts = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks.report` from the canonical run of each benchmark in "
        "`benchmarks/results/*.json`; how each figure is measured and what limits it is "
        "[NOTES.md](NOTES.md). Every comparison is the event-driven service against the polling "
        "baseline (`benchmarks/baseline.py`) in the same run, on the same emulator and database, "
        "on a 2-core VM.",
        "",
        *_summary(runs),
        *_sections(runs),
        "## Plots",
        "",
        *(f"![{p}](plots/{p})" for p in plots),
        "",
    ]
    (here / "RESULTS.md").write_text("\n".join(parts))


if __name__ == "__main__":
    render(Path(__file__).resolve().parent)
