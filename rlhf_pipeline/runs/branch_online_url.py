"""A branch at an ``s3://``/``az://`` URL of a run with collectors at a URL beside it, continued
online: ``rlhf-pipeline run PIPELINE.py --home s3://.../runs --run-name NEW``.

What ``runs/branch_online.py`` does in a run directory, done where there are no hard links and no
renames. The branch's first online start (:func:`prepare_online_branch_at_url`, before anything
else) writes, at the branch's URL:

* each collector's position (``collector/shard-kkkk.pt``): the parent's state when its shard held
  the rows the checkpoint of step N recorded, read from the parent's position history at the
  parent's URL (``collect/position_history.py`` keeps it in the run store, one object per round);
* the weights versions its next rounds sample with (from the one the collector held at those rows
  to the branch step's): server-side copies of the parent's weights objects while it keeps them,
  else of the copies its history keeps (the learner prunes old versions long before a branch);
* ``buffer.continues.json`` beside the branch's buffer prefix, last (a start killed before it does
  all again; each object written is the same again): the branch's buffer reads the parent's Zarr
  shards at the parent's URL in place below row N, then its own shards at its own URL
  (``storage/continued.py``), so the learner's positions, sampler and pacing go on as the parent's.

The parent is only read (listed, read, and copied from): its objects keep their etags.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.runs.branch_online import OnlineBranchError, pending_rows
from rlhf_pipeline.storage.continues import continued_rows, write_continued_rows


def start_online_at_url(paths: RunPaths) -> None:
    """``run``/``collect``/``learn`` of a run at a URL: a branch of a run with collectors is set up
    to continue online, or refused (``OnlineBranchError``, one line with the ``replay`` command)."""
    from rlhf_pipeline.runs.branch import PARENT_ROWS
    from rlhf_pipeline.runs.branch_url import offline_branch_of

    lineage = None if paths.url is None else offline_branch_of(paths)
    if lineage is not None:
        from rlhf_pipeline.runs.branch_command import offline_command

        prepare_online_branch_at_url(paths, lineage,
                                     lambda: offline_command(paths, lineage, f"{paths.url}/{PARENT_ROWS}"))


def prepare_online_branch_at_url(paths: RunPaths, lineage: dict[str, Any], offline: Callable[[], str]) -> None:
    """Sets the branch at ``paths.url`` up to continue online (module docstring), once; ``offline``:
    the command that continues it offline, for a refusal in one line (made only then)."""
    buffer = paths.buffer_location
    if continued_rows(buffer) is not None:
        return  # set up by an earlier start
    from rlhf_pipeline.collect.position_history import PositionHistory, history_key
    from rlhf_pipeline.learn.checkpoint import run_checkpoints
    from rlhf_pipeline.runs.branch_url import offline_branch_of
    from rlhf_pipeline.storage.buffers import shard_index

    parent = RunPaths.at_url(str(lineage["parent"]))

    def refuse(why: str) -> OnlineBranchError:
        return OnlineBranchError(f"{paths.url} is a branch of {parent.url} at step {lineage['step']} and cannot "
                                 f"continue online: {why}; continue it offline with {offline()}")

    reached = run_checkpoints(paths).latest_step()
    if reached is not None and reached > int(lineage["step"]):
        raise refuse(f"it was continued offline already (it has a checkpoint of step {reached})")
    saved = json.loads(parent.store.read("settings.json") or b"{}")
    parent_buffer = str(saved.get("buffer_url") or parent.buffer_location).rstrip("/")
    if continued_rows(parent_buffer) is not None or offline_branch_of(parent) is not None:
        raise refuse("its parent is itself a branch (continuing a branch of a branch online is not there yet)")
    if parent_buffer == buffer.rstrip("/"):
        raise refuse(f"its buffer is its parent's ({buffer}): give the branch a buffer_url of its own")
    states, histories = {}, []
    for name, count in sorted((lineage.get("buffer_rows") or {}).items()):
        index = shard_index(name)
        if index is None:
            raise refuse("its parent keeps one single-store buffer (made before shards), not one shard per collector")
        if not count:
            continue  # that collector had written nothing: it starts afresh
        history = PositionHistory(parent.store, history_key(f"collector/shard-{index:04d}.pt"))
        state = history.state_at(count)
        if state is None:
            raise refuse(f"the parent keeps no state of its collector {index} at row {count} of {name} (a run made "
                         f"before collector position histories at URLs, or one pruned since)")
        if pending_rows(state.get("pending")):
            raise refuse(f"its collector {index} had rows of groups not whole yet pending at row {count} of {name}, "
                         f"and restarting a collector with pending groups online is not there yet")
        states[index] = state
        histories.append((history.held_at(count), history))
    import torch

    for index, state in states.items():
        payload = {"format": 1, "committed": state["committed"], "loop": state["loop"], "inflight": None}
        paths.store.write(f"collector/shard-{index:04d}.pt", lambda f, p=payload: torch.save(p, f), fence=False)
    if lineage.get("policy_version") is not None:
        for held, history in histories:
            if held is not None:
                _copy_parent_weights(parent, paths, history, held, int(lineage["policy_version"]))
    write_continued_rows(buffer, parent_buffer, lineage.get("buffer_rows") or {})


def _copy_parent_weights(parent: RunPaths, branch: RunPaths, history: Any, oldest: int, newest: int) -> None:
    """Server-side copies of the parent's weights of versions ``oldest..newest`` into the branch's
    ``weights/``: the parent's own object while it keeps it, else the copy its history keeps."""
    from rlhf_pipeline.coordination.weights import WEIGHTS, published_objects

    kept, have = published_objects(parent.store), published_objects(branch.store)
    for version in range(oldest, newest + 1):
        if version in have:
            continue
        source = f"{WEIGHTS}/{kept[version]}" if version in kept else history.weights_key(version)
        if source is None:
            continue  # neither keeps it: a round that needs it waits for a newer version, as a resumed run does
        branch.store.copy(source, f"{WEIGHTS}/{source.rsplit('/', 1)[-1]}", source=parent.store)
