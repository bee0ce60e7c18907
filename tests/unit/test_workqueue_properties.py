"""Property tests of the work queue against a model: never drops a key, never hands one key to
two workers, delayed adds fire at the earliest requested time."""

from __future__ import annotations

import random

import anyio
from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine.workqueue import WorkQueue
from service.kit import clock
from tests.virtualtime import VIRTUAL_TIME, advance, settle

KEYS = ("ns/a", "ns/b", "ns/c")
op = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(KEYS)),
    st.tuples(st.just("add_after"), st.sampled_from(KEYS), st.sampled_from([0.0, 0.5, 1.0, 2.5])),
    st.tuples(st.just("rate"), st.sampled_from(KEYS)),
    st.tuples(st.just("advance"), st.sampled_from([0.001, 0.25, 1.0, 3.0])),
    st.tuples(st.just("get")),
    st.tuples(st.just("done"), st.integers(0, 2)),
    st.tuples(st.just("forget"), st.sampled_from(KEYS)),
)


class Model:
    def __init__(self) -> None:
        self.owed: set[str] = set()
        """Keys that must be handed out (again) after their last add."""
        self.pending_due: dict[str, float] = {}
        self.inflight: list[str] = []
        self.failures: dict[str, int] = {}
        """Failures in a row of each key (``rate``), until ``forget``."""

    def fire(self, now: float) -> None:
        for key, due in list(self.pending_due.items()):
            if due <= now:
                self.owed.add(key)
                del self.pending_due[key]

    def ready(self) -> set[str]:
        return {k for k in self.owed if k not in self.inflight}


async def _run(ops: list[tuple[object, ...]]) -> None:
    queue = WorkQueue()
    model = Model()

    def check() -> None:
        assert queue.processing == frozenset(model.inflight)
        assert queue.delayed == len(model.pending_due)
        assert len(queue) == len(model.ready())

    async def take() -> str:
        with anyio.fail_after(1):
            keys = await queue.get_batch(1)
        assert keys is not None
        (key,) = keys
        assert key in model.owed, f"{key} handed out without a pending add"
        assert key not in model.inflight, f"{key} handed to a second worker"
        model.owed.discard(key)
        model.inflight.append(key)
        return key

    for step in ops:
        name = step[0]
        if name == "add":
            key = str(step[1])
            queue.add(key)
            model.owed.add(key)
        elif name in ("add_after", "rate"):
            key = str(step[1])
            if name == "rate":
                n = model.failures.get(key, 0)
                model.failures[key] = n + 1
                delay = min(0.005 * 2.0**n, 60.0)
                queue.add_rate_limited(key)
            else:
                delay = float(step[2])  # type: ignore[arg-type]
                queue.add_after(key, delay)
            if delay <= 0:
                model.owed.add(key)
            else:
                due = clock.now() + delay
                model.pending_due[key] = min(model.pending_due.get(key, due), due)
        elif name == "advance":
            await advance(float(step[1]))  # type: ignore[arg-type]
            model.fire(clock.now())
        elif name == "get":
            if model.ready():
                await take()
        elif name == "done":
            if model.inflight:
                key = model.inflight.pop(int(step[1]) % len(model.inflight))  # type: ignore[call-overload]
                queue.done(key)
        elif name == "forget":
            queue.forget(str(step[1]))
            model.failures.pop(str(step[1]), None)
        check()

    # Drain: every key owed (now or by a pending delayed add) comes out; nothing else does.
    await advance(10_000)
    model.fire(clock.now())
    while model.inflight:
        queue.done(model.inflight.pop())
    check()
    while model.ready():
        queue.done(await take())
        model.inflight.clear()
    assert not model.owed
    assert len(queue) == 0 and queue.delayed == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=60))
def test_queue_matches_the_model_never_drops_never_doubles(ops: list[tuple[object, ...]]) -> None:
    anyio.run(_run, ops, backend_options=VIRTUAL_TIME[1])


async def _concurrent(seed: int) -> None:
    rng = random.Random(seed)
    queue = WorkQueue()
    busy: set[str] = set()
    processed: dict[str, int] = {}
    requested: dict[str, int] = {}
    violations: list[str] = []

    async def worker() -> None:
        while (keys := await queue.get_batch(1)) is not None:
            (key,) = keys
            if key in busy:
                violations.append(key)
            busy.add(key)
            processed[key] = processed.get(key, 0) + 1
            for _ in range(rng.randint(0, 3)):
                await anyio.lowlevel.checkpoint()
            busy.discard(key)
            queue.done(key)

    keys = [f"ns/k{i}" for i in range(8)]
    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(worker)
        for _ in range(400):
            key = rng.choice(keys)
            requested[key] = requested.get(key, 0) + 1
            if rng.random() < 0.3:
                queue.add_after(key, rng.choice([0.1, 0.5, 1.0]))
            else:
                queue.add(key)
            if rng.random() < 0.2:
                await advance(0.25)
            await anyio.lowlevel.checkpoint()
        await advance(5)
        await settle()
        assert len(queue) == 0 and queue.delayed == 0 and not queue.processing
        queue.shut_down()
    assert violations == []
    assert set(processed) == set(requested)  # every requested key was processed
    assert all(processed[k] <= requested[k] for k in processed)  # deduplicated, never more


def test_concurrent_workers_never_process_one_key_at_once_and_process_every_key() -> None:
    for seed in range(15):
        anyio.run(_concurrent, seed, backend_options=VIRTUAL_TIME[1])
