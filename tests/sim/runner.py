"""Sweeps, replays, shrinking and the removals check of the simulator (``python -m tests.sim``)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tests.chaos.removals import HELD_ELSEWHERE, RULE_REMOVALS, SIM_REMOVALS
from tests.chaos.schedule import Step
from tests.sim.calibration import REVERTS
from tests.sim.seed import SimConfig, SimResult, run_seed, schedule_for

CONTEXT_S = 1.5
"""Trace shown before a violation (and 0.1 s after it)."""


@dataclass(frozen=True, slots=True)
class Summary:
    """What a worker process sends back for one seed."""

    seed: int
    ok: bool
    deletes: int
    reports: int
    virtual_s: float
    trace_hash: str
    first: str


def quiet_logs() -> None:
    logging.disable(logging.CRITICAL)


def tune_gc() -> None:
    """The imported modules out of every collection, and the default young generation (700):
    a seed's cyclic garbage is then collected while it is still in the CPU's caches (CPU in the
    collector, 400 seeds: 0.43-0.54 ms a seed at 700, 0.75-0.94 ms at 20,000)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(700, 20, 100)


def run_range(seeds: range, cfg: SimConfig = SimConfig()) -> list[Summary]:
    quiet_logs()
    out = []
    for seed in seeds:
        r = run_seed(seed, cfg)
        out.append(
            Summary(
                seed,
                r.ok,
                r.deletes,
                r.reports,
                r.virtual_s,
                r.trace_hash,
                r.violations[0][1] if r.violations else "",
            )
        )
    return out


def _chunk(args: tuple[int, int, SimConfig]) -> list[Summary]:
    start, stop, cfg = args
    tune_gc()
    return run_range(range(start, stop), cfg)


def sweep(
    seeds: range, *, jobs: int = 1, cfg: SimConfig = SimConfig(), chunk: int = 250
) -> list[Summary]:
    """Every seed of ``seeds``, on ``jobs`` processes (shards of ``chunk`` seeds)."""
    if jobs <= 1:
        tune_gc()
        return run_range(seeds, cfg)
    parts = [(s, min(s + chunk, seeds.stop), cfg) for s in range(seeds.start, seeds.stop, chunk)]
    ctx = multiprocessing.get_context("fork")
    out: list[Summary] = []
    with ctx.Pool(jobs) as pool:
        for part in pool.imap(_chunk, parts):
            out.extend(part)
    return out


# -- shrinking ------------------------------------------------------------------------------


def fails(seed: int, cfg: SimConfig, steps: list[Step]) -> bool:
    return not run_seed(seed, cfg, steps=steps).ok


def shrink(seed: int, cfg: SimConfig, steps: list[Step], budget: int = 200) -> list[Step]:
    """The shortest failing prefix of ``steps``, then delta debugging (ddmin) over its steps.
    Every candidate keeps the seed's other streams (faults, loop order, the service's)."""
    runs = 0
    prefix = steps
    for n in range(len(steps) + 1):
        runs += 1
        if fails(seed, cfg, steps[:n]):
            prefix = steps[:n]
            break
    current = prefix
    granularity = 2
    while len(current) >= 2 and runs < budget:
        size = len(current) // granularity
        reduced = False
        for i in range(granularity):
            complement = current[: i * size] + current[(i + 1) * size :]
            runs += 1
            if complement and fails(seed, cfg, complement):
                current = complement
                granularity = max(granularity - 1, 2)
                reduced = True
                break
        if not reduced:
            if granularity >= len(current):
                break
            granularity = min(len(current), granularity * 2)
    return current


def describe_steps(steps: list[Step], original: list[Step]) -> str:
    index = {id(s): i for i, s in enumerate(original)}
    return ", ".join(f"#{index.get(id(s), '?')} {s.kind}" for s in steps) or "(no steps)"


