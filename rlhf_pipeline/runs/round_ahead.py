"""Whether a collector's next round may go to the engine while this round's tail decodes
(``collect/collector.py``, ``next_round``): asked once this round's first group ended.

Yes only when the next round would start the same way without overlap, whatever this round's
remaining groups do: pacing (``coordination/pacing.py``) allows it from the learner's intake alone,
both if every row still to come is written and if dynamic sampling drops them all (the shard's rows
at the next round's start lie between the two, and which intake first allowed a round only moves
one way with them), and the weights it takes are the ones the collector holds:

* a paced round pinned to a version takes it when it is loaded already (pinned to an older one, the
  collector keeps its own, as without overlap);
* a round that takes the newest weights (unpaced, or no intake names one) goes ahead only when no
  newer version is published.

So a new version due means no overlap: the round after waits and loads it between rounds, as
today. The stall rule is not used (it counts from this collector's last round, which has not ended),
and what pacing counts (rows ahead of the learner, its wait) is what the rounds write, as without
overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlhf_pipeline.coordination.pacing import CollectorPacer
from rlhf_pipeline.coordination.weights import latest_version


def next_round_goes_ahead(pacer: CollectorPacer, poller: Any, *, shard_rows: int, rows_to_come: int,
                          policy_version: int, pinned: bool) -> bool:
    """True when the round after the current one may be submitted now (see the module docstring).

    ``shard_rows``: the shard's rows now; ``rows_to_come``: the current round's rows not appended yet."""
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
