"""Committing a round's groups in group-id order (:class:`InOrderCommit`), each append with the collector's
state after it. Groups end in whatever order their episodes end; committing them in that order would
make the buffer's order (and what reads by position: resume, pacing, sampling) depend on timing. So
whenever the groups that ended extend the round's committed prefix, the prefix grows by one append; the
chunk that completes the round is written once its episodes are all done. :meth:`InOrderCommit.metrics`
measures what the wait costs (``order_wait_s``).
Design: docs/generation.md#rounds-groups-and-turns-as-they-finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from rlhf_pipeline.schema import TrajectoryBatch


class InOrderCommit:
    """:meth:`add` each list of groups that ended together as it comes (each with an ``index``, its
    place in the round), :meth:`finish` once the round's episodes are all done. ``write(groups, last)``:
    one append of consecutive groups of the round; ``last`` for the chunk that completes it. It also
    keeps when each group ended and was committed, in seconds from ``started`` (:meth:`metrics`)."""

    def __init__(self, count: int, write: Callable[[list[Any], bool], None], started: float | None = None) -> None:
        self.count = count
        self.write = write
        self.started = time.perf_counter() if started is None else started
        self.ended_s: dict[int, float] = {}  # group index -> when its episodes had all ended
        self.committed_s: dict[int, float] = {}  # group index -> when the append holding it returned
        self.chunk_sizes: list[int] = []
        self._ended: dict[int, Any] = {}
        self.committed = 0  # groups 0..committed-1 are written (or held as the round's last chunk)
        self._held: list[Any] = []  # the chunk that completes the round, written by finish()

    def add(self, finished_together: Iterable[Any]) -> None:
        now = time.perf_counter() - self.started
        for group in finished_together:
            if not 0 <= group.index < self.count or group.index in self._ended or group.index < self.committed:
                raise RuntimeError(f"group {group.index} ended twice or outside a round of {self.count}: "
                                   f"not the engine contract (one answer per request)")
            self._ended[group.index] = group
            self.ended_s[group.index] = now
        chunk = []
        while self.committed in self._ended:
            chunk.append(self._ended.pop(self.committed))
            self.committed += 1
        if chunk and self.committed == self.count:
            self._held = chunk
        elif chunk:
            self._write(chunk, False)

    @property
    def written(self) -> int:
        """Groups appended so far (the chunk that completes the round waits for :meth:`finish`)."""
        return self.committed - len(self._held)

    def finish(self) -> InOrderCommit:
        if self.committed != self.count:
            raise RuntimeError(f"the round ended with {self.committed + len(self._ended)} of its {self.count} "
                               f"groups")
        self._write(self._held, True)
        return self

    def _write(self, chunk: list[Any], last: bool) -> None:
        self.write(chunk, last)
        done = time.perf_counter() - self.started
        self.chunk_sizes.append(len(chunk))
        for group in chunk:
            self.committed_s[group.index] = done

    def metrics(self) -> dict[str, float]:
        """``first_group_s`` / ``round_s``: the first and the last append's end; ``first_ended_s``: the
        first group that ended (what a commit in the order groups end would achieve);
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


STORED_IN_ROUND = "groups_stored_in_round"
"""In a collector's state taken within a round: how many of the round's groups (in group order,
dropped ones included) are stored. The rest of the state is the round's start, so a restart runs the
round again from the same tasks and seeds and writes only the groups after those."""


def partial_round(start_state: dict[str, Any], groups_stored: int) -> dict[str, Any]:
    """The state of a collector whose round, begun at ``start_state``, has ``groups_stored`` groups stored."""
    return {**start_state, STORED_IN_ROUND: int(groups_stored)}


def stored_in_round(state: dict[str, Any]) -> int:
    """The groups of the round ``state`` starts that are stored already (0: a round boundary)."""
    return int(state.get(STORED_IN_ROUND, 0))


def without_stored(batch: TrajectoryBatch | None, first_group_id: int, stored: int) -> TrajectoryBatch | None:
    """``batch`` less the groups of its round stored already (ids below ``first_group_id + stored``);
    None when no row is left."""
    if batch is not None and stored:
        batch = batch.select(torch.nonzero(batch["group_id"] >= first_group_id + stored).squeeze(-1))
    return batch if batch is not None and len(batch) else None
