"""Mutation check of the campaign: remove one safety check at a time and see which seeds fail.

Nothing under ``service/`` is edited: each removal patches a *copy* in memory (a method whose
source is copied and edited, or a replacement method) for the duration of one campaign, then
restores the original. Run ``python -m tests.chaos.removals [--seeds N] [--only NAME ...]``; the
table it prints is what docs/reliability.md records. Exit status 1 when a removal went unnoticed.
``--engine sim`` applies the same removals to the deterministic simulator (``tests/sim``)
instead of the campaign; :data:`REMOVALS` is what both apply.
"""

from __future__ import annotations
import __future__

import argparse
import contextlib
import functools
import inspect
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio

from service.classifier import prefilter
from service.domain import Decision
from service.engine import controller as controller_module
from service.engine import reconciler as reconciler_module
from service.engine.budget import DeleteBudget
from service.kube import client as client_module
from service.pg import listener as listener_module
from tests.chaos.campaign import run_campaign
from tests.chaos.checker import SeedResult
from tests.chaos.schedule import CampaignConfig


def _edited(
    func: Callable[..., Any], module: Any, *edits: tuple[str, str], **names: Any
) -> Callable[..., Any]:
    """A copy of ``func`` with each ``(old, new)`` applied to its source (``old`` occurs once),
    running in the module's globals plus ``names``."""
    source = textwrap.dedent(inspect.getsource(func))
    for old, new in edits:
        if source.count(old) != 1:
            raise RuntimeError(f"{func.__qualname__}: expected one {old!r} in the source")
        source = source.replace(old, new)
    code = compile(
        source,
        f"<edited {func.__qualname__}>",
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    namespace: dict[str, Any] = {}
    exec(code, {**vars(module), **names}, namespace)
    edited: Callable[..., Any] = namespace[func.__name__]
    return edited


Reconciler = reconciler_module.Reconciler


def _reconciler_edit(
    method: str, old: str, new: str, **names: Any
) -> contextlib.AbstractContextManager[None]:
    """Patch ``Reconciler.<method>`` with a copy whose source has ``old`` replaced by ``new``."""
    return _patched(
        Reconciler,
        method,
        _edited(getattr(Reconciler, method), reconciler_module, (old, new), **names),
    )


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _no_pod_event_clearing(self: Any, old: Any, new: Any) -> None:
    # Controller.pod_changed without any clock clearing: only the enqueue is kept.
    if new is not None and prefilter(new) is None:
        self._enqueue(new.key)


def _no_row_event_clearing(self: Any, changes: Any) -> None:
    # Controller.executions_changed without any clock clearing: only the enqueue is kept.
    self._enqueue_many([change.key for change in changes])


class _FreeTurn:
    async def take(self) -> float:
        return 0.0

    def release(self) -> None:
        pass


async def _no_budget(self: DeleteBudget) -> _FreeTurn:
    return _FreeTurn()


REMOVALS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "pod_event_clearing": lambda: _patched(
        controller_module.Controller, "pod_changed", _no_pod_event_clearing
    ),
    "row_event_clearing": lambda: _patched(
        controller_module.Controller, "executions_changed", _no_row_event_clearing
    ),
    "pod_change_clearing": lambda: _patched(
        controller_module.Controller,
        "pod_changed",
        _edited(
            controller_module.Controller.pod_changed,
            controller_module,
            ("self._clocks.clear(new.uid)", "pass"),
        ),
    ),
    "retired_notification_clearing": lambda: _patched(
        controller_module.Controller,
        "executions_changed",
        _edited(
            controller_module.Controller.executions_changed,
            controller_module,
            (
                "self._clocks.clear_keys(keys)",
                "self._clocks.clear_keys([c.key for c in changes if not c.retired])",
            ),
        ),
    ),
    "uid_comparison": lambda: _reconciler_edit(
        "_verify", "if fresh.uid != pod.uid or again.verdict", "if again.verdict"
    ),
    "fresh_reclassify": lambda: _reconciler_edit(
        "_verify",
        "again = classify(fresh, fresh_row)",
        'again = Decision.reap(verdict, "")',
        Decision=Decision,
    ),
    "resource_version_check": lambda: _reconciler_edit(
        "_verify", "and (fresh.resource_version != pod.resource_version)", "and False"
    ),
    "notification_sync": lambda: _reconciler_edit(
        "_verify",
        'await _bounded("notification sync", self._db_timeout_s, self._barrier.sync())',
        "pass",
    ),
    "delete_preconditions": lambda: _patched(
        client_module.KubePodClient,
        "delete_pod",
        _edited(
            client_module.KubePodClient.delete_pod,
            client_module,
            ('"preconditions": {"uid": uid, "resourceVersion": resource_version},', ""),
        ),
    ),
    "budget": lambda: _patched(DeleteBudget, "turn", _no_budget),
    "dry_run_suppression": lambda: _reconciler_edit(
        "_act", "if self._settings.dry_run:", "if False:"
    ),
    # One place each since observation is batch-native (each used to be written twice).
    "observation_threshold": lambda: _reconciler_edit(
        "_observe", "elif elapsed < threshold_s:", "elif False:"
    ),
    "observed_row": lambda: _reconciler_edit(
        "_observe",
        "decision = classify(pod, rows.get(key))",
        "decision = classify(pod, None)",
    ),
    # The listener's delivery proof: a probe counts as arrived once it is sent (the wait for
    # its arrival on the listening connection, the whole statement, replaced).
    "delivery_proof": lambda: _patched(
        listener_module.RetirementListener,
        "_round_trip",
        _edited(
            listener_module.RetirementListener._round_trip,
            listener_module,
            (
                "while self._probes_arrived < seq and not lost.is_set():\n"
                "                await self._probe_arrival.wait()\n",
                "self._probes_arrived = seq\n",
            ),
        ),
    ),
}


