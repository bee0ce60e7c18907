"""The short fault campaign that ``make test`` runs (``make chaos SEEDS=N`` runs more).

Seeds 1..24 (the seeds ``python -m tests.chaos.removals`` runs by default) run 8 at a time, each
against its own emulator, database and service instance.
``CHAOS_SEED=1234`` runs just that seed; ``CHAOS_SEEDS=N`` the first N. A failure lists every
failing seed with its violations and the command that replays it.
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.campaign import run_campaign
from tests.chaos.schedule import CampaignConfig

SHORT_CAMPAIGN_SEEDS = 24
SHORT_CAMPAIGN_CONCURRENCY = 8
"""Seeds run at once. Every seed's service, emulator and driver share this one process and
event loop: 24 at once, under coverage on a machine with a core taken, starved each other until
the liveness bound measured the harness's CPU, not the service (every live seed late, few
deletes). Three waves of 8 leave each service the CPU it would have alone."""


def _seeds() -> list[int]:
    if os.environ.get("CHAOS_SEED"):
        return [int(s) for s in os.environ["CHAOS_SEED"].replace(",", " ").split()]
    return list(range(1, int(os.environ.get("CHAOS_SEEDS", SHORT_CAMPAIGN_SEEDS)) + 1))


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.anyio
async def test_short_fault_campaign_holds_every_invariant() -> None:
    results = await run_campaign(
        _seeds(), cfg=CampaignConfig(), concurrency=SHORT_CAMPAIGN_CONCURRENCY
    )
    failed = [r for r in results if not r.ok]
    # The campaign must actually exercise the service: deletes in live seeds, reports in dry run.
    assert sum(r.deletes for r in results) > 0 or len(results) < 4
    assert not failed, "\n" + "\n".join(r.summary() for r in failed)
