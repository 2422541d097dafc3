"""The next round submitted while this round's tail decodes.

A round's groups are written as they end; if the next round's requests went to the engine only once
the round's last group ended and its last append returned, the engine's batch would empty during the
round's tail (its slowest completions) and idle during the appends. So the collector asks, as soon
as the round's first group ended (a slot of the engine's batch came free), whether the next round
may start now with the weights this round uses
(``next_round``: the runner's pacing says, ``runs/round_ahead.py``); if so it draws the next round's
prompts and seeds at once and submits them (``streaming.Submitted``), and the next
``collect()`` reads that round instead of starting one.

What does not change:

* **The rows.** The next round's prompts are drawn in order and its seeds from the collector's
  generator, in the same order as when it is not submitted ahead (they are drawn after every seed of this round,
  as they would be at the next round's start), so ids, prompts, seeds and versions are the same;
  for vLLM the tokens are those of the same seeds (vLLM keeps a request's sampling stream apart,
  batch composition moves log-probs by ~1e-7).
* **The commits.** Each round's groups are written in request order, and the next round's only once
  this round's last append returned (its groups that end earlier wait in memory).
* **The saved state.** Every round keeps the state before its draws (:attr:`Round.start_state`);
  the state published with this round's last groups is the next round's, taken when it was
  submitted: a collector killed with both rounds in flight resumes from it and samples the next
  round again from the same prompts and seeds; the engine's work on it is lost, never a row written
  twice or skipped.
* **The weights.** Only rounds that take the version this round holds go ahead; when a new version
  is due the next round waits and loads it between rounds.

Every engine takes it: a vLLM server batches the next round's requests with this round's tail; our
loop queues them and decodes them as one batch once this round's batch ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf_pipeline.collect.streaming import Submitted

if TYPE_CHECKING:
    from rlhf_pipeline.collect.streaming import InOrderCommit
    from rlhf_pipeline.collect.collector import Collector
    from rlhf_pipeline.collect.prompts import PromptRecord
    from rlhf_pipeline.generation.engine import CompletionGroup, SampleRequest


@dataclass
class Round:
    """A round's prompts and requests, drawn: now, or ahead while the round before it decoded."""

    records: list[PromptRecord]
    requests: list[SampleRequest]
    seeds: list[int]
    """One per request, drawn from the collector's generator with the round's prompts."""
    start_state: dict[str, Any]
    """The collector's state at this round's start: after the round before it, before this round's
    prompts and seeds were drawn (what a restart samples it again from)."""
    submitted: Submitted | None
    """Its requests, when they were submitted ahead; None: submitted when read."""
    idle_before_s: float
    """Seconds the engine had nothing of this collector's to decode before these requests went: 0 when
    they went before the round before them ended."""


def submit_ahead(collector: Collector, records_now: int, rows_now: int, idle_before_s: float) -> Round:
    """Draws the next round's prompts and seeds and submits it; ``records_now`` / ``rows_now``: the
    prompts and rows of the round still being read (counted into the state taken first)."""
    cfg = collector.config
    state = collector.state_dict(rounds_ahead=(1, records_now, rows_now))
    records = collector.prompts.next_batch(cfg.prompts_per_batch)
    requests, seeds = collector.requests_for(records)
    submitted = Submitted(collector.engine, requests, seeds, cfg.sampling)
    return Round(records, requests, seeds, state, submitted, idle_before_s)


def read_round(collector: Collector, batches: Iterable[list[CompletionGroup]], commit: InOrderCommit,
               next_round: Callable[[int], bool] | None, records_now: int) -> float:
    """Reads the round's stream into ``commit`` (its groups written in request order); once its first
    groups ended, asks ``next_round(rows not appended yet)`` and submits the next round if it allows.
    Returns when the round's last group came (perf_counter seconds)."""
    rows_now = records_now * collector.config.num_generations
    ended_at = None
    for finished_together in batches:
        if len(commit.timing.ended_s) + len(finished_together) == commit.count:
            ended_at = time.perf_counter()
        if next_round is not None:  # asked once, when the first slots of the engine's batch came free,
            # before these groups are written: the engine decodes the next round during the appends
            if next_round((commit.count - commit.written) * collector.config.num_generations):
                idle_s = 0.0 if ended_at is None else time.perf_counter() - ended_at
                collector._ahead = submit_ahead(collector, records_now, rows_now, idle_s)
            next_round = None
        commit.add(finished_together)
    commit.finish()
    return ended_at if ended_at is not None else time.perf_counter()


class IdleClock:
    """When the engine last had nothing of this collector's to decode (for ``engine_idle_s``)."""

    def __init__(self) -> None:
        self.idle_since: float | None = None

    def submitted(self) -> float:
        """Requests go now: the seconds the engine waited for them (0 when it was busy)."""
        now = time.perf_counter()
        waited = 0.0 if self.idle_since is None else now - self.idle_since
        self.idle_since = None
        return waited

    def emptied(self, at: float) -> None:
        """The last request in flight ended at ``at`` (perf_counter seconds)."""
        self.idle_since = at
