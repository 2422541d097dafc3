"""Whether a collector's next round may go to the engine while this round's tail decodes: only when
pacing would start it the same way, with the same weights, however the current round ends.
``docs/architecture.md#pacing``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlhf_pipeline.coordination.pacing import CollectorPacer
from rlhf_pipeline.coordination.weights import latest_version


def next_round_goes_ahead(pacer: CollectorPacer, poller: Any, *, shard_rows: int, rows_to_come: int,
                          policy_version: int, pinned: bool) -> bool:
    """True when the round after the current one may be submitted now. Pacing must allow it both if
    every row still to come (``rows_to_come``, beside the shard's ``shard_rows`` now) is written and
    if dynamic sampling drops them all (the next round's start lies between the two), not by the
    stall rule, which counts from a round not ended; and its weights must be the ones held: a round
    pinned to a version takes it only when loaded, one that takes the newest only when none is newer."""
    plans = [pacer.plan_round(rows) for rows in (shard_rows, shard_rows + rows_to_come)]
    if not all(plan.allowed and plan.min_version <= policy_version for plan in plans):
        return False
    if pacer.max_lag is not None and not pacer.within_target(shard_rows + rows_to_come):
        return False  # allowed by the stall rule only
    if len({plan.version for plan in plans}) != 1:
        return False
    version = plans[0].version
    if version is not None and pinned:
        return version <= policy_version
    newest = latest_version(poller.store)
    return newest is None or newest <= policy_version


def ahead_rule(pacer: CollectorPacer, poller: Any, rows: Any, *, policy_version: int,
               pinned: bool) -> Callable[[int], bool]:
    """``collect(next_round=...)`` for a round started with ``policy_version``; ``rows``: the shard's
    row count (``next_row``), read when asked."""
    return lambda rows_to_come: next_round_goes_ahead(
        pacer, poller, shard_rows=rows.next_row, rows_to_come=rows_to_come, policy_version=policy_version,
        pinned=pinned)