def excerpt(result: SimResult, at: float) -> list[str]:
    """The trace of the ``CONTEXT_S`` before ``at`` (at least its last 30 lines: a liveness
    deadline may fall in a quiet stretch)."""
    before = [line for line in result.trace if float(line.split(" ", 1)[0]) <= at + 0.1]
    recent = [line for line in before if float(line.split(" ", 1)[0]) >= at - CONTEXT_S]
    return (recent if len(recent) >= 30 else before[-30:])[-120:]


def report_failure(
    seed: int, cfg: SimConfig, out: Callable[[str], None] = print, applied: str | None = None
) -> None:
    quiet_logs()
    original = schedule_for(seed, cfg)
    first = run_seed(seed, cfg)
    out(f"FAILED seed {seed} [{first.mode}] trace {first.trace_hash}")
    for t, v in first.violations[:5]:
        out(f"  - at {t:.6f}: {v}")
    shrunk = shrink(seed, cfg, original)
    out(
        f"  shrunk: {len(shrunk)} of {len(original)} steps fail too: "
        + describe_steps(shrunk, original)
    )
    logging.disable(logging.NOTSET)
    logging.getLogger("service").setLevel(logging.INFO)
    replay = run_seed(seed, cfg, steps=shrunk, keep_trace=True, logs=True)
    quiet_logs()
    if replay.violations:
        at, why = replay.violations[0]
        out(f"  the shrunk schedule's first violation, at {at:.6f}: {why}")
        out("  the interleaving before it (# lines are the service's log, not hashed):")
        for line in excerpt(replay, at):
            out("    " + line)
    out(
        f"  replay: python -m tests.sim --seed {seed} --with {applied}"
        if applied
        else f"  replay: make sim SEED={seed}"
    )


# -- the removals check ---------------------------------------------------------------------


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def removals(
    names: list[str] | None,
    seeds: int,
    start: int,
    *,
    table: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = SIM_REMOVALS,
    what: str = "removals",
    baseline: bool = True,
    held: dict[str, str] | None = None,
) -> int:
    """Each removal of ``table`` (tests/chaos/removals.py's, or the reverts of
    tests/sim/calibration.py) in turn, after a baseline of the same seeds; each stops at the
    first seed that fails. ``held``: removals no seed may catch (equivalent mutants), each with
    what holds its check; one caught fails the run."""
    held = held or {}
    misjudged: list[str] = []
    quiet_logs()
    tune_gc()
    cfg = SimConfig()
    unnoticed = []
    runs: list[tuple[str, Callable[[], contextlib.AbstractContextManager[None]]]] = (
        [("baseline", _nothing)] if baseline else []
    )
    runs += [(n, table[n]) for n in names or list(table)]
    print(f"{what} on the simulator: up to {seeds} seeds each from seed {start}")
    for name, removal in runs:
        started = time.process_time()
        caught: SimResult | None = None
        ran = 0
        with removal():
            for seed in range(start, start + seeds):
                ran += 1
                r = run_seed(seed, cfg)
                if not r.ok:
                    caught = r
                    if name != "baseline":
                        break
        cpu = time.process_time() - started
        if name == "baseline":
            print(f"== baseline: {'FAILED' if caught else 'ok'} on {ran} seeds ({cpu:.1f}s)")
            if caught:
                return 1
            continue
        if name in held:
            if caught is None:
                print(f"== {name}: not caught in {ran} seeds ({cpu:.1f}s), held by {held[name]}")
            else:
                misjudged.append(name)
                print(f"== {name}: caught by seed {caught.seed}, though said to be held")
        elif caught is None:
            unnoticed.append(name)
            print(f"== {name}: NOT caught in {ran} seeds ({cpu:.1f}s)")
        else:
            print(
                f"== {name}: caught by seed {caught.seed} after {ran} seeds ({cpu:.1f}s CPU): "
                f"{caught.violations[0][1][:150]}"
            )
    if misjudged:
        print(f"CAUGHT though held elsewhere: {', '.join(misjudged)}")
    if unnoticed:
        print(f"UNNOTICED {what}: {', '.join(unnoticed)}")
    return 1 if unnoticed or misjudged else 0


