"""Watch-stream framing under garbage: the informer survives and its cache stays the server's.

Random lines — raw bytes, truncated and spliced events, valid JSON of the wrong shape, events
whose object is a malformed pod, unknown event types, ERROR events, BOOKMARKs with garbage
versions — are pushed into live watch streams with the emulator's ``inject_watch_line``, mixed
with real changes. Afterwards the informer must still run and converge on exactly the server's
pods, and no malformed line may ever put a reapable-looking pod in the cache that the server
does not have. Lines come from a seeded ``random.Random`` (hypothesis drives the other fuzz
tests; an async server round trip per example would be too slow for it).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import anyio
import pytest
from prometheus_client import CollectorRegistry

from devtools.emulator import RunningEmulator
from service.config import KubeSettings
from service.kit.backoff import Backoff
from service.kube.informer import PodInformer
from service.kube.listwatch import ListWatch
from service.metrics import KubeMetrics
from tests.kubefixtures import (
    SANDBOX_NAMESPACE,
    RecordingHandler,
    cache_state,
    sandbox_pod,
    server_pods,
)

NS = SANDBOX_NAMESPACE


def _valid_event(rng: random.Random) -> dict[str, object]:
    pod = sandbox_pod(f"f{rng.randrange(1000)}", phase=rng.choice(["Succeeded", "Pending"]))
    pod["metadata"].update(
        {"namespace": NS, "uid": f"ghost-{rng.randrange(10**6)}", "resourceVersion": "1"}
    )
    return {"type": rng.choice(["ADDED", "MODIFIED", "DELETED"]), "object": pod}


def _malformed_object_event(rng: random.Random) -> bytes:
    event = _valid_event(rng)
    obj = event["object"]
    assert isinstance(obj, dict)
    meta = obj["metadata"]
    match rng.randrange(5):
        case 0:
            meta.pop("uid")
        case 1:
            meta["resourceVersion"] = ""
        case 2:
            obj["metadata"] = rng.choice([None, 3, "x", []])
        case 3:
            obj["status"] = rng.choice([[], "Succeeded", 7])
        case _:
            meta["labels"] = rng.choice([["a"], "x", {"space.generation": 3}])
    return json.dumps(event).encode()


GARBAGE: list[Callable[[random.Random], bytes]] = [
    lambda rng: bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80))).replace(b"\n", b""),
    lambda rng: json.dumps(_valid_event(rng)).encode()[: rng.randrange(1, 60)],
    lambda rng: json.dumps(rng.choice([[], {}, None, 1, "ADDED", {"type": 5}])).encode(),
    lambda rng: json.dumps({"type": rng.choice(["FOO", "", "added"]), "object": {}}).encode(),
    lambda rng: json.dumps({"type": "ADDED", "object": rng.choice([None, 1, "x", []])}).encode(),
    _malformed_object_event,
    lambda rng: json.dumps(
        {
            "type": "BOOKMARK",
            "object": {
                "metadata": rng.choice([{}, {"resourceVersion": 5}, {"resourceVersion": "x1"}])
            },
        }
    ).encode(),
    lambda rng: json.dumps(
        {"type": "ERROR", "object": {"kind": "Status", "code": rng.choice([500, 503, "x"])}}
    ).encode(),
    lambda rng: b"\xef\xbb\xbf" + json.dumps(_valid_event(rng)).encode(),
    lambda rng: b"   ",
]


async def _converged(informer: PodInformer, emulator: RunningEmulator) -> bool:
    return informer.synced and cache_state(informer) == server_pods(emulator.emulator)


@pytest.mark.anyio
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_garbage_lines_never_kill_the_informer_nor_poison_its_cache(
    seed: int, emulator: RunningEmulator, kube_api: object, kube_settings: KubeSettings
) -> None:
    rng = random.Random(seed)
    emu = emulator.emulator
    for i in range(5):
        emu.create_pod(sandbox_pod(f"s{i}"), namespace=NS)
    handler = RecordingHandler()
    metrics = KubeMetrics(CollectorRegistry())
    informer = PodInformer(
        ListWatch(
            kube_api,  # type: ignore[arg-type]
            settings=kube_settings,
            metrics=metrics,
            namespace=NS,
            rng=random.Random(seed),
        ),
        settings=kube_settings,
        metrics=metrics,
        backoff=Backoff(initial_s=0.01, max_s=0.05, jitter=0.5, rng=random.Random(seed)),
        min_watch_s=0.0,
    )
    informer.add_handler(handler)
    async with anyio.create_task_group() as tg:
        await tg.start(informer.run)
        with anyio.fail_after(10):
            await informer.wait_synced()
        for n in range(60):
            kind = rng.randrange(4)
            if kind == 0:
                name = f"space-sbx-s{rng.randrange(5)}-g1"
                if emu.get_pod(NS, name) is not None:
                    emu.set_status(NS, name, {"phase": rng.choice(["Running", "Succeeded"])})
            elif kind == 1:
                emu.create_pod(sandbox_pod(f"n{seed}x{n}"), namespace=NS)
            else:
                emu.inject_watch_line(rng.choice(GARBAGE)(rng))
                if rng.random() < 0.1:
                    # The garbage is the last thing before the stream ends: the resume point
                    # must not have been poisoned by it.
                    emu.drop_watches(abrupt=rng.random() < 0.5)
            await anyio.sleep(0.005)
            # Never a pod the server does not have (no ghost from a forged line).
            assert set(cache_state(informer)) <= set(server_pods(emu))
        with anyio.fail_after(10):
            while not await _converged(informer, emulator):
                await anyio.sleep(0.02)
        # Still alive: a change after the garbage still arrives.
        emu.create_pod(sandbox_pod(f"after{seed}"), namespace=NS)
        with anyio.fail_after(10):
            while not await _converged(informer, emulator):
                await anyio.sleep(0.02)
        tg.cancel_scope.cancel()
