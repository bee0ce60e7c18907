"""The work queue's client-go semantics, on virtual time (no real sleeps)."""

from __future__ import annotations

import itertools
import random

import anyio
import pytest
from prometheus_client import CollectorRegistry

from service.engine.workqueue import WorkQueue
from service.kit import clock
from service.kit.backoff import Attempts, Backoff
from service.metrics import QueueMetrics
from tests.virtualtime import advance, settle


def _queue(**kw: object) -> WorkQueue:
    return WorkQueue(**kw)  # type: ignore[arg-type]


async def _get_one(queue: WorkQueue) -> str | None:
    """One key, as a worker taking batches of one takes it (``None``: shut down)."""
    keys = await queue.get_batch(1)
    return None if keys is None else keys[0]


async def _get_now(queue: WorkQueue) -> str | None:
    """A get that must not block (fails the test instead of hanging)."""
    with anyio.fail_after(1):
        return await _get_one(queue)


@pytest.mark.anyio
async def test_a_key_added_twice_while_waiting_is_handed_out_once() -> None:
    queue = _queue()
    queue.add("ns/a")
    queue.add("ns/a")
    queue.add("ns/b")
    assert len(queue) == 2
    assert await _get_now(queue) == "ns/a"
    assert await _get_now(queue) == "ns/b"
    assert len(queue) == 0


@pytest.mark.anyio
async def test_a_key_in_flight_is_not_handed_to_a_second_worker_and_returns_after_done() -> None:
    queue = _queue()
    queue.add("ns/a")
    assert await _get_now(queue) == "ns/a"
    queue.add("ns/a")  # re-added while processing
    assert len(queue) == 0
    got: list[str | None] = []
    async with anyio.create_task_group() as tg:

        async def second_worker() -> None:
            got.append(await _get_one(queue))

        tg.start_soon(second_worker)
        await settle()
        assert got == []  # still in flight: nobody else gets it
        queue.done("ns/a")
        await settle()
    assert got == ["ns/a"]
    assert queue.processing == frozenset({"ns/a"})


@pytest.mark.anyio
async def test_done_without_a_re_add_does_not_requeue() -> None:
    queue = _queue()
    queue.add("ns/a")
    await _get_now(queue)
    queue.done("ns/a")
    assert len(queue) == 0
    assert queue.processing == frozenset()


@pytest.mark.anyio
async def test_add_after_keeps_the_earliest_due_time() -> None:
    queue = _queue()
    queue.add_after("ns/a", 10)
    queue.add_after("ns/a", 5)
    queue.add_after("ns/a", 7)
    assert queue.delayed == 1
    await advance(4.999)
    assert len(queue) == 0
    await advance(0.001)
    assert len(queue) == 1
    assert await _get_now(queue) == "ns/a"
    queue.done("ns/a")
    await advance(100)  # the superseded 7 s and 10 s entries must not fire again
    assert len(queue) == 0
    assert queue.delayed == 0


@pytest.mark.anyio
async def test_a_getter_blocked_on_an_empty_queue_is_woken_at_the_due_time() -> None:
    queue = _queue()
    got: list[tuple[str | None, float]] = []
    async with anyio.create_task_group() as tg:

        async def worker() -> None:
            key = await _get_one(queue)
            got.append((key, clock.now()))

        tg.start_soon(worker)
        queue.add_after("ns/a", 300)
        await settle()
        await advance(299)
        await settle()
        assert got == []
        await advance(1)
        await settle()
    assert got == [("ns/a", 1300.0)]


@pytest.mark.anyio
async def test_an_immediate_add_does_not_cancel_a_pending_delayed_add() -> None:
    queue = _queue()
    queue.add_after("ns/a", 10)
    queue.add("ns/a")
    assert await _get_now(queue) == "ns/a"
    queue.done("ns/a")
    await advance(10)
    assert await _get_now(queue) == "ns/a"


def test_backoff_doubles_per_failure_up_to_the_cap() -> None:
    backoff = Backoff(initial_s=0.005, max_s=60.0)
    delays = [backoff.delay_s(failures) for failures in range(20)]
    assert delays[:4] == [0.005, 0.01, 0.02, 0.04]
    assert delays[-1] == 60.0
    assert all(b >= a for a, b in itertools.pairwise(delays))
    for failures in (64, 65, 200, 10**9):  # huge failure counts neither overflow nor exceed the cap
        assert backoff.delay_s(failures) == 60.0