def first_violation(result: SeedResult) -> str:
    return result.violations[0][:160] if result.violations else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, help="24 on the campaign, 2000 on the simulator")
    parser.add_argument("--start", type=int, default=1)
    parser.add_argument("--only", nargs="*", choices=sorted(REMOVALS))
    parser.add_argument("--engine", choices=("campaign", "sim"), default="campaign")
    args = parser.parse_args(argv)
    if args.engine == "sim":
        # Imported here: the simulator's runner imports REMOVALS from this module.
        from tests.sim.runner import removals  # noqa: PLC0415

        return removals(args.only, args.seeds or 2000, args.start)
    seeds = list(range(args.start, args.start + (args.seeds or 24)))
    unnoticed = []
    runs: list[tuple[str, Callable[[], contextlib.AbstractContextManager[None]]]] = [
        (
            "baseline",
            lambda: _reconciler_edit(
                "_act", "if self._settings.dry_run:", "if self._settings.dry_run:"
            ),
        )
    ]
    runs += [(name, REMOVALS[name]) for name in args.only or list(REMOVALS)]
    baseline_failed: set[int] = set()
    for name, removal in runs:
        started = time.monotonic()
        with removal():
            results = anyio.run(functools.partial(run_campaign, seeds, cfg=CampaignConfig()))
        failed = [r for r in results if not r.ok]
        caught = [r for r in failed if r.seed not in baseline_failed]
        if name == "baseline":
            baseline_failed = {r.seed for r in failed}
        print(
            f"== {name}: {len(failed)}/{len(seeds)} seeds failed "
            f"({time.monotonic() - started:.0f}s): {' '.join(str(r.seed) for r in failed)}"
            + (
                ""
                if name == "baseline"
                else f"; caught by seeds passing the baseline: "
                f"{' '.join(str(r.seed) for r in caught)}"
            )
        )
        for r in (failed if name == "baseline" else caught)[:4]:
            print(f"   seed {r.seed}: {first_violation(r)}")
        if name != "baseline" and not caught:
            unnoticed.append(name)
    if unnoticed:
        print(f"UNNOTICED removals: {', '.join(unnoticed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