# -- the command line -------------------------------------------------------------------------


def replay(seed: int, cfg: SimConfig, steps: str | None) -> int:
    logging.getLogger("service").setLevel(logging.INFO)
    schedule = schedule_for(seed, cfg)
    chosen = schedule if steps is None else [schedule[int(i)] for i in steps.split(",") if i]
    r = run_seed(seed, cfg, steps=chosen, keep_trace=True, logs=True)
    for line in r.trace:
        print(line)
    print(
        f"seed {seed} [{r.mode}] {'ok' if r.ok else 'FAILED'}: {r.deletes} deletes, "
        f"{r.reports} reports, {r.virtual_s:.1f} virtual s, steps "
        + describe_steps(chosen, schedule)
    )
    for t, v in r.violations:
        print(f"  - at {t:.6f}: {v}")
    print(f"trace {r.trace_hash}")
    return 0 if r.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim", description=__doc__)
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--start", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--seed", type=int, help="replay one seed, with its trace")
    parser.add_argument("--steps", help="replay: only these steps of the schedule (0,3,7)")
    parser.add_argument("--hashes", action="store_true", help="print each seed's trace hash")
    parser.add_argument("--removals", action="store_true", help="the mutation check")
    parser.add_argument(
        "--calibrate", action="store_true", help="the two race fixes reverted, one at a time"
    )
    parser.add_argument("--no-baseline", action="store_true", help="removals: skip the baseline")
    parser.add_argument("--only", nargs="*", help="removals: only these")
    parser.add_argument(
        "--with",
        dest="applied",
        choices=sorted({*SIM_REMOVALS, *RULE_REMOVALS, *REVERTS}),
        help="replay or sweep with one removal (tests/chaos/removals.py) or revert applied",
    )
    args = parser.parse_args(argv)
    cfg = SimConfig()
    if args.applied is not None:
        with {**RULE_REMOVALS, **SIM_REMOVALS, **REVERTS}[args.applied]():
            return _main(args, cfg)
    return _main(args, cfg)


def _main(args: argparse.Namespace, cfg: SimConfig) -> int:
    if args.seed is not None:
        return replay(args.seed, cfg, args.steps)
    if args.removals:
        return removals(
            args.only,
            args.seeds,
            args.start,
            table={**RULE_REMOVALS, **SIM_REMOVALS} if args.only else SIM_REMOVALS,
            baseline=not args.no_baseline,
            held=HELD_ELSEWHERE,
        )
    if args.calibrate:
        return removals(
            args.only,
            args.seeds,
            args.start,
            table=REVERTS,
            what="reverted race fixes",
            baseline=not args.no_baseline,
        )
    seeds = range(args.start, args.start + args.seeds)
    wall = time.monotonic()
    cpu = time.process_time()
    results = sweep(seeds, jobs=args.jobs, cfg=cfg)
    wall = time.monotonic() - wall
    cpu = time.process_time() - cpu
    failed = [r for r in results if not r.ok]
    if args.hashes:
        for r in results:
            print(f"seed {r.seed} trace {r.trace_hash}{'' if r.ok else ' FAILED'}")
    for r in failed[:3]:
        report_failure(r.seed, cfg, applied=args.applied)
    for r in failed[3:20]:
        print(f"FAILED seed {r.seed}: {r.first[:200]}")
    n = len(results)
    print(
        f"{n} seeds, {len(failed)} failed, {sum(r.deletes for r in results)} deletes, "
        f"{sum(r.reports for r in results)} reports, "
        f"{sum(r.virtual_s for r in results):.0f} virtual s, {wall:.1f} s wall on "
        f"{args.jobs} job(s), {n / wall * 60:.0f} seeds/min"
        + (f" ({n / cpu * 60:.0f} seeds/min of this process's CPU)" if args.jobs <= 1 else "")
    )
    sys.stdout.flush()
    return 1 if failed else 0