def test_backoff_jitter_shortens_a_delay_by_at_most_its_fraction() -> None:
    backoff = Backoff(initial_s=1.0, max_s=8.0, jitter=0.5, rng=random.Random(4))
    delays = [backoff.delay_s(failures) for failures in range(6)]
    for failures, delay in enumerate(delays):
        plain = min(2.0**failures, 8.0)
        assert plain * 0.5 <= delay <= plain
    assert len(set(delays)) == len(delays)  # jittered: no two equal


def test_attempts_count_failures_honour_a_floor_and_reset() -> None:
    attempts = Attempts(Backoff(initial_s=1.0, max_s=4.0))
    assert [attempts.next_delay() for _ in range(4)] == [1.0, 2.0, 4.0, 4.0]
    assert attempts.failures == 4
    assert attempts.next_delay(floor_s=30.0) == 30.0
    attempts.reset()
    assert attempts.failures == 0
    assert attempts.next_delay() == 1.0


def test_backoff_rejects_a_cap_below_its_first_delay() -> None:
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(initial_s=2.0, max_s=1.0)


@pytest.mark.anyio
async def test_add_rate_limited_requeues_after_the_keys_backoff() -> None:
    queue = _queue()
    queue.add_rate_limited("ns/a")
    queue.add_rate_limited("ns/b")
    queue.add_rate_limited("ns/b")  # second failure of b: 10 ms, but the 5 ms add is earlier
    assert len(queue) == 0
    await advance(0.005)
    assert {await _get_now(queue), await _get_now(queue)} == {"ns/a", "ns/b"}
    queue.done("ns/a", "ns/b")
    queue.forget("ns/a")
    queue.add_rate_limited("ns/a")  # forgotten: a first failure again, 5 ms
    queue.add_rate_limited("ns/b")  # the third failure of b: 20 ms
    await advance(0.006)
    assert await _get_now(queue) == "ns/a"
    assert len(queue) == 0
    await advance(0.010)
    assert len(queue) == 0
    await advance(0.006)
    assert await _get_now(queue) == "ns/b"


@pytest.mark.anyio
async def test_shut_down_stops_accepting_and_wakes_getters_with_none() -> None:
    queue = _queue()
    results: list[str | None] = []
    async with anyio.create_task_group() as tg:
        for _ in range(3):

            async def worker() -> None:
                results.append(await _get_one(queue))

            tg.start_soon(worker)
        await settle()
        queue.add_after("ns/x", 1)
        queue.shut_down()
    assert results == [None, None, None]
    queue.add("ns/a")
    queue.add_after("ns/b", 1)
    await advance(5)
    assert len(queue) == 0
    assert queue.delayed == 0
    assert await _get_now(queue) is None


@pytest.mark.anyio
async def test_shut_down_with_drain_waits_for_in_flight_keys() -> None:
    queue = _queue()
    queue.add("ns/a")
    assert await _get_now(queue) == "ns/a"
    drained: list[bool] = []
    async with anyio.create_task_group() as tg:

        async def drain() -> None:
            drained.append(await queue.shut_down_with_drain(timeout_s=10))

        tg.start_soon(drain)
        await settle()
        assert drained == []
        assert await _get_now(queue) is None  # no new work once shutting down
        queue.done("ns/a")
    assert drained == [True]


@pytest.mark.anyio
async def test_shut_down_with_drain_gives_up_after_its_timeout() -> None:
    queue = _queue()
    queue.add("ns/a")
    await _get_now(queue)
    drained: list[bool] = []
    async with anyio.create_task_group() as tg:

        async def drain() -> None:
            drained.append(await queue.shut_down_with_drain(timeout_s=10))

        tg.start_soon(drain)
        await settle()
        await advance(9.9)
        await settle()
        assert drained == []
        await advance(0.1)
    assert drained == [False]


@pytest.mark.anyio
@pytest.mark.parametrize("cancel_before_add", [True, False])
async def test_a_cancelled_getter_does_not_strand_a_key(cancel_before_add: bool) -> None:
    queue = _queue()
    got: list[str | None] = []
    scopes: list[anyio.CancelScope] = []
    async with anyio.create_task_group() as tg:

        async def doomed() -> None:
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                got.append(await _get_one(queue))

        async def survivor() -> None:
            got.append(await _get_one(queue))

        tg.start_soon(doomed)
        await settle()
        tg.start_soon(survivor)
        await settle()
        if cancel_before_add:
            scopes[0].cancel()
            await settle()
            queue.add("ns/a")
        else:
            queue.add("ns/a")  # wakes the first getter, cancelled before it runs
            scopes[0].cancel()
        await settle()
        # Exactly one getter holds the key; the queue does not keep it ready meanwhile.
        assert got == ["ns/a"]
        assert len(queue) == 0
        queue.shut_down()  # release whichever getter still waits
    assert got in (["ns/a"], ["ns/a", None])


