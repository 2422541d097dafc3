"""A branch of a run with collectors continued online: its first ``run``/``learn``/``collect`` writes
each collector's position from the parent's position history, the weights versions those
collectors sample with next, and last ``buffer.continues.json`` (a start killed midway does it all
again). ``docs/branching.md#continuing-online``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from rlhf_pipeline.files.run_store import state_store_and_key
from rlhf_pipeline.files.settings_history import saved_settings
from rlhf_pipeline.runs.run_directory import RunError
from rlhf_pipeline.storage.continues import continued_rows, write_continued_rows

# (torch, and the collector modules that import it, load only on a branch's first online start:
# ``run`` imports no torch itself)


def prepare_online_branch(paths: Any, lineage: dict[str, Any], offline: Callable[[], str]) -> None:
    """Sets the branch at ``paths`` (a ``RunPaths``: a directory or a URL) up to continue online
    once; ``offline``: the command that continues it offline, for a refusal (made
    only then: it loads the pipeline copy)."""
    buffer = paths.buffer_location
    if continued_rows(buffer) is not None:
        return  # set up by an earlier start
    from rlhf_pipeline.collect.position_history import PositionHistory, history_key
    from rlhf_pipeline.files.run_paths import RunPaths
    from rlhf_pipeline.learn.checkpoint import run_checkpoints
    from rlhf_pipeline.runs.lineage import read_parent
    from rlhf_pipeline.files.shard_names import is_import_shard
    from rlhf_pipeline.storage.buffers import join_shard, shard_index

    parent, rows = RunPaths.at(str(lineage["parent"])), lineage.get("buffer_rows") or {}

    def refuse(why: str) -> RunError:  # says why, and gives the `replay` command that continues it offline
        return RunError(f"{paths.location} is a branch of {parent.location} at step {lineage['step']} and "
                        f"cannot continue online: {why}; continue it offline with {offline()}")

    reached = run_checkpoints(paths).latest_step()
    if reached is not None and reached > int(lineage["step"]):
        raise refuse(f"it was continued offline already (it has a checkpoint of step {reached})")
    saved = saved_settings(parent.store)
    parent_buffer = str((saved or {}).get("buffer_url") or parent.buffer_location).rstrip("/")
    if saved is None and not parent.store.list("buffer"):
        raise refuse(f"its parent's buffer ({parent_buffer}) is not there")
    try:
        grandparent = read_parent(parent.store)
    except ValueError as exc:  # its branch.json is damaged
        raise refuse(str(exc)) from None
    if continued_rows(parent_buffer) is not None or (grandparent or {"replay_source": ""}).get("replay_source") is None:
        raise refuse("its parent is itself a branch (continuing a branch of a branch online is not there yet)")
    if parent_buffer == buffer.rstrip("/"):
        raise refuse(f"its buffer is its parent's ({buffer}): give the branch a buffer_url of its own")
    states, histories, imported = {}, [], []
    for name, count in sorted(rows.items()):
        index = shard_index(name)
        if index is None:
            raise refuse("its parent keeps one single-store buffer (made before shards), not one shard per collector")
        if not count:
            continue  # that collector had written nothing: it starts afresh
        if is_import_shard(name):  # rows `import` wrote: no collector goes on there, the branch reads them
            imported.append(name)
            continue
        history = PositionHistory(parent.store, history_key(f"collector/shard-{index:04d}.pt"))
        state = history.state_at(count)
        if state is None:
            raise refuse(f"the parent keeps no state of its collector {index} at row {count} of {name} (a run made "
                         f"before collector position histories, or one pruned since)")
        if state["pending_rows"]:
            raise refuse(f"its collector {index} had rows of groups not whole yet pending at row {count} of {name}, "
                         f"and restarting a collector with pending groups online is not there yet")
        states[index] = state
        histories.append((history.held_at(count), history))
    from rlhf_pipeline.runs.retention import CLOCK_KEY
    from rlhf_pipeline.storage.writer_state import encode

    for index, state in states.items():
        # in the form a store publishes, less the parent's retention row clock: its marks number the
        # parent's store's rows (the branch's clock marks its own store's, from 0; its rows count as
        # written at its first mark, which only keeps them longer)
        loop = {key: value for key, value in state["loop"].items() if key != CLOCK_KEY}
        paths.store.write(f"collector/shard-{index:04d}.pt", encode({**state["committed"], "runner": loop}, []),
                          fence=False)
    if lineage.get("policy_version") is not None:
        for held, history in histories:
            if held is not None:
                _copy_parent_weights(parent, paths, history, held, int(lineage["policy_version"]))
    for name in imported:
        _mirror_import_shard(join_shard(parent_buffer, name), join_shard(buffer, name))
    write_continued_rows(buffer, parent_buffer, rows)


def _mirror_import_shard(parent_shard: str, own_shard: str) -> None:
    """An empty shard of the branch beside the parent's import shard, of its backend, schema and segment
    size: a branch's buffer reads a parent's shard through its own of the same name (``storage/continued.py``),
    so the learner that resumes from the branch step finds every shard its checkpoint drew from."""
    from rlhf_pipeline.storage import create_store, open_store
    from rlhf_pipeline.storage.convert import segment_rows_of
    from rlhf_pipeline.storage.errors import StoreError

    try:
        open_store(own_shard, mode="r").close()
        return  # made by a start killed before buffer.continues.json
    except StoreError:
        pass
    with open_store(parent_shard, mode="r") as parent:
        backend, schema, segment_rows = parent.backend_name, parent.schema, segment_rows_of(parent)
    create_store(own_shard, backend, schema, segment_rows=segment_rows).close()


def _copy_parent_weights(parent: Any, branch: Any, history: Any, oldest: int, newest: int) -> None:
    """Copies (links, server-side copies) of the parent's weights of versions ``oldest..newest`` into
    the branch's ``weights/``: the parent's learner keeps them for its kept checkpoints; a run made
    before it did keeps them in its collector's history."""
    from rlhf_pipeline.coordination.weights import LEGACY_SUFFIX, SUFFIX, WEIGHTS, published_objects

    kept, have = published_objects(parent.store), published_objects(branch.store)
    for version in range(oldest, newest + 1):
        if version in have:
            continue
        source = f"{WEIGHTS}/{kept[version]}" if version in kept else history.weights_key(version)
        if source is None:
            continue  # neither keeps it: a round that needs it waits for a newer version, as a resumed run does
        name = source.rsplit("/", 1)[-1]
        name = name if name.endswith((SUFFIX, LEGACY_SUFFIX)) else name + SUFFIX  # a history's link has no suffix
        branch.store.copy(source, f"{WEIGHTS}/{name}", source=parent.store)


