"""Renders ``RESULTS.md`` and the PNG plots from ``results/*.json`` (``python -m benchmarks.report``).

The hand-written analysis lives in ``NOTES.md`` beside this file and is included verbatim.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RUN_ORDER = ("default", "large", "limit", "limit-b2", "rss-before", "rss-after")


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


def _section(name: str, r: dict[str, Any]) -> str:
    m = r["machine"]
    cfg = r["config"]
    only_limit = "B1L" in r and not any(k in r for k in ("B1", "B2", "B3", "B4", "B5", "B6"))
    pods = r["B1L"]["pods"] if only_limit else r["pods"]  # a B1L-only run: its population
    out = [
        f"## Run `{name}`: {pods:,} pods ({r['started']})",
        "",
        f"Machine: {m['nproc']} CPUs, {m['cpu_model']}; Python {m['python']}; "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
        + ".",
        f"Load average (1/5/15 min) at start {r['load_average_start']}, at end "
        f"{r.get('load_average_end', '-')}. "
        f"Repeats: {cfg['repeats']} (medians shown); polling tick {cfg['tick_s']:g} s; "
        f"wall time {r.get('elapsed_s', 0):.0f} s."
        + (f" Command: `{r['command']}`." if "command" in r else ""),
        "",
    ]
    if "B1L" in r:
        lim = r["B1L"]
        out += [f"### B1 at the limit: {lim['pods']:,} pods, by list mode (one run)", ""]
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
                _f(m["relist_synced_s"], 2),
                _f(m["relist"]["api_requests"]),
                m["load_average"],
            ]
            for m in lim["modes"]
        ]
        out += [
            _table(
                [
                    "list mode",
                    "synced s",
                    "CPU s to sync",
                    "API requests (sync)",
                    "steady RSS B/pod",
                    "peak RSS in sync MiB",
                    "RSS before relist MiB",
                    "peak RSS in relist MiB",
                    "relist peak / steady",
                    "relist synced s",
                    "API requests (relist)",
                    "load avg",
                ],
                rows,
            ),
            "",
            "Each mode is a fresh service process against the same emulator "
            f"(emulator RSS {lim['emulator_rss_mib']:.0f} MiB). _steady RSS B/pod_: (RSS after "
            "the catch-up - RSS of the empty service) / pods. _peak_: the kernel's high-water "
            "mark (VmHWM), reset before the relist; the relist is forced by ending the watch "
            "and answering the next one 410. The quorum list is the `list` mode with the "
            "watch-cache list refused (410).",
            "",
        ]
    if "B1" in r:
        out += ["### B1 cold start (service in its own process)", ""]
        rows = []
        for s in r["B1"]:
            rows.append(
                [
                    _f(s["pods"]),
                    _f(s["synced_s"], 2),
                    _f(s["cpu_synced_s"], 2),
                    _f(s["catchup_done_s"], 2),
                    _f(s["cpu_catchup_s"], 2),
                    _f(s["rss_base_mib"]),
                    _f(s["rss_after_catchup_mib"]),
                    _f(s["rss_per_pod_bytes"], 0),
                    _f(int(s["catchup_row_queries"])),
                    s["load_average"],
                ]
            )
        out += [
            _table(
                [
                    "pods",
                    "synced s",
                    "CPU s to sync",
                    "catch-up done s",
                    "CPU s to catch-up",
                    "RSS empty MiB",
                    "RSS after MiB",
                    "RSS B/pod",
                    "catch-up row queries",
                    "load avg",
                ],
                rows,
            ),
            "",
            "_synced_: the informer's list is complete (readiness). _catch-up_: the resync that "
            "follows sync has reconciled every cached candidate (one row lookup each). "
            "_RSS B/pod_: (RSS after catch-up - RSS of the empty service) / pods.",
            "",
        ]
    if "B7" in r:
        b7 = r["B7"]
        b7_headings = {
            "none": "no trigger",
            "0002": "0002",
            "0003": "0003",
            "capture": "floor: capture",
            "compare": "floor: compare",
        }
        out += [
            f"### B7 writer overhead: the same statements with no trigger, 0002 and 0003 "
            f"({b7['rows']:,} rows)",
            "",
        ]
        kinds = (
            ("one_row", "one row (median of {n})".format(n=_f(b7["one_row_runs"]))),
            ("statement_10k", f"{b7['rows']:,} rows in one statement"),
            ("single_row_statements_10k", f"{b7['rows']:,} one-row statements in one tx"),
        )
        # Runs before the floors were measured hold only the first three.
        variants = [
            v for v in ("none", "0002", "0003", "capture", "compare") if v in b7["variants"]
        ]
        rows = []
        for kind, label in kinds:
            row = [label]
            for variant in variants:
                v = b7["variants"][variant][kind]
                digits = 3 if kind == "one_row" else 1
                row.append(
                    f"{_f(v['median_ms'], digits)} ({v['ratio_to_none']:.2f}x, "
                    f"{_f(v['notifies'])} NOTIFY)"
                )
            rows.append(row)
        out += [
            _table(
                [
                    "the writer's transaction",
                    *(f"{b7_headings[v]} ms" for v in variants),
                ],
                rows,
            ),
            "",
            f"Median over {b7['rounds']} rounds (variants in turn, the table vacuumed before "
            "each timed run); the time is `BEGIN; ...; COMMIT` in one round trip; NOTIFY = "
            "notifications one transaction sent (one-row: per transaction). Largest payload "
            f"0003 sent: {_f(b7['variants']['0003']['max_payload_bytes'])} bytes. "
            + (
                "The floors are benchmark-only UPDATE triggers (benchmarks/writer.py): _capture_ "
                "keeps both transition tables and does nothing, _compare_ also selects the "
                "changed rows and their namespaces as 0003 does, and builds and sends nothing. "
                if "compare" in b7["variants"]
                else ""
            )
            + f"Load avg {b7['load_average']}.",
            "",
        ]
        paired = [
            (b7_headings[v], b7["variants"][v]["statement_10k"])
            for v in variants
            if v != "none" and "paired_ratio_to_none" in b7["variants"][v]["statement_10k"]
        ]
        if paired:
            out += [
                f"Paired by round ({b7['rows']:,} rows in one statement: each round's time over "
                "no trigger's in the same round, median [lowest-highest] over the rounds; wall, "
                "then the writer's server CPU): "
                + "; ".join(
                    f"{name} {e['paired_ratio_to_none']['median']:.2f}x "
                    f"[{e['paired_ratio_to_none']['min']:.2f}-{e['paired_ratio_to_none']['max']:.2f}], "
                    f"{e['paired_server_cpu_ratio_to_none']['median']:.2f}x"
                    for name, e in paired
                )
                + ".",
                "",
            ]
    if "B7_share" in r:
        out += _b7_share(r["B7_share"])
    if "B2B" in r:
        b = r["B2B"]
        e, p = b["event"]["10000"], b["baseline"].get("10000", {})
        out += [
            f"### B2b: 10,000 rows retired in one statement, {r['pods']:,} pods cached",
            "",
            _table(
                [
                    "run",
                    "p50 ms",
                    "p99 ms",
                    "last clock s",
                    "NOTIFYs",
                    "CPU-s to last clock",
                    "CPU-s to idle",
                ],
                [
                    [
                        str(i + 1),
                        _f(run["p50_ms"]),
                        _f(run["p99_ms"]),
                        _f(run["all_started_s"], 3),
                        _f(int(run.get("notifications", 0))),
                        _f(run.get("cpu_to_all_started_s"), 3),
                        _f(run.get("cpu_to_idle_s"), 3),
                    ]
                    for i, run in enumerate(e["runs"])
                ]
                + [
                    [
                        "median",
                        _f(e["p50_ms"]),
                        _f(e["p99_ms"]),
                        _f(e["all_started_s"], 3),
                        _f(int(e.get("notifications", 0))),
                        _f(e.get("cpu_to_all_started_s"), 3),
                        _f(e.get("cpu_to_idle_s"), 3),
                    ],
                    [
                        "polling"
                        + (
                            f" (median of {len(p['runs'])}: "
                            + ", ".join(_f(run["all_started_s"], 2) for run in p["runs"])
                            + " s)"
                            if "runs" in p
                            else ""
                        ),
                        _f(p.get("p50_ms"), 0),
                        _f(p.get("p99_ms"), 0),
                        _f(p.get("all_started_s"), 2),
                        "-",
                        "-",
                        "-",
                    ],
                ],
            ),
            "",
            f"Event-driven ahead of polling by {_ratio(p.get('all_started_s', float('nan')), e['all_started_s'])} "
            "to the last clock (median run against the median polling run, each polling run "
            "retiring at a random phase of its tick). Latencies from just before "
            "COMMIT; CPU-s are the benchmark process's (the service runs in it) from before the "
            "COMMIT to the last clock, and to every key of the burst reconciled. "
            f"Load avg {b['load_average']}.",
            "",
        ]
    if "B2" in r:
        b = r["B2"]
        out += ["### B2 retirement COMMIT → observation clock started", ""]
        rows = []
        for size in b["sizes"]:
            e, p = b["event"].get(str(size), {}), b["baseline"].get(str(size), {})
            rows.append(
                [
                    _f(size),
                    _f(e.get("p50_ms")),
                    _f(e.get("p99_ms")),
                    _f(e.get("max_ms")),
                    _f(p.get("p50_ms"), 0),
                    _f(p.get("p99_ms"), 0),
                    _f(p.get("max_ms"), 0),
                    _ratio(p.get("p99_ms", float("nan")), e.get("p99_ms", float("nan"))),
                    f"{e.get('missing', 0)}/{p.get('missing', 0)}",
                ]
            )
        out += [
            _table(
                [
                    "rows in one tx",
                    "event p50 ms",
                    "event p99 ms",
                    "event max ms",
                    "polling p50 ms",
                    "polling p99 ms",
                    "polling max ms",
                    "p99 ratio",
                    "not started (event/polling)",
                ],
                rows,
            ),
            "",
            f"Measured from just before COMMIT; {r['pods']:,} pods cached; service defaults "
            f"(WORKERS=32). Load avg {b['load_average']}.",
            "",
        ]
        w = r.get("B2_workers32")
        if w:
            out += [
                "Event-driven with `WORKERS=32` set explicitly (same run, same data; the "
                "default is 32 too, so this repeats the measurement):",
                "",
                _table(
                    ["rows in one tx", "p50 ms", "p99 ms", "max ms", "all started s"],
                    [
                        [
                            _f(size),
                            _f(w["event"][str(size)]["p50_ms"]),
                            _f(w["event"][str(size)]["p99_ms"]),
                            _f(w["event"][str(size)]["max_ms"]),
                            _f(w["event"][str(size)]["all_started_s"], 2),
                        ]
                        for size in w["sizes"]
                    ],
                ),
                "",
            ]
    if "B3" in r:
        b = r["B3"]
        e, p, k = b["event"], b["baseline"], b["backlog"]
        out += [
            "### B3 threshold expiry → DELETE at the API server",
            "",
            _table(
                ["design", "deleted", "p50 ms", "p99 ms", "max ms"],
                [
                    [
                        "event-driven",
                        _f(e["deleted"]),
                        _f(e["p50_ms"]),
                        _f(e["p99_ms"]),
                        _f(e["max_ms"]),
                    ],
                    [
                        "polling",
                        _f(p["deleted"]),
                        _f(p["p50_ms"], 0),
                        _f(p["p99_ms"], 0),
                        _f(p["max_ms"], 0),
                    ],
                    ["ratio (p99)", "", "", _ratio(p["p99_ms"], e["p99_ms"]), ""],
                ],
            ),
            "",
            f"{b['count']} pods retired 100 ms apart, threshold {b['threshold_s']:g} s, budget 6000/min "
            "(not binding). Expiry = the design's own clock start + threshold; DELETE time = the "
            "emulator's audit log.",
            "",
            f"Backlog (event-driven): {k.get('backlog')} pods due at once, cap "
            f"{k.get('cap_per_min')}/min, observed for {_f(k.get('run_s'), 0)} s: "
            f"{k.get('deletes')} deletes; max in any rolling 60 s window "
            f"{k.get('max_in_any_60s_window')} (cap {k.get('cap_per_min')}); steady rate after the "
            f"pacer's burst {_f(k.get('steady_rate_per_min'), 0)}/min = "
            f"{_f(100 * k.get('steady_utilisation', float('nan')), 0)} % of the cap.",
            "",
        ]
    if "B4" in r:
        b = r["B4"]
        e, p = b["event"], b["baseline"]
        out += [
            f"### B4 idle cost at {e['pods']:,} cached pods ({b['idle_s']:g} s window each)",
            "",
            _table(
                ["design", "row queries/min", "API requests/min", "CPU % of one core"],
                [
                    [
                        "event-driven",
                        _f(e["row_queries_per_min"]),
                        _f(e["api_requests_per_min"]),
                        _f(e["cpu_percent"], 2),
                    ],
                    [
                        "polling",
                        _f(p["row_queries_per_min"]),
                        _f(p["api_requests_per_min"]),
                        _f(p["cpu_percent"], 2),
                    ],
                ],
            ),
            "",
            f"Polling tick durations (s): {', '.join(f'{t:.2f}' for t in p.get('tick_durations_s', [])[:8])}. "
            f"Load avg {b['load_average']}.",
            "",
        ]
    if "B5" in r:
        b = r["B5"]
        rows = [
            [
                _f(s["target_rate"]),
                _f(s["offered_rate"], 0),
                _f(s["processed_rate"], 0),
                _f(s["max_backlog"]),
                _f(s["drain_after_end_s"], 2),
                _f(s["cpu_percent"], 0),
                "yes" if s["sustained"] else "no",
            ]
            for s in b["steps"]
        ]
        out += [
            "### B5 churn: pod events/s through the informer (one event loop = one core)",
            "",
            _table(
                [
                    "target/s",
                    "offered/s",
                    "processed/s",
                    "max backlog",
                    "drain after step s",
                    "service CPU %",
                    "sustained",
                ],
                rows,
            ),
            "",
            f"Highest sustained: **{_f(b['highest_sustained_rate'], 0)} events/s**. Events are ADDED "
            f"watch events of Running pods (bulk-created in the emulator in batches every "
            f"{b['batch_s']:g} s for {b['step_s']:g} s per step); _sustained_ = offered ≥ 90 % of the "
            "target and the backlog drained within ~0.3 s of the step's end. Load avg "
            f"{b['load_average']}.",
            "",
        ]
    if "B6" in r:
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
        out += [
            "### B6 decode: PodDecoder (msgspec) vs kubernetes_asyncio `ApiClient.deserialize(…, 'V1Pod')`",
            "",
            _table(["fixture", "compact bytes", "PodDecoder µs", "V1Pod µs", "speedup"], rows),
            "",
            f"Median: {_f(b['median_msgspec_us'], 2)} µs vs {_f(b['median_model_us'], 0)} µs = "
            f"**{b['median_speedup']:,.0f}x**.",
            "",
        ]
    return "\n".join(out)


def _cdf(ax: Any, latencies_s: list[float], *, label: str, color: str) -> None:
    lat = sorted(max(x * 1000, 0.1) for x in latencies_s)
    if not lat:
        return
    ys = [(i + 1) / len(lat) for i in range(len(lat))]
    marker = "o" if len(lat) < 5 else None
    ax.plot(lat, ys, drawstyle="steps-post", marker=marker, label=label, color=color)


def _plots(here: Path, runs: dict[str, dict[str, Any]]) -> list[str]:
    made = []
    plots = here / "plots"
    plots.mkdir(exist_ok=True)
    for name, r in runs.items():
        if "B2" in r:
            b = r["B2"]
            fig, axes = plt.subplots(1, len(b["sizes"]), figsize=(5 * len(b["sizes"]), 4))
            for ax, size in zip(axes, b["sizes"], strict=True):
                w = r.get("B2_workers32", {}).get("event", {})
                for label, data, color in (
                    ("event-driven (defaults)", b["event"].get(str(size), {}), "tab:blue"),
                    ("event-driven (WORKERS=32 set)", w.get(str(size), {}), "tab:green"),
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
            fig.tight_layout()
            path = plots / f"b2_retirement_cdf_{name}.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            made.append(path.name)
        if "B3" in r:
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
            fig.tight_layout()
            path = plots / f"b3_expiry_cdf_{name}.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            made.append(path.name)
        if "B5" in r:
            steps = sorted(r["B5"]["steps"], key=lambda s: s["offered_rate"])
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.plot(
                [s["offered_rate"] for s in steps],
                [s["processed_rate"] for s in steps],
                "o-",
                label="processed",
            )
            top = max(s["offered_rate"] for s in steps)
            ax.plot([0, top], [0, top], "--", color="grey", label="offered = processed")
            ax.set_xlabel("offered pod events/s")
            ax.set_ylabel("processed pod events/s")
            ax.set_title("B5 churn (one event loop)")
            ax.grid(True, alpha=0.3)
            ax.legend()
            fig.tight_layout()
            path = plots / f"b5_churn_{name}.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            made.append(path.name)
    for name, r in runs.items():
        if "B1L" not in r:
            continue
        modes = r["B1L"]["modes"]
        labels = [m["label"].replace(" ", "\n", 1) for m in modes]
        x = range(len(modes))
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        ax1.bar(
            [i - 0.2 for i in x],
            [m["rss_before_relist_kib"] / 1024 for m in modes],
            0.4,
            label="steady RSS",
        )
        ax1.bar(
            [i + 0.2 for i in x],
            [m["peak_rss_relist_kib"] / 1024 for m in modes],
            0.4,
            label="peak RSS during a relist",
        )
        ax1.set_xticks(list(x), labels)
        ax1.set_ylabel("MiB")
        ax1.legend()
        ax1.set_title(f"B1 RSS at {r['B1L']['pods']:,} pods")
        ax2.bar(
            [i - 0.2 for i in x], [m["cpu_synced_s"] for m in modes], 0.4, label="CPU s to sync"
        )
        ax2.bar([i + 0.2 for i in x], [m["synced_s"] for m in modes], 0.4, label="wall s to sync")
        ax2.axhline(3.0, color="tab:red", alpha=0.4, label="3 s target")
        ax2.set_xticks(list(x), labels)
        ax2.set_ylabel("seconds")
        ax2.legend()
        ax2.set_title("B1 cold sync by list mode")
        fig.tight_layout()
        path = plots / f"b1_limit_{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        made.append(path.name)
    b1 = [s for r in runs.values() for s in r.get("B1", [])]
    if b1:
        by_size: dict[int, dict[str, Any]] = {}
        for s in b1:
            by_size[s["pods"]] = s  # the later (larger) run wins a duplicate size
        sizes = sorted(by_size)
        fig, ax1 = plt.subplots(figsize=(6, 4))
        ax1.plot(
            sizes,
            [by_size[n]["rss_after_catchup_mib"] for n in sizes],
            "o-",
            label="total RSS (MiB)",
        )
        ax1.plot(
            sizes,
            [by_size[n]["rss_base_mib"] for n in sizes],
            "s--",
            label="empty service RSS (MiB)",
        )
        ax1.set_xscale("log")
        ax1.set_xlabel("cached pods (log)")
        ax1.set_ylabel("MiB")
        ax2 = ax1.twinx()
        ax2.plot(
            sizes,
            [by_size[n]["rss_per_pod_bytes"] for n in sizes],
            "^:",
            color="tab:green",
            label="bytes per cached pod",
        )
        ax2.axhline(1024, color="tab:green", alpha=0.3)
        ax2.set_ylabel("bytes per pod (line: 1 KiB target)")
        lines = ax1.get_legend_handles_labels()
        more = ax2.get_legend_handles_labels()
        ax1.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left")
        ax1.set_title("B1 service RSS against pod count")
        ax1.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        path = plots / "b1_rss.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        made.append(path.name)
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


def render(here: Path) -> None:
    runs: dict[str, dict[str, Any]] = {}
    for name in RUN_ORDER:
        path = here / "results" / f"{name}.json"
        if path.exists():
            runs[name] = json.loads(path.read_text())
    for path in sorted((here / "results").glob("*.json")):
        if path.stem not in runs:
            runs[path.stem] = json.loads(path.read_text())
    plots = _plots(here, runs)
    notes = here / "NOTES.md"
    parts = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks.run` (`make bench`, `make bench-large`, "
        "`make bench-limit`) from "
        "`benchmarks/results/*.json`; the analysis below the tables is `benchmarks/NOTES.md`. "
        "Every comparison is event-driven service vs the polling baseline "
        "(`benchmarks/baseline.py`) in the same run, on the same emulator and database.",
        "",
    ]
    if notes.exists():
        parts += [notes.read_text().strip(), ""]
    for name, r in runs.items():
        parts += [_section(name, r), ""]
    parts += ["## Plots", ""] + [f"![{p}](plots/{p})" for p in plots] + [""]
    (here / "RESULTS.md").write_text("\n".join(parts))


if __name__ == "__main__":
    render(Path(__file__).resolve().parent)
