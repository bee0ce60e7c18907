"""The keep annotation through the one pipeline, on fakes and virtual time: a kept pod is skipped
with its own reason and has no clock, in live and dry run; annotating a pod after its
observation (even after the fresh GET's verification began) never deletes it; removing the
annotation starts a full threshold from that moment."""

from __future__ import annotations

import pytest
from msgspec import structs

from service.domain import Outcome, PodSnapshot, SkipReason, Verdict
from service.kit import clock
from tests.fakes import EngineRig, clock_of, make_pod, make_rig, make_row, make_settings

pytestmark = pytest.mark.anyio
THRESHOLD_S = 300.0


def _skips(rig: EngineRig) -> float:
    return rig.sample("retired_pod_gc_skips_total", {"reason": str(SkipReason.KEEP_ANNOTATION)})


def _kept(pod: PodSnapshot, rv: str) -> PodSnapshot:
    return structs.replace(pod, keep=True, resource_version=rv)


@pytest.mark.parametrize("dry_run", [False, True])
async def test_a_kept_pod_is_skipped_with_its_reason_and_never_acted_on(dry_run: bool) -> None:
    rig = make_rig(make_settings(threshold_s=THRESHOLD_S, dry_run=dry_run))
    pod = make_pod(resource_version="5")
    rig.add(pod, make_row(pod))
    assert (await rig.reconcile(pod.key)).outcome == Outcome.TOO_YOUNG
    assert len(rig.clocks) == 1
    kept = _kept(pod, "6")
    rig.add(kept)  # the watch event of the annotation
    assert len(rig.clocks) == 0
    for _ in range(3):
        await rig.advance(THRESHOLD_S * 2)
        result = await rig.reconcile(pod.key)
        assert (result.outcome, result.skip_reason) == (
            Outcome.SKIPPED,
            SkipReason.KEEP_ANNOTATION,
        )
        assert len(rig.clocks) == 0
    assert rig.pods.deletes == []
    assert rig.clocks.reported_count == 0
    assert rig.outcome(str(Verdict.TERMINAL_RETIRED)) == 0
    assert _skips(rig) == 3
    # no row is looked up for a kept pod: the prefilter decides
    assert rig.store.lookups == 1


async def test_a_pod_annotated_after_its_observation_is_not_deleted_by_the_final_reread() -> None:
    rig = make_rig(make_settings(threshold_s=THRESHOLD_S))
    pod = make_pod(resource_version="5")
    rig.add(pod, make_row(pod), event=False)
    assert (await rig.reconcile(pod.key)).outcome == Outcome.TOO_YOUNG
    await rig.advance(THRESHOLD_S)
    # Annotated on the server; the watch has not delivered it yet (the cache is stale).
    rig.pods.pods[pod.key] = _kept(pod, "6")
    result = await rig.reconcile(pod.key)
    assert result.outcome == Outcome.CHANGED
    assert rig.pods.deletes == []
    assert len(rig.clocks) == 0
    # Even with the same resourceVersion (a cache and a server that agree on everything but the
    # annotation), the fresh GET's classification stops it.
    rig.add(pod, event=False)
    assert (await rig.reconcile(pod.key)).outcome == Outcome.TOO_YOUNG
    await rig.advance(THRESHOLD_S)
    rig.pods.pods[pod.key] = structs.replace(pod, keep=True)
    assert (await rig.reconcile(pod.key)).outcome == Outcome.CHANGED
    assert rig.pods.deletes == []


async def test_removing_the_annotation_starts_a_full_threshold_from_that_moment() -> None:
    rig = make_rig(make_settings(threshold_s=THRESHOLD_S))
    pod = make_pod(resource_version="5")
    kept = _kept(pod, "5")
    rig.add(kept, make_row(pod))
    assert (await rig.reconcile(pod.key)).skip_reason is SkipReason.KEEP_ANNOTATION
    await rig.advance(THRESHOLD_S * 10)
    removed_at = clock.now()
    released = structs.replace(pod, resource_version="7")
    rig.add(released)  # the watch event of the removal enqueues the key
    assert len(rig.queue) == 1
    first = await rig.reconcile(pod.key)
    assert (first.outcome, first.requeue_after_s) == (Outcome.TOO_YOUNG, THRESHOLD_S)
    observation = clock_of(rig.clocks, pod.uid)
    assert observation is not None and observation.since_s == removed_at
    await rig.advance(THRESHOLD_S - 1)
    assert (await rig.reconcile(pod.key)).outcome == Outcome.TOO_YOUNG
    assert rig.pods.deletes == []
    await rig.advance(1)
    assert (await rig.reconcile(pod.key)).outcome == Verdict.TERMINAL_RETIRED
    [delete] = rig.pods.deletes
    assert delete.at_s - removed_at >= THRESHOLD_S
    assert (delete.uid, delete.resource_version) == (pod.uid, "7")