class _RowsFrom:
    """A store seen with its rows numbered from ``offset`` (a branch's shard continues its parent's)."""

    def __init__(self, store: Any, offset: int) -> None:
        self._store, self._offset = store, offset

    @property
    def next_row(self) -> int:
        return self._offset + int(self._store.next_row)


def collector_rows(paths: Any, store: Any, shard_key: str) -> tuple[Any, int]:
    """``store`` (the shard pacing calls ``shard_key``) as the collector's position and pacing count
    its rows (from the parent's count in a continued branch), and that offset."""
    from rlhf_pipeline.coordination.pacing import buffer_rows_key

    continues = continued_rows(paths.buffer_location)
    offset = int((continues or {}).get("rows", {}).get(buffer_rows_key(shard_key), 0))
    return (_RowsFrom(store, offset) if offset else store), offset


CHECKPOINTS_RELIST_S = 5.0
"""At a URL, how often a collector's position history looks at the run's checkpoints to prune itself."""


def keep_position_history(paths: Any, where: Any, run_store: Any, shard_key: str) -> Any:
    """The position history of the collector whose start file is ``where`` (beside it) and whose shard
    pacing calls ``shard_key``, kept on the run's checkpoint schedule."""
    from rlhf_pipeline.collect.position_history import PositionHistory, history_key
    from rlhf_pipeline.coordination.pacing import buffer_rows_key
    from rlhf_pipeline.learn.checkpoint import run_checkpoints

    store, key = state_store_and_key(where, run_store)
    name = buffer_rows_key(shard_key)

    seen: dict[tuple[int, ...], list[int] | None] = {}
    listed_at = [-math.inf]

    def kept() -> list[int] | None:
        # the records are read again only when the kept checkpoints change. A directory is listed at every
        # append; at a URL, a request each, at most every CHECKPOINTS_RELIST_S: an older answer prunes
        # less, never an entry a newer checkpoint names (its rows are past every older checkpoint's)
        if seen and paths.url is not None and time.monotonic() - listed_at[0] < CHECKPOINTS_RELIST_S:
            return next(iter(seen.values()))
        listed_at[0] = time.monotonic()
        checkpoints = run_checkpoints(paths)
        steps = tuple(checkpoints.steps())
        if steps not in seen:
            records = [checkpoints.record(step) or {} for step in steps]
            rows = [int(r["buffer_rows"][name]) for r in records if name in (r.get("buffer_rows") or {})]
            seen.clear()
            seen[steps] = rows or None
        return seen[steps]

    return PositionHistory(store, history_key(key), kept)