@pytest.mark.anyio
async def test_queue_metrics_follow_depth_delay_adds_retries_and_wait() -> None:
    registry = CollectorRegistry()
    metrics = QueueMetrics(registry)
    queue = WorkQueue(metrics=metrics)

    def value(name: str) -> float:
        return registry.get_sample_value(name) or 0.0

    queue.add("ns/a")
    queue.add("ns/a")
    queue.add("ns/b")
    queue.add_after("ns/c", 2)
    queue.add_rate_limited("ns/d")
    assert value("retired_pod_gc_queue_depth") == 2
    assert value("retired_pod_gc_queue_delayed") == 2
    assert value("retired_pod_gc_queue_adds_total") == 3
    assert value("retired_pod_gc_queue_retries_total") == 1
    await advance(1.5)
    assert await _get_now(queue) == "ns/a"
    assert value("retired_pod_gc_queue_depth") == 2  # b and d (due after 5 ms)
    assert value("retired_pod_gc_queue_delayed") == 1
    assert value("retired_pod_gc_queue_wait_seconds_sum") == pytest.approx(1.5)


@pytest.mark.anyio
async def test_get_batch_takes_a_share_of_the_ready_keys_within_its_bounds() -> None:
    q = WorkQueue()
    for i in range(100):
        q.add(f"k{i}")
    # A quarter of 100 for one of four getters, but never more than the limit...
    assert await q.get_batch(10, shares=4) == [f"k{i}" for i in range(10)]
    # ...a quarter of the 90 left (rounded up)...
    assert await q.get_batch(50, shares=4) == [f"k{i}" for i in range(10, 33)]
    # ...and at least ``least`` keys, when that many are ready.
    assert len(await q.get_batch(50, shares=100, least=20) or []) == 20
    rest = await q.get_batch(1000, least=1000)
    assert rest == [f"k{i}" for i in range(53, 100)]
    assert len(q) == 0 and len(q.processing) == 100
    q.add("k5")  # re-added while in flight: handed out again only after done()
    assert len(q) == 0
    q.done("k5")
    assert await q.get_batch(10) == ["k5"]


@pytest.mark.anyio
async def test_adding_keys_together_is_adding_each_in_order() -> None:
    # The same keys, some waiting, some in flight, some repeated: one burst leaves the queue as
    # one add per key would.
    rng = random.Random(5)
    for _ in range(50):
        keys = [f"ns/{rng.randrange(8)}" for _ in range(rng.randrange(1, 20))]
        states = []
        for burst in (True, False):
            queue = _queue(metrics=QueueMetrics(CollectorRegistry()))
            queue.add("ns/1")
            queue.add("ns/2")
            held = await _get_now(queue)  # ns/1 in flight
            if burst:
                queue.add(*keys)
            else:
                for key in keys:
                    queue.add(key)
            assert held is not None
            queue.done(held)
            order = []
            while len(queue):
                order.append(await _get_now(queue))
            states.append(order)
        assert states[0] == states[1]


@pytest.mark.anyio
async def test_adding_keys_together_wakes_one_getter_per_key_that_became_ready() -> None:
    queue = _queue()
    got: list[str | None] = []
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(lambda: _append(queue, got))
        await settle()
        queue.add("ns/a", "ns/a", "ns/b")  # two keys ready: two getters
        await settle()
        assert sorted(k or "" for k in got) == ["ns/a", "ns/b"]
        queue.shut_down()
    assert got[-1] is None


async def _append(queue: WorkQueue, got: list[str | None]) -> None:
    got.append(await _get_one(queue))


@pytest.mark.anyio
async def test_a_burst_large_enough_to_be_compacted_keeps_the_keys_readded_in_flight() -> None:
    # 50,000 keys grow the dirty set past the size that is rebuilt when the burst's last ready
    # key is taken; keys re-added while in flight must survive the rebuild (and come back).
    queue = _queue()
    keys = [f"ns/p{i}" for i in range(50_000)]
    for key in keys:
        queue.add(key)
    with anyio.fail_after(5):
        first = await queue.get_batch(49_990)
    assert first == keys[:49_990]
    queue.add("ns/p0")  # re-added while in flight, before the burst is drained
    with anyio.fail_after(5):
        rest = await queue.get_batch(100)  # takes the last ready keys: the tables are rebuilt
    assert rest == keys[49_990:]
    assert len(queue) == 0
    queue.done(*first, *rest)
    assert len(queue) == 1
    assert await _get_now(queue) == "ns/p0"
    queue.add("ns/p1")  # adds after the rebuild are kept as before
    assert await _get_now(queue) == "ns/p1"
