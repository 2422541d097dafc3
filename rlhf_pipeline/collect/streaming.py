"""Committing a streamed round in request order: group k goes to the write path once groups 0..k ended.

A round's requests go to the engine at once, each with its seed (:class:`Submitted`), and their
groups come back in the order they end. The collector hands them to its sink in *request* order, in chunks:
whenever the groups that ended extend the prefix of the round already committed, that prefix grows
by one append. Why not in the order they end: the buffer's order would then depend on timing, and
what reads by position (exact resume, the learner's pacing and sampling) would no longer give the
same rows on a rerun. The price is that a group that ended early waits for every earlier one still
decoding; :class:`StreamTiming` measures it (``order_wait_s``) beside the time to the first committed
group and to the last.

Each chunk goes to the sink with the collector's state after exactly its groups: the round's start
and how many of its groups are stored (:data:`STORED_IN_ROUND`), the store publishing the two in one
step. The last chunk is written only once the engine's stream is exhausted, so whatever the engine
draws after its last group (our loop keeps decoding finished rows as pads until the batch ends) is
drawn before the collector's state after the round is taken.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_pipeline.generation.engine import CompletionGroup, GenerationEngine, SampleRequest
from rlhf_pipeline.generation.sampling import SamplingConfig
from rlhf_pipeline.schema import TrajectoryBatch

class Submitted:
    """A round's requests submitted now, each with its seed; :meth:`batches` yields their groups (each
    with its request's ``index``) as lists that ended together, :meth:`cancel` drops what has not begun."""

    def __init__(self, engine: GenerationEngine, requests: Sequence[SampleRequest], seeds: Sequence[int],
                 sampling: SamplingConfig) -> None:
        self.futures = [engine.submit(request, seed, sampling) for request, seed in zip(requests, seeds, strict=True)]
        engine.flush()

    def batches(self) -> Iterator[list[CompletionGroup]]:
        index = {future: k for k, future in enumerate(self.futures)}
        waiting = set(self.futures)
        while waiting:
            done, waiting = wait(waiting, return_when=FIRST_COMPLETED)
            yield [dataclasses.replace(f.result(), index=index[f]) for f in sorted(done, key=index.__getitem__)]

    def cancel(self) -> None:
        for future in self.futures:
            future.cancel()


WriteChunk = Callable[[list[CompletionGroup], bool], None]
"""``write(groups, last)``: one append of consecutive groups of the round; ``last`` for the chunk that
completes it."""


@dataclass
class StreamTiming:
    """When a streamed round's groups ended and were committed, in seconds from the round's start."""

    started: float = field(default_factory=time.perf_counter)
    ended_s: dict[int, float] = field(default_factory=dict)
    """Request index -> when the engine yielded its group."""
    committed_s: dict[int, float] = field(default_factory=dict)
    """Request index -> when the append holding it returned."""
    chunk_sizes: list[int] = field(default_factory=list)

    def now(self) -> float:
        return time.perf_counter() - self.started

    def metrics(self) -> dict[str, float]:
        """``first_group_s`` / ``round_s``: the first and the last append's end; ``first_ended_s``: the
        first group the engine finished (what a commit in the order groups end would achieve);
        ``order_wait_s``: mean seconds a group waited for earlier ones; ``chunks`` and
        ``groups_per_chunk``: appends this round and groups per append."""
        if not self.committed_s:
            return {}
        waits = [self.committed_s[i] - self.ended_s[i] for i in self.committed_s]
        return {
            "first_group_s": min(self.committed_s.values()),
            "round_s": max(self.committed_s.values()),
            "first_ended_s": min(self.ended_s.values()),
            "last_ended_s": max(self.ended_s.values()),
            "order_wait_s": sum(waits) / len(waits),
            "chunks": float(len(self.chunk_sizes)),
            "groups_per_chunk": sum(self.chunk_sizes) / len(self.chunk_sizes),
        }


class InOrderCommit:
    """:func:`commit_in_order` pushed to rather than pulled from: :meth:`add` each list of groups that
    ended together as it comes, :meth:`finish` once the round's producer is done (the agent collector's
    episodes end between turns of its own loop, ``collect/agent_streaming.py``). Groups need only an
    ``index``, their request's place in the round."""

    def __init__(self, count: int, write: WriteChunk, timing: StreamTiming | None = None) -> None:
        self.count = count
        self.write = write
        self.timing = timing or StreamTiming()
        self._ended: dict[int, Any] = {}
        self.committed = 0  # groups 0..committed-1 are written
        self._held: list[Any] = []  # the chunk that completes the round, written once the producer is done

    def add(self, finished_together: Iterable[Any]) -> None:
        now = self.timing.now()
        for group in finished_together:
            if not 0 <= group.index < self.count or group.index in self._ended or group.index < self.committed:
                raise RuntimeError(f"the generation engine yielded request {group.index} twice or outside a round "
                                   f"of {self.count}: not the engine contract (one group per request)")
            self._ended[group.index] = group
            self.timing.ended_s[group.index] = now
        chunk = []
        while self.committed in self._ended:
            chunk.append(self._ended.pop(self.committed))
            self.committed += 1
        if chunk and self.committed == self.count:
            self._held = chunk
        elif chunk:
            _write(self.write, chunk, False, self.timing)

    @property
    def written(self) -> int:
        """Groups appended so far (the chunk that completes the round waits for :meth:`finish`)."""
        return self.committed - len(self._held)

    def finish(self) -> StreamTiming:
        if self.committed != self.count:
            raise RuntimeError(f"the generation engine's stream ended after {self.committed + len(self._ended)} "
                               f"of {self.count} groups")
        _write(self.write, self._held, True, self.timing)
        return self.timing


def commit_in_order(batches: Iterable[list[CompletionGroup]], count: int, write: WriteChunk,
                    timing: StreamTiming | None = None) -> StreamTiming:
    """Consumes a round's stream of ``count`` groups (:meth:`Submitted.batches`: lists of groups that
    finished together) and writes them in request order as prefixes complete, at most one
    append per list (see the module docstring). Raises RuntimeError when the stream yields a request
    twice, one outside the round, or ends before every request's group came."""
    commit = InOrderCommit(count, write, timing)
    for finished_together in batches:
        commit.add(finished_together)
    return commit.finish()


def _write(write: WriteChunk, chunk: list[Any], last: bool, timing: StreamTiming) -> None:
    write(chunk, last)
    done = timing.now()
    timing.chunk_sizes.append(len(chunk))
    for group in chunk:
        timing.committed_s[group.index] = done


STORED_IN_ROUND = "groups_stored_in_round"
"""In a collector's state taken within a streamed round: how many of the round's groups (in request
order, dropped ones included) are stored. The rest of the state is the round's start, so a restart
generates the round again from the same prompts and seeds and writes only the groups after those."""


def partial_round(start_state: dict[str, Any], groups_stored: int) -> dict[str, Any]:
    """The state of a collector whose round, begun at ``start_state``, has ``groups_stored`` groups stored."""
    return {**start_state, STORED_IN_ROUND: int(groups_stored)}


def stored_in_round(state: dict[str, Any]) -> int:
    """The groups of the round ``state`` starts that are stored already (0: a round boundary)."""
    return int(state.get(STORED_IN_ROUND, 0))


def without_stored(batch: TrajectoryBatch, first_group_id: int, stored: int) -> TrajectoryBatch:
    """``batch`` less the groups of its round stored already: ids below ``first_group_id + stored``."""
    if not stored:
        return batch
    return batch.select(torch.nonzero(batch["group_id"] >= first_group_id + stored).squeeze(-1))
