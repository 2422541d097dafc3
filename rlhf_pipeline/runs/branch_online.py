"""A branch of a run with collectors, continued online: ``rlhf-pipeline run PIPELINE.py --run-name NEW``.

``branch`` (``runs/branch.py``) made the branch: the checkpoint of step N and its record (the rows
each buffer shard had published then), the settings and ``parent-rows/``. Its first online start
(``run``, ``learn`` or ``collect``; :func:`prepare_online_branch`, before anything else) adds:

* ``buffer.continues.json``: the branch's buffer continues the parent's (``storage/continued.py``).
  The learner reads, per shard, the parent's rows below the recorded count in place (never
  written), then the rows the branch's own collector writes to its own shard store, numbered on
  from there. So the learner's positions, its sampler and its pacing intake go on as the parent's;
* each collector's position (``collector/shard-kkkk.pt``): its state when its shard held exactly the
  recorded rows, from the parent's position history (``collect/position_history.py``): prompt
  position, id counters, sampling RNG and the pacing counts of the collect loop. The branch's
  collector resumes from it as from its own, and writes what the parent's wrote next, unless a
  changed learner setting changed the weights it samples with;
* the parent's weights files of the versions from the oldest one those collectors held to the
  branch step's, where the parent still keeps them (hard links): a paced round samples with the
  version pacing names for it, which may be older than the checkpoint's.

The buffer file is written last, once the rest is there: a start killed midway does it again.
A parent without a position history at those rows (a run made before histories, a state pruned)
continues offline only: refused in one line that names the reason and the ``replay`` command.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.run_store import LocalRunStore
from rlhf_pipeline.runs.run_directory import RunError
from rlhf_pipeline.storage.continues import continued_rows, write_continued_rows

# (torch, and the collector modules that import it, load only on a branch's first online start:
# ``run`` imports no torch itself)


class OnlineBranchError(RunError):
    """The branch cannot continue online (the message says why and gives the ``replay`` command)."""


def prepare_online_branch(root: str | Path, lineage: dict[str, Any], offline: Callable[[], str]) -> None:
    """Sets the branch at ``root`` up to continue online (module docstring), once; ``offline``:
    the command that continues it offline, for a refusal (made only then: it loads the pipeline copy)."""
    root = Path(root)
    if continued_rows(root / "buffer") is not None:
        return  # set up by an earlier start
    from rlhf_pipeline.collect.position_history import PositionHistory, history_key
    from rlhf_pipeline.learn.checkpoint import CheckpointManager
    from rlhf_pipeline.storage.buffers import shard_index

    parent, rows = Path(lineage["parent"]), lineage.get("buffer_rows") or {}

    def refuse(why: str) -> OnlineBranchError:
        return OnlineBranchError(f"{root} is a branch of {parent} at step {lineage['step']} and cannot continue "
                                 f"online: {why}; continue it offline with {offline()}")

    reached = CheckpointManager(root / "checkpoints").latest_step()
    if reached is not None and reached > int(lineage["step"]):
        raise refuse(f"it was continued offline already (it has a checkpoint of step {reached})")
    if continued_rows(parent / "buffer") is not None or (not (parent / "buffer").is_dir()
                                                         and (parent / "parent-rows").is_dir()):
        raise refuse("its parent is itself a branch (continuing a branch of a branch online is not there yet)")
    if not (parent / "buffer").is_dir():
        raise refuse(f"its parent's buffer ({parent / 'buffer'}) is not there")
    states, held_versions = {}, []
    for name, count in sorted(rows.items()):
        index = shard_index(name)
        if index is None:
            raise refuse("its parent keeps one single-store buffer (made before shards), not one shard per collector")
        if not count:
            continue  # that collector had written nothing: it starts afresh
        history = PositionHistory(LocalRunStore(parent / "collector"), history_key(f"{name}.pt"))
        state = history.state_at(count)
        if state is None:
            raise refuse(f"the parent keeps no state of its collector {index} at row {count} of {name} (a run made "
                         f"before collector position histories, or one pruned since)")
        if pending_rows(state.get("pending")):
            raise refuse(f"its collector {index} had rows of groups not whole yet pending at row {count} of {name}, "
                         f"and restarting a collector with pending groups online is not there yet")
        states[index] = state
        held = history.held_at(count)
        if held is not None:
            held_versions.append((held, history))
    import torch

    from rlhf_pipeline.files.atomic import write_atomic

    for index, state in states.items():
        payload = {"format": 1, "committed": state["committed"], "loop": _branch_loop(state["loop"]), "inflight": None}
        write_atomic(root / "collector" / f"shard-{index:04d}.pt", lambda f, p=payload: torch.save(p, f))
    if lineage.get("policy_version") is not None:
        for held, history in held_versions:
            _link_parent_weights(parent, root, history, held, int(lineage["policy_version"]))
    write_continued_rows(root / "buffer", str(parent / "buffer"), rows)


def _branch_loop(loop: dict[str, Any]) -> dict[str, Any]:
    """The parent collector's loop state, for the branch's: without the parent's retention row clock,
    whose marks number the parent's store's rows (the branch's clock marks its own store's, from 0;
    its rows count as written at its first mark, which only keeps them longer)."""
    from rlhf_pipeline.runs.retention import CLOCK_KEY

    return {key: value for key, value in loop.items() if key != CLOCK_KEY}


def pending_rows(snapshot: bytes | None) -> int:
    """Rows of groups not whole yet in a position history's pending snapshot (``PositionHistory.state_at``)."""
    if not snapshot:
        return 0
    import io

    import torch

    rows = torch.load(io.BytesIO(snapshot), weights_only=True).get("rows")
    return 0 if rows is None else int(rows["group_id"].numel())


