"""An agent round's groups written as they end, in request order.

The rollout's loop (``agents/rollout.py``) says between turns which groups have all their episodes
ended (or were dropped); :class:`AgentRoundStream` hands them to the single-turn collector's in-order
commit (``collect/streaming.py``: group k goes to the sink once groups 0..k ended, the round's last
chunk once the rollout returned), each chunk with the state after its groups (the round's start and
the groups of it stored), so a kill between two appends resumes to the same rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_pipeline.agents.episode import Episode, episodes_to_batch
from rlhf_pipeline.collect.streaming import InOrderCommit, StreamTiming, partial_round
from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.schema.ids import id_base


@dataclass(frozen=True)
class EndedGroup:
    """One task's group once its episodes ended: ``index`` its task's place in the round;
    ``episodes`` None when the group was dropped (nothing of it is written)."""

    index: int
    episodes: list[Episode] | None


class AgentRoundStream:
    """One streamed agent round: :meth:`groups_ended` is the rollout's ``on_groups_ended``,
    :meth:`finish` writes the last chunk once the rollout returned.

    ``rows(groups)`` builds the rows of consecutive ended groups (None: every one dropped);
    ``commit(batch, state, last)`` appends them with the state after them (less what a cut-off round
    already stored); ``start_state``: the collector's state at the round's start."""

    def __init__(self, tasks: int, rows: Callable[[list[EndedGroup]], TrajectoryBatch | None],
                 commit: Callable[[TrajectoryBatch | None, dict[str, Any], bool], None], start_state: dict[str, Any],
                 started: float) -> None:
        self._rows = rows
        self._commit_rows = commit
        self._start_state = start_state
        self._state_after: Callable[[], dict[str, Any]] | None = None
        self.chunks: list[TrajectoryBatch] = []  # the rows of every append so far, in request order
        self.stored = 0  # the round's groups (dropped ones too) whose append is done
        self._commit = InOrderCommit(tasks, self._write, StreamTiming(started=started))

    def groups_ended(self, ended: list[tuple[int, list[Episode] | None]]) -> None:
        self._commit.add([EndedGroup(index, episodes) for index, episodes in ended])

    def finish(self, state_after: Callable[[], dict[str, Any]]) -> dict[str, float]:
        """Writes the round's last chunk with ``state_after()`` (the state after the round, which needs
        the whole rollout); returns the round's timing metrics."""
        self._state_after = state_after
        return self._commit.finish().metrics()

    def batch(self) -> TrajectoryBatch | None:
        """The round's rows: every chunk's, in request order (None: every group dropped)."""
        return TrajectoryBatch.cat(self.chunks) if self.chunks else None

    def _write(self, groups: list[EndedGroup], last: bool) -> None:
        batch = self._rows(groups)
        state = self._state_after() if last else partial_round(self._start_state, groups[-1].index + 1)
        self._commit_rows(batch, state, last)
        if batch is not None:
            self.chunks.append(batch)
        self.stored = groups[-1].index + 1


def group_rows(groups: list[EndedGroup], *, group_size: int, first_group_id: int, first_trajectory_id: int,
               policy_version: int, fields) -> TrajectoryBatch | None:
    """The rows of ended groups with the ids :meth:`Rollout.to_batch` gives them: task ``i``'s group
    ``first_group_id + i``, its episode ``j`` trajectory ``first_trajectory_id + i * group_size + j``."""
    kept = [g for g in groups if g.episodes is not None]
    if not kept:
        return None
    return episodes_to_batch([e for g in kept for e in g.episodes],
                             group_ids=[first_group_id + g.index for g in kept for _ in g.episodes],
                             trajectory_ids=[first_trajectory_id + g.index * group_size + j
                                             for g in kept for j in range(len(g.episodes))],
                             policy_version=policy_version, fields=fields)


def round_stream(collector, tasks: int, start_state: dict[str, Any], started: float) -> AgentRoundStream:
    """The stream of one round of ``collector`` (an :class:`~.agent_collector.AgentCollector`) of
    ``tasks`` groups, its rows with the ids the unstreamed round gives them."""
    cfg = collector.config
    base = id_base(cfg.collector_index)

    def rows(groups: list[EndedGroup]) -> TrajectoryBatch | None:
        return group_rows(groups, group_size=cfg.group_size, first_group_id=base + collector.groups_emitted,
                          first_trajectory_id=base + collector.trajectories_emitted,
                          policy_version=collector.policy_version, fields=cfg.row_fields)

    return AgentRoundStream(tasks, rows, collector._commit, start_state, started)


def write_round(stream: AgentRoundStream | None, batch: TrajectoryBatch | None, state_after: Callable[[], dict],
                commit: Callable[[TrajectoryBatch | None, dict[str, Any], bool], None]) -> dict[str, float]:
    """The round's last write once its rollout returned, with ``state_after()``: a streamed round's
    last chunk, or the whole ``batch`` in one append. Returns the streamed round's timing metrics
    ({} unstreamed)."""
    if stream is not None:
        return stream.finish(state_after)
    commit(batch, state_after(), True)
    return {}
