"""The controller work queue: deduplicating, delayed, rate-limited, with client-go's semantics.

A key is in at most one of the places that matter for correctness: ``dirty`` (it needs
processing; not added twice), ``processing`` (a worker holds it; added meanwhile, it stays dirty
and is ready again at :meth:`done`), the delay heap (:meth:`add_after` keeps each key's earliest
due time in ``waiting``; stale heap entries are skipped lazily; a due key is :meth:`add`-ed). As in
client-go, an immediate add does not cancel a pending delayed one: the key is then processed
twice, harmless for an idempotent reconcile. Delays run on the event loop's clock
(``service/kit/clock.py``): one loop timer is armed for the earliest due time.

Failures back off per key (``add_rate_limited``); :meth:`forget` resets the count. Workers take
keys in batches (:meth:`get_batch`). Sets and dicts never shrink: when the last ready key is
taken, tables grown past ``_COMPACT_BYTES`` are rebuilt and the memory handed back to the OS.

Unlike client-go, after :meth:`shut_down` :meth:`get_batch` returns ``None`` at once (queued keys
are dropped: a restart relists), adds are ignored, and in-flight keys may still be marked
:meth:`done`; :meth:`shut_down_with_drain` waits, at most ``timeout_s``, for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import sys
from collections import deque

import anyio

from service.kit import clock
from service.kit.backoff import Backoff
from service.kit.memory import trim_heap
from service.metrics import QueueMetrics

_COMPACT_BYTES = 1 << 20
"""A dirty set this large (about 30,000 keys' table) is rebuilt once its last key is taken."""


class WorkQueue:
    """See the module docstring; synchronous but for :meth:`get_batch` and the drain."""

    def __init__(
        self, *, metrics: QueueMetrics | None = None, backoff: Backoff | None = None
    ) -> None:
        self._metrics = metrics
        self._backoff = backoff if backoff is not None else Backoff(initial_s=0.005, max_s=60.0)
        self._failures: dict[str, int] = {}
        self._ready: deque[str] = deque()
        self._dirty: set[str] = set()
        self._processing: set[str] = set()
        self._dirty_since: dict[str, float] = {}
        self._waiting: dict[str, float] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due: float | None = None
        self._getters: deque[anyio.Event] = deque()
        self._shutting_down = False
        self._drained: anyio.Event | None = None
        if metrics is not None:
            metrics.queue_depth.set_function(lambda: len(self._ready))
            metrics.queue_delayed.set_function(lambda: len(self._waiting))

    def add(self, *keys: str) -> None:
        """Mark each of ``keys`` for processing, in order (a key already waiting is not added
        again; nothing is added after shutdown)."""
        if self._shutting_down:
            return
        now = clock.now()
        became_ready = 0
        for key in keys:
            if key in self._dirty:
                continue
            self._dirty.add(key)
            self._dirty_since[key] = now
            if key in self._processing:
                continue  # re-queued by done()
            self._ready.append(key)
            became_ready += 1
        if self._metrics is not None:
            self._metrics.queue_adds.inc(len(keys))
        self._wake(became_ready)

    def add_after(self, key: str, delay_s: float) -> None:
        """Add ``key`` once ``delay_s`` has passed; an earlier pending time for it wins."""
        if self._shutting_down:
            return
        if delay_s <= 0:
            self.add(key)
            return
        due = clock.now() + delay_s
        current = self._waiting.get(key)
        if current is not None and current <= due:
            return
        self._waiting[key] = due
        heapq.heappush(self._heap, (due, next(self._seq), key))
        self._arm()

    def add_rate_limited(self, key: str) -> None:
        """Requeue ``key`` after its per-key exponential backoff."""
        if self._shutting_down:
            return
        if self._metrics is not None:
            self._metrics.queue_retries.inc()
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        self.add_after(key, self._backoff.delay_s(failures))

    def forget(self, key: str) -> None:
        """``key`` succeeded: reset its backoff (does not remove it from the queue)."""
        self._failures.pop(key, None)

    async def get_batch(self, limit: int, *, shares: int = 1, least: int = 1) -> list[str] | None:
        """Up to ``limit`` ready keys (at least one; waits for it), each marked as processing;
        ``None`` once shut down. A ``1/shares`` part of the ready keys (rounded up), but no fewer
        than ``least``, is taken: spread over ``shares`` concurrent getters, in parts."""
        while True:
            if self._shutting_down:
                return None
            self._promote_due()
            if self._ready:
                ready = self._ready
                take = max(1, min(limit, max(least, -(-len(ready) // max(1, shares)))))
                keys = [ready.popleft() for _ in range(min(take, len(ready)))]
                now = clock.now()
                self._dirty.difference_update(keys)
                self._processing.update(keys)
                for key in keys:
                    since = self._dirty_since.pop(key, None)
                    if since is not None and self._metrics is not None:
                        self._metrics.queue_wait.observe(max(0.0, now - since))
                if ready:
                    self._wake_one()
                elif sys.getsizeof(self._dirty) > _COMPACT_BYTES:
                    self._compact()
                return keys
            event = anyio.Event()
            self._getters.append(event)
            try:
                await event.wait()
            except BaseException:
                # A wake-up meant for a getter that is going away (cancelled) passes on, so a
                # ready key never sits unclaimed while another getter sleeps.
                if event.is_set():
                    self._wake_one()
                else:
                    with contextlib.suppress(ValueError):
                        self._getters.remove(event)
                raise

    def _compact(self) -> None:
        """Rebuild the grown tables at the size of what is left, and give the memory back."""
        self._dirty = set(self._dirty)
        self._dirty_since = dict(self._dirty_since)
        trim_heap()

    def done(self, *keys: str) -> None:
        """The worker finished ``keys``; a re-add that arrived meanwhile is queued now."""
        requeued = 0
        for key in keys:
            if key not in self._processing:
                continue  # not handed out: nothing to finish
            self._processing.remove(key)
            if key in self._dirty and not self._shutting_down:
                self._ready.append(key)
                requeued += 1
        self._wake(requeued)
        if not self._processing and self._drained is not None:
            self._drained.set()

    def shut_down(self) -> None:
        """Stop accepting keys and handing them out; getters return ``None``."""
        if self._shutting_down:
            return
        self._shutting_down = True
        self._ready.clear()
        self._dirty.clear()
        self._dirty_since.clear()
        self._waiting.clear()
        self._heap.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_due = None
        while self._getters:
            self._getters.popleft().set()

    async def shut_down_with_drain(self, timeout_s: float) -> bool:
        """Shut down, then wait up to ``timeout_s`` for in-flight keys; True when drained."""
        self.shut_down()
        if not self._processing:
            return True
        if self._drained is None:
            self._drained = anyio.Event()
        return await clock.wait_until(self._drained, clock.now() + timeout_s)

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    def __len__(self) -> int:
        """Keys ready to be handed out (not counting delayed or in-flight ones)."""
        return len(self._ready)

    @property
    def delayed(self) -> int:
        return len(self._waiting)

    @property
    def processing(self) -> frozenset[str]:
        return frozenset(self._processing)

    def _promote_due(self) -> None:
        now = clock.now()
        heap = self._heap
        while heap and heap[0][0] <= now:
            due, _, key = heapq.heappop(heap)
            if self._waiting.get(key) != due:
                continue  # superseded by an earlier add_after (lazy deletion)
            del self._waiting[key]
            self.add(key)

    def _arm(self) -> None:
        heap = self._heap
        while heap and self._waiting.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)
        due = heap[0][0] if heap else None
        if due == self._timer_due:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_due = due
        if due is not None:
            self._timer = asyncio.get_running_loop().call_at(due, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_due = None
        if self._shutting_down:
            return
        self._promote_due()
        # A real loop may fire a hair early; _arm then simply re-arms for the same key.
        self._arm()

    def _wake(self, count: int) -> None:
        for _ in range(min(count, len(self._getters))):
            self._wake_one()

    def _wake_one(self) -> None:
        while self._getters:
            event = self._getters.popleft()
            if not event.is_set():
                event.set()
                return