def _link_parent_weights(parent: Path, root: Path, history: Any, oldest: int, newest: int) -> None:
    """Hard links (else copies) of the parent's weights of versions ``oldest..newest``: its own file
    while it keeps it, else the one its collector's history keeps."""
    import shutil

    from rlhf_pipeline.coordination.weights import weights_path

    for version in range(oldest, newest + 1):
        target = weights_path(root, version)
        source = weights_path(parent, version)
        source = source if source.is_file() else history.weights(version)
        if source is None or target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)


class _RowsFrom:
    """A store seen with its rows numbered from ``offset`` (a branch's shard continues its parent's)."""

    def __init__(self, store: Any, offset: int) -> None:
        self._store, self._offset = store, offset

    @property
    def next_row(self) -> int:
        return self._offset + int(self._store.next_row)


def collector_rows(paths: Any, store: Any, store_path: str) -> tuple[Any, int]:
    """``store`` as the collector's position and pacing count its rows (from the parent's count in a
    continued branch), and that offset."""
    continues = continued_rows(paths.buffer if paths.url is None else paths.buffer_location)
    offset = int((continues or {}).get("rows", {}).get(_shard_key(paths, store_path), 0))
    return (_RowsFrom(store, offset) if offset else store), offset


def keep_position_history(paths: Any, where: Any, run_store: Any, store_path: str) -> Any:
    """The position history of the collector whose start file is ``where`` (beside it), kept on the
    run's checkpoint schedule."""
    from rlhf_pipeline.collect.position_history import PositionHistory, history_key
    from rlhf_pipeline.learn.checkpoint import run_checkpoints

    store, key = (LocalRunStore(Path(where).parent), Path(where).name) if run_store is None else (run_store, str(where))
    name = _shard_key(paths, store_path)

    seen: dict[tuple[int, ...], list[tuple[int, int]] | None] = {}

    def kept() -> list[tuple[int, int]] | None:
        # one listing per round; the records are read again only when the kept checkpoints change
        checkpoints = run_checkpoints(paths)
        steps = tuple(checkpoints.steps())
        if steps not in seen:
            records = [checkpoints.record(step) or {} for step in steps]
            points = [(int(r["buffer_rows"][name]), int(r.get("policy_version", r["step"])))
                      for r in records if name in (r.get("buffer_rows") or {})]
            seen.clear()
            seen[steps] = points or None
        return seen[steps]

    from rlhf_pipeline.coordination.weights import weights_path

    weights_file = (lambda version: weights_path(paths.root, version)) if paths.url is None else None
    return PositionHistory(store, history_key(key), kept, weights_file,
                           weights_object=_weights_object(paths) if paths.url is not None else None)


def _weights_object(paths: Any) -> Any:
    """At a URL: the key of the run's weights object of a version (None once pruned), one listing each."""
    from rlhf_pipeline.coordination.weights import WEIGHTS, published_objects

    return lambda version: (f"{WEIGHTS}/{name}" if (name := published_objects(paths.store).get(version)) else None)


def _shard_key(paths: Any, store_path: str) -> str:
    from rlhf_pipeline.storage.buffers import shard_key_of

    return "" if paths.single_store_buffer else shard_key_of(store_path)
