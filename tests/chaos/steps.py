"""What each kind of step of a seed's schedule does to the seed's world.

:func:`apply_step` performs one :class:`tests.chaos.schedule.Step` through the seed's
:class:`tests.chaos.world.World`: pod creation, phase / IP / condition changes, blips (a change
and its reversal in the same instant), recreation under the same name, deletion by others, row
retirement (suspended, replaced, ...), re-activation, new generations, bursts of simultaneous
retirements; faults: watch drop (abrupt or clean), forced 410, compaction, API 500/429, GET
latency, ``pg_terminate_backend``, a PostgreSQL restart, a silently stalled listener
connection; composite scenarios (recreate behind a stale cache; re-activate behind a stalled
listener; re-activate behind the trigger's back); and, after half of the bursts, a change while
workers wait for delete tokens that exactly one check of the service can see
(:func:`while_waiting_for_tokens`).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import anyio

from tests.chaos.model import (
    NON_REAPABLE_SHAPES,
    TERMINAL_REAPABLE,
    PodLife,
    PodShape,
    RowTruth,
    reactivate,
    reapable,
    retire,
)
from tests.chaos.schedule import Step
from tests.chaos.world import World

TARGETED = frozenset(
    {"pod_blip", "row_blip", "stale_recreate", "stall_reactivate", "silent_reactivate"}
)
"""Steps aimed at one of the sandboxes reapable the longest (:func:`oldest_reapable`)."""

ROW_STEPS = frozenset(
    {"retire", "reactivate", "row_blip", "new_generation", "stall_reactivate", "silent_reactivate"}
)
"""Steps that write a row (skipped for a sandbox whose row a silent change froze)."""


def oldest_reapable(world: World, amount: float) -> int | None:
    """Index of one of the three sandboxes reapable (ground truth) for the longest time: the
    ones whose clocks run, or that wait for a delete token — where a lost event matters. Of the
    campaign's world or the simulator's (both have ``sandboxes``, ``life()`` and ``rows``)."""
    candidates: list[tuple[float, int]] = []
    for i, sb in enumerate(world.sandboxes):
        name = sb.name()
        life = world.life(name)
        row = world.rows.get(name)
        if life is None or row is None or not reapable(life.current, row.current):
            continue
        candidates.append((max(life.times[-1], row.his[-1]), i))
    if not candidates:
        return None
    candidates.sort()
    return candidates[int(amount * min(3, len(candidates)))][1]


def token_wait_pod_changes(world: Any, lives: list[PodLife], variant: str) -> bool:
    """The pod changes of a token-wait ``variant`` made to ``lives`` (the campaign's world or
    the simulator's: both have ``sandboxes``, ``delete_pod``, ``create_pod`` and ``set_shape``);
    ``False`` for a variant that changes rows instead."""
    if variant == "recreated":
        for life in lives:
            state = life.states[-1]
            world.delete_pod(life)
            sb = next(sb for sb in world.sandboxes if sb.name() == life.name)
            world.create_pod(sb, state.generation, state.shape, state.kind)
    elif variant == "lagged":
        for life in lives:
            current = life.states[-1].shape
            world.set_shape(life, NON_REAPABLE_SHAPES[len(life.name) % len(NON_REAPABLE_SHAPES)])
            world.set_shape(life, current)
    elif variant == "pending_blip":
        for life in lives:
            state = life.states[-1]
            if state.shape in TERMINAL_REAPABLE and state.kind == "create":
                world.set_shape(life, PodShape.PENDING_STUCK)
                world.set_shape(life, state.shape)
    else:
        return False
    return True


def token_wait_blip_rows(retired: dict[str, RowTruth], variant: str) -> dict[str, RowTruth]:
    """The rows a token-wait row ``variant`` passes ``retired`` through: another retired state
    for ``retired_blip``, active for the others."""
    return {
        name: retire(row, "suspended") if variant == "retired_blip" else reactivate(row)
        for name, row in retired.items()
    }


def token_wait(step: Step) -> tuple[str, float] | None:
    """For a ``burst`` step followed by a change while workers wait for delete tokens (half of
    them): the variant and where in the wait, as a fraction; else ``None``."""
    if not step.flag:
        return None
    n = len(TOKEN_WAIT_VARIANTS)
    return TOKEN_WAIT_VARIANTS[int(step.amount * n)], (step.amount * n) % 1


def burst_changes(world: Any, variant: str | None) -> dict[str, RowTruth]:
    """A ``burst``: every sandbox with a pod and a row that a silent change did not freeze is
    made reapable — its pod terminal, its row retired (`suspended`); for ``retired_blip``, a
    create pod Pending never started with its row retired as `replaced`. Sets the pods' shapes
    (of either world) and returns the rows to write, for the caller to write as one batch."""
    changes: dict[str, RowTruth] = {}
    for other in world.sandboxes:
        other_name = other.name()
        other_life = world.life(other_name)
        other_row = world.rows[other_name].current if other_name in world.rows else None
        if other_life is None or other_row is None or other.row_frozen:
            continue
        pod_now = other_life.states[-1]
        if variant == "retired_blip" and pod_now.kind == "create":
            if pod_now.shape is not PodShape.PENDING_STUCK:
                world.set_shape(other_life, PodShape.PENDING_STUCK)
            changes[other_name] = retire(other_row, "replaced")
            continue
        if pod_now.shape not in TERMINAL_REAPABLE:
            world.set_shape(other_life, PodShape.SUCCEEDED)
        changes[other_name] = retire(other_row, "suspended")
    return changes


def row_blip_middle(step: Step, row: RowTruth) -> RowTruth:
    """The row a ``row_blip`` passes through: re-activated; or, when the row says `replaced`
    (and the step's flag), another retired state (`suspended`): still retired, yet a Pending
    never-started pod is reapable only with `replaced`."""
    return retire(row, "suspended") if step.flag and row.state == "replaced" else reactivate(row)


def recreated_pod(step: Step, kind: str) -> tuple[PodShape, str]:
    """The shape and pod kind a ``recreate`` step gives the new pod of a sandbox of ``kind``
    (now and then the other kind)."""
    pod_kind = kind if step.amount < 0.85 else ("restore" if kind == "create" else "create")
    return (step.shape if not step.flag else PodShape.SUCCEEDED), pod_kind


def shape_for(step: Step, life: PodLife) -> PodShape:
    """The shape a ``shape``, ``shape_reapable``, ``ip`` or ``condition`` step gives the pod."""
    if step.kind == "shape":
        return step.shape
    if step.kind == "shape_reapable":
        return [PodShape.SUCCEEDED, PodShape.FAILED, PodShape.PENDING_STUCK][int(step.amount * 3)]
    if step.kind == "ip":
        return PodShape.PENDING_WITH_IP
    current = life.states[-1].shape
    return PodShape.PENDING_READY if current is PodShape.PENDING_STUCK else PodShape.PENDING_STUCK


def blip_shape(step: Step, life: PodLife) -> PodShape:
    """The non-reapable shape a ``pod_blip`` passes the pod through."""
    if (
        step.flag
        and life.states[-1].shape in TERMINAL_REAPABLE
        and life.states[-1].kind == "create"
    ):
        # Through Pending with no IP and the condition False: a pod-only check passes it, but
        # it is reapable only with a row retired as `replaced`.
        return PodShape.PENDING_STUCK
    return NON_REAPABLE_SHAPES[int(step.amount * len(NON_REAPABLE_SHAPES))]


async def until_paced(world: World, since: float) -> None:
    """Wait until the budget's burst is spent: a DELETE after ``since`` has been seen, and then
    none for 0.15 s (the pacer's next token is up to 1/r ≈ 1.1 s away; workers wait for it).
    Gives up 3 s after ``since``."""
    deadline = since + 3.0
    last = 0.0
    while (now := time.time()) < deadline:
        deletes = [
            e.time_s
            for e in world.emu.audit
            if e.method == "DELETE" and e.time_s >= since and e.status in (200, 202)
        ]
        last = max(deletes, default=0.0)
        if last and now - last >= 0.15:
            return
        await anyio.sleep(0.02)


BLIP_GAP_S = 0.02
"""Between the two statements of a row blip. Each commit is only known to lie in the
[sent, answered] interval of its statement, and inside it the checker accepts either state: back
to back, the two intervals touch and the middle state could have lived for no instant at all.
With a gap it provably lived (at least this long), so a DELETE that ignored it is a violation."""


TOKEN_WAIT_VARIANTS = ("silent", "stalled", "lagged", "pending_blip", "retired_blip", "recreated")


async def while_waiting_for_tokens(
    world: World, names: list[str], variant: str, fraction: float
) -> None:
    """After a burst, while workers wait for delete tokens holding candidates they verified,
    change every pod or row left behind the service's back. Each variant leaves exactly one
    check of the service able to see the change:

    * ``silent``: re-activate the rows behind the trigger's back (no notification at all): the
      final re-read classification after the token wait;
    * ``stalled``: re-activate and re-retire the rows behind a stalled listener (the final
      re-read shows them retired again): the notification sync, which must refuse;
    * ``lagged``: take the informer's watch down and keep it down while each pod blips through
      a non-reapable state (the fresh GET shows the final state under the same UID): the
      resourceVersion, ahead of the cache;
    * ``pending_blip``: each Succeeded/Failed create pod blips through Pending with no IP and the
      condition False, delivered at once (a pod-only check passes it; with a `suspended` row it
      is no reap): event-time clearing on any pod change;
    * ``retired_blip`` (the burst retired Pending never-started pods as `replaced`): each row
      moves to `suspended` and back, still retired throughout: event-time clearing on every
      notification;
    * ``recreated``: behind a watch kept down, each pod is deleted and created again under the
      same name in the same reapable shape (a new UID, never observed): the UID comparison.

    ``fraction`` in [0, 1) spreads the moment of the change over the first 0.3 s of the wait."""
    # The clocks the burst started expire a threshold from now: DELETEs before that are of pods
    # whose clocks ran already, and say nothing about where the pacer stands.
    await until_paced(world, time.time() + world.threshold_s - 0.1)
    # Workers now wait for the next paced token (up to 1/r ≈ 1.1 s away).
    await anyio.sleep(0.3 * fraction)
    left = [name for name in names if world.life(name) is not None]
    lives = [life for life in map(world.life, left) if life is not None]
    if variant in ("lagged", "recreated"):
        world.emu.fail_next(3, code=500, method="GET", query={"watch": "true"})
        world.emu.drop_watches(abrupt=True)
    if not token_wait_pod_changes(world, lives, variant):
        if variant == "stalled":
            world.proxy.stall()
        retired: dict[str, RowTruth] = {}
        for name in left:
            row = world.rows[name].current
            assert row is not None
            retired[name] = row
        middle = token_wait_blip_rows(retired, variant)
        await world.update_rows(middle, silent=variant == "silent")
        if variant != "silent":
            await anyio.sleep(BLIP_GAP_S)
            await world.update_rows(retired)
        else:
            for sb in world.sandboxes:
                sb.row_frozen = sb.row_frozen or sb.name() in retired
    # Nothing else happens meanwhile: this scenario is about the final checks alone.
    await anyio.sleep(2.5)
    world.end_stall()


async def apply_step(world: World, step: Step, rng: random.Random, stats: Counter[str]) -> None:
    index = step.index
    if step.kind in TARGETED:
        target = oldest_reapable(world, step.amount)
        index = index if target is None else target
    sb = world.sandboxes[index]
    name = sb.name()
    life = world.life(name)
    row_life = world.rows.get(name)
    row = row_life.current if row_life else None
    emu = world.emu
    kind = step.kind
    applied = True
    if sb.row_frozen and kind in ROW_STEPS:
        kind = "skip"
    match kind:
        case "skip":
            applied = False
            kind = step.kind
        case "shape" | "shape_reapable" | "ip" | "condition":
            if life is None:
                applied = False
            else:
                world.set_shape(life, shape_for(step, life))
        case "pod_blip":
            if life is None:
                applied = False
            else:
                current = life.states[-1].shape
                world.set_shape(life, blip_shape(step, life))
                world.set_shape(life, current)
        case "recreate" | "stale_recreate":
            if kind == "stale_recreate":
                # The informer loses its stream and its next GETs fail, so the cache keeps
                # the old UID for a while; meanwhile the name gets a new pod.
                emu.drop_watches(abrupt=True)
                emu.fail_next(3, code=500, method="GET", path_contains="/namespaces/sandboxes/pods")
            if life is not None:
                world.delete_pod(life)
            shape, pod_kind = recreated_pod(step, sb.kind)
            world.create_pod(sb, sb.generation, shape, pod_kind)
        case "delete_other":
            if life is None:
                applied = False
            else:
                world.delete_pod(life)
        case "create_missing":
            if life is not None:
                applied = False
            else:
                world.create_pod(sb, sb.generation, step.shape, sb.kind)
        case "retire":
            if row is None:
                applied = False
            else:
                await world.update_rows({name: retire(row, step.state)})
        case "reactivate":
            if row is None or row.active:
                applied = False
            else:
                await world.update_rows({name: reactivate(row)})
        case "row_blip":
            if row is None or row.active:
                applied = False
            else:
                await world.update_rows({name: row_blip_middle(step, row)})
                await anyio.sleep(BLIP_GAP_S)
                await world.update_rows({name: row})
        case "new_generation":
            if row is not None and row.active:
                await world.update_rows({name: retire(row, "replaced")})
            sb.generation += 1
            new_row = RowTruth(sb.sandbox_id, sb.generation, sb.kind, "active", True, sb.managed)
            await world.insert_row(sb.name(), new_row)
            world.create_pod(sb, sb.generation, PodShape.PENDING_STUCK, sb.kind)
        case "burst":
            wait = token_wait(step)
            if wait is not None:
                # This is about the wait for delete tokens alone: lift earlier faults (a
                # stalled listener or failing GETs would stop the deletes for other reasons).
                world.lift_faults()
            changes = burst_changes(world, None if wait is None else wait[0])
            await world.update_rows(changes)
            if wait is not None:
                await while_waiting_for_tokens(world, list(changes), *wait)
        case "watch_drop":
            emu.drop_watches(abrupt=step.flag)
        case "watch_410":
            emu.expire_next_watches(1)
            emu.drop_watches(abrupt=False)
        case "compact":
            emu.compact()
            emu.drop_watches(abrupt=step.flag)
        case "api_error":
            code = 429 if step.flag else 500
            method = ["GET", "DELETE", None][int(step.amount * 3)]
            emu.fail_next(
                1 + int(step.amount * 2),
                code=code,
                method=method,
                path_contains="/pods",
                retry_after_s=1 if code == 429 else None,
            )
        case "latency":
            emu.add_latency(
                0.05 + 0.35 * step.amount,
                method="GET",
                path_contains="/pods",
                count=1 + int(step.amount * 4),
            )
        case "kill_db":
            app = ["retired-pod-gc-listener", "retired-pod-gc", ""][int(step.amount * 3)]
            await world._execute(
                """SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                   WHERE datname = $1 AND pid <> pg_backend_pid()
                     AND ($2 = '' OR application_name = $2)""",
                world.db_name,
                app,
            )
        case "pg_restart":
            await world.shared.restart()
        case "stall_listener":
            world.proxy.stall()
            world.stall_until = time.time() + 0.3 + 0.9 * step.amount
        case "stall_reactivate":
            # A re-activation (and maybe a re-retirement) the stalled listener never delivers.
            if row is None or row.active:
                applied = False
            else:
                world.proxy.stall()
                world.stall_until = time.time() + 0.6 + 0.8 * step.amount
                await world.update_rows({name: reactivate(row)})
                if step.flag:
                    await anyio.sleep(0.1 + 0.3 * step.amount)
                    await world.update_rows({name: row})
        case "silent_reactivate":
            # A writer that bypasses the trigger re-activates the row: no notification ever
            # comes, so only the final re-read can see it (and the row stays active for good).
            if row is None or row.active:
                applied = False
            else:
                await world.update_rows({name: reactivate(row)}, silent=True)
                sb.row_frozen = True
        case _:
            raise AssertionError(kind)
    stats[kind if applied else f"{kind} (n/a)"] += 1
