"""Mutation check of the campaign: remove one safety check at a time and see which seeds fail.

Nothing under ``service/`` is edited, and no source text: each safety check is a named unit —
a function of ``service/checks.py``, or a method of the engine, the pod client or the listener —
and a removal replaces that unit, by its name, with a stand-in written here (a check that always
passes, a clearing that clears nothing) for the duration of one campaign, then restores the
original. A name that no longer exists raises (:func:`replaced`). Run
``python -m tests.chaos.removals [--seeds N] [--only NAME ...]``; the table it prints is what
docs/reliability.md records. Exit status 1 when a removal went unnoticed. ``--engine sim``
applies the removals to the deterministic simulator (``tests/sim``) instead of the campaign:
:data:`REMOVALS` on both, and on the simulator the classifier's rules, the informer's silence
bound, the transport's re-read of the token at a 401, and the trigger's notified changes too
(:data:`SIM_REMOVALS`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio

from service import checks, classifier
from service.domain import ExecutionChange, ExecutionRow
from service.engine.budget import DeleteBudget
from service.engine.controller import Controller
from service.engine.reconciler import Reconciler
from service.kube.reflector import Reflector
from service.kube.transport import ApiTransport
from tests.chaos.campaign import run_campaign
from tests.chaos.checker import SeedResult
from tests.chaos.model import RowTruth
from tests.chaos.schedule import CampaignConfig
from tests.sim import pg as sim_pg


@contextlib.contextmanager
def replaced(owner: Any, name: str, stand_in: Any) -> Iterator[None]:
    """``owner.<name>`` (a module's function or a class's method, defined there under that
    name) replaced by ``stand_in`` for the duration."""
    original = vars(owner).get(name)
    if original is None:
        raise RuntimeError(f"{getattr(owner, '__name__', owner)} has no check named {name!r}")
    setattr(owner, name, stand_in)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _passes(*_args: Any) -> bool:
    return True


def _never(*_args: Any) -> bool:
    return False


async def _synced(_barrier: Any) -> None:
    return None


def _no_preconditions(_uid: str, _resource_version: str) -> dict[str, str]:
    return {}


def _nothing_cleared(_changes: Sequence[ExecutionChange]) -> list[str]:
    return []


def _reactivations_cleared(changes: Sequence[ExecutionChange]) -> list[str]:
    # A notification that still says "retired" keeps the clock running.
    return [change.key for change in changes if not change.retired]


def _no_pod_event_clearing(_self: Controller, _old: Any, _new: Any, *, candidate: bool) -> None:
    pass


async def _no_rows(_self: Reconciler, _keys: list[str]) -> dict[str, ExecutionRow]:
    return {}


class _FreeTurn:
    async def take(self) -> float:
        return 0.0

    def release(self) -> None:
        pass


async def _no_budget(_self: DeleteBudget) -> _FreeTurn:
    return _FreeTurn()


REMOVALS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "pod_event_clearing": lambda: replaced(
        Controller, "_clear_for_pod_event", _no_pod_event_clearing
    ),
    "row_event_clearing": lambda: replaced(checks, "keys_cleared_by", _nothing_cleared),
    "pod_change_clearing": lambda: replaced(checks, "pod_state_changed", _never),
    "retired_notification_clearing": lambda: replaced(
        checks, "keys_cleared_by", _reactivations_cleared
    ),
    "uid_comparison": lambda: replaced(checks, "uid_unchanged", _passes),
    "fresh_reclassify": lambda: replaced(checks, "verdict_unchanged", _passes),
    "resource_version_check": lambda: replaced(checks, "resource_version_unchanged", _passes),
    "notification_sync": lambda: replaced(checks, "sync_notifications", _synced),
    "delete_preconditions": lambda: replaced(checks, "delete_preconditions", _no_preconditions),
    "budget": lambda: replaced(DeleteBudget, "turn", _no_budget),
    "dry_run_suppression": lambda: replaced(checks, "deletes_allowed", _passes),
    "observation_threshold": lambda: replaced(checks, "observed_long_enough", _passes),
    # The batch's classification against its rows: every candidate classified as if it had none.
    "observed_row": lambda: replaced(Reconciler, "_lookup", _no_rows),
    # The listener's delivery proof: a probe counts as arrived once it is sent.
    "delivery_proof": lambda: replaced(checks, "probe_delivered", _passes),
}


def _no_skip(*_args: Any) -> None:
    return None


RULE_REMOVALS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    name: functools.partial(replaced, classifier, function, _no_skip)
    for name, function in {
        # The prefilter's rules.
        "keep_annotation": "kept",
        "terminating": "_terminating",
        "unlabelled": "_unlabelled",
        "unknown_pod_kind": "_unknown_pod_kind",
        "pending_with_ip": "_pending_with_ip",
        "pending_restore_pod": "_pending_restore_pod",
        "pending_condition": "_pending_condition",
        "terminal_without_container_statuses": "_terminal_without_container_statuses",
        "terminal_container_running": "_terminal_container_running",
        # The row's identity fields, and its active flag.
        "not_kubernetes_managed": "_not_kubernetes_managed",
        "namespace_mismatch": "_namespace_mismatch",
        "pod_name_mismatch": "_pod_name_mismatch",
        "sandbox_mismatch": "_sandbox_mismatch",
        "generation_mismatch": "_generation_mismatch",
        "pod_kind_mismatch": "_pod_kind_mismatch",
        "row_active": "_row_active",
    }.items()
}
"""The classifier's rules, each disabled by its name (the rule skips nothing). Not part of
:data:`REMOVALS`: the campaign's world has none of the shapes most of them are the only check
for; the simulator's has (``tests/sim/world.py``, ``World.oddities``), and it must catch each but
those :data:`HELD_ELSEWHERE` (:data:`SIM_REMOVALS`; ``--engine sim --rules`` runs them all)."""

HELD_ELSEWHERE: dict[str, str] = {
    "not_kubernetes_managed": "LOOKUP_SQL returns rows of Kubernetes-managed sandboxes only "
    "(decode_row sets kubernetes_managed)",
    "namespace_mismatch": "the store keeps a row only under its own key (namespace/pod name, "
    "PgExecutionStore._query): the row a pod's key finds names that pod's namespace",
    "pod_name_mismatch": "the store keeps a row only under its own key (namespace/pod name, "
    "PgExecutionStore._query): the row a pod's key finds names that pod",
}
"""The rules no world can make the only check standing, and what answers the same for every
pod and row the product can see: removing one alone changes no decision of the composed product
(an equivalent mutant). The simulator runs them too (``--rules``), and fails if one is caught
(then this reason is wrong)."""


def _no_silence_bound(
    _self: Reflector, _opened: float, _timeout_cap: int | None
) -> tuple[float, float] | None:
    return None


async def _no_reread_at_401(self: ApiTransport, _generation: int) -> str | None:
    # The Authorization the request was sent with stays: only the periodic re-read (once a
    # minute, the configuration's refresh hook) ever reads the token file again.
    return await self._authorization()


LIVENESS_REMOVALS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    # The informer's silence bound, before bookmarks are proven (the server's end of a short
    # watch) and after: a watch whose connection died silently is read until the request's read
    # timeout gives up.
    "watch_silence_bound": lambda: replaced(Reflector, "_silence_bound", _no_silence_bound),
    # The transport's re-read of the credentials at a 401: a refused request is not sent again
    # with a new token, and the next ones carry the revoked one until the periodic re-read.
    "reread_at_401": lambda: replaced(ApiTransport, "_reauthenticate", _no_reread_at_401),
}
"""What keeps the pod cache from going deaf, or the client from being refused for a minute,
rather than a delete safe. Not part of :data:`REMOVALS`: the campaign's emulator never drops a
connection silently nor revokes a token; the simulator's API server model does
(``tests/sim/kube.py``, ``ApiServer.kill_watches``; ``World.rotate_token``)."""


def _inserted_inactive(old: RowTruth | None, new: RowTruth | None) -> bool:
    return old is None and new is not None and not new.active


def _retired(old: RowTruth | None, new: RowTruth | None) -> bool:
    return old is not None and new is not None and old.active and not new.active


def _reactivated(old: RowTruth | None, new: RowTruth | None) -> bool:
    return old is not None and new is not None and not old.active and new.active


def _state_changed_inactive(old: RowTruth | None, new: RowTruth | None) -> bool:
    return (
        old is not None
        and new is not None
        and not old.active
        and not new.active
        and old.state != new.state
    )


def _deleted_inactive(old: RowTruth | None, new: RowTruth | None) -> bool:
    return old is not None and new is None and not old.active


def _trigger_forgets(
    kind: Callable[[RowTruth | None, RowTruth | None], bool],
) -> contextlib.AbstractContextManager[None]:
    notifies = sim_pg.trigger_notifies

    def forgetful(old: RowTruth | None, new: RowTruth | None) -> bool:
        return notifies(old, new) and not kind(old, new)

    return replaced(sim_pg, "trigger_notifies", forgetful)


TRIGGER_REMOVALS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "trigger_insert_inactive": lambda: _trigger_forgets(_inserted_inactive),
    "trigger_retirement": lambda: _trigger_forgets(_retired),
    "trigger_reactivation": lambda: _trigger_forgets(_reactivated),
    "trigger_state_change_inactive": lambda: _trigger_forgets(_state_changed_inactive),
    "trigger_delete_inactive": lambda: _trigger_forgets(_deleted_inactive),
}
"""The database's promise, not the product's checks: each a trigger that forgets one kind of the
changes the data contract says it notifies (docs/architecture.md, "The change
notifications"): a row inserted inactive, a retirement, a re-activation, a state change while
inactive, a row deleted while inactive. Each replaces the simulator's model of the trigger
(``tests/sim/pg.py``, ``trigger_notifies``) with the same rule less that kind. Not part of
:data:`REMOVALS`: the campaign runs the real trigger on a real server."""

SIM_REMOVALS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    **REMOVALS,
    **{name: r for name, r in RULE_REMOVALS.items() if name not in HELD_ELSEWHERE},
    **LIVENESS_REMOVALS,
    **TRIGGER_REMOVALS,
}
"""What the simulator must catch (``make sim-removals``): every removal, every classifier
rule but those :data:`HELD_ELSEWHERE`, the :data:`LIVENESS_REMOVALS` and the
:data:`TRIGGER_REMOVALS`."""


def first_violation(result: SeedResult) -> str:
    return result.violations[0][:160] if result.violations else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, help="24 on the campaign, 2000 on the simulator")
    parser.add_argument("--start", type=int, default=1)
    parser.add_argument(
        "--only",
        nargs="*",
        choices=sorted({*REMOVALS, *RULE_REMOVALS, *LIVENESS_REMOVALS, *TRIGGER_REMOVALS}),
    )
    parser.add_argument("--rules", action="store_true", help="the classifier's rules instead")
    parser.add_argument("--engine", choices=("campaign", "sim"), default="campaign")
    args = parser.parse_args(argv)
    if args.engine == "sim":
        # Imported here: the simulator's runner imports REMOVALS from this module.
        from tests.sim.runner import removals  # noqa: PLC0415

        if args.rules:
            return removals(
                args.only,
                args.seeds or 2000,
                args.start,
                table=RULE_REMOVALS,
                what="classifier rule removals",
                held=HELD_ELSEWHERE,
            )
        return removals(
            args.only,
            args.seeds or 2000,
            args.start,
            table={**RULE_REMOVALS, **SIM_REMOVALS} if args.only else SIM_REMOVALS,
            held=HELD_ELSEWHERE,
        )
    seeds = list(range(args.start, args.start + (args.seeds or 24)))
    unnoticed = []
    runs: list[tuple[str, Callable[[], contextlib.AbstractContextManager[None]]]] = [
        ("baseline", contextlib.nullcontext)
    ]
    table = RULE_REMOVALS if args.rules else REMOVALS
    outside = sorted(set(args.only or ()) - set(table))
    if outside:
        parser.error(f"not in this table (--rules; --engine sim): {', '.join(outside)}")
    runs += [(name, table[name]) for name in args.only or list(table)]
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
