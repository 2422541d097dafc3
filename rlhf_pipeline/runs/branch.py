"""``rlhf-pipeline branch RUN --from-step N NEW_RUN``: a new run that starts from RUN's checkpoint of step N.

What a branch is made of (all of it written here, once; the parent is only read, so its files
stay byte-identical):

* ``checkpoints/step_N.pt`` and its rewind record: the parent's (a hard link where the file
  system allows, else a copy: checkpoint files are never changed in place). The learner resumes
  from it as from its own (model, optimizer, LR schedule, RNG, sampler position, intake), so a
  branch with no setting changed trains, step for step, what the parent trained after step N
  over the same rows;
* ``settings.json``: the parent's, with the ``--set`` changes applied. Only what a resumed run may
  change may change here (``learner.*``: learning rate, loss, KL, sampler; and ``steps``,
  ``device``): the rest (model shape, schema, group size, prompts...) made the rows the branch
  reads, and is refused by name;
* the pipeline file's copy (``pipeline.py``, ``pipeline_modules/``), the metrics and (a replay)
  ``batches.jsonl`` lines of steps up to N, and the weights of the checkpoint's policy version
  (what a collector loads first);
* ``branch.json``: the parent (its path), the step, the rows each of the parent's buffer shards
  had published when that checkpoint was saved (the rewind record's ``buffer_rows``), and the
  settings changed. ``inspect`` reads it (``runs/lineage.py``).

* for a parent with collectors, ``parent-rows/``: a saved selection (``storage/selection.py``)
  naming, per shard, the range of global ids it had published at step N (kept as ranges, a few
  bytes per shard at any buffer size: ``storage/row_ranges.py``). It is read
  in place (no row copied), read-only, and opening it checks that the parent still holds exactly
  those rows; rows the parent wrote after step N are not in it.

How it continues. A branch of a replay (a run trained offline from a recorded buffer) continues
with the same ``replay`` command under the branch's name: its source is read-only and does not
change, so the branch reads exactly the rows the parent read. A branch of a run with collectors
continues online with the parent's ``run`` command under the branch's name (those rows plus its
own shards, its collectors restarted from their state at those rows: ``runs/branch_online.py``,
set up by :func:`refuse_online_start`, which refuses in one line where it cannot be), or offline
with ``replay --buffer NEW_RUN/parent-rows --run-name NEW_RUN``: from the checkpoint's model,
optimizer and schedule, over the parent's rows up to step N in epochs (the epoch sampler starts
afresh: the checkpoint's was the online one).
"""

from __future__ import annotations

import fcntl
import json
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlhf_pipeline.learn.checkpoint import CheckpointManager
from rlhf_pipeline.runs.lineage import (
    BRANCH_FILE,
    BRANCH_FORMAT,
    branches_settled,
    find_branches,
    is_detached,
    is_run_directory,
    read_parent,
)
from rlhf_pipeline.runs.branch_reads import BRANCH_MAKING, HALF_MADE_SUFFIX
from rlhf_pipeline.runs.run_directory import RunError

# settings a branch may change: what a resumed run may change (runs/run_directory.py), learner.* included
_CHANGEABLE = ("steps", "device")
_COPIED = ("pipeline.py", "pipeline_modules")
_LOGS = ("metrics.jsonl", "batches.jsonl")
PARENT_ROWS = "parent-rows"


class BranchError(RunError):
    """The parent, the step, the new run's place or a setting change does not allow this branch."""


def branch_run(parent: str | Path, step: int, new: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Makes the branch ``new`` of run ``parent`` at ``step`` (module docstring); returns its ``branch.json``."""
    parent, new = Path(parent).resolve(), Path(new).resolve()
    if not is_run_directory(parent):
        raise BranchError(f"{parent} is not a run directory (no settings.json or checkpoints/); give the directory "
                          f"a run wrote, e.g. storage/<run-name>")
    if new.exists() and (not new.is_dir() or any(new.iterdir())):
        raise BranchError(f"{new} exists; a branch is a new run: choose another NEW_RUN name")
    checkpoints = CheckpointManager(parent / "checkpoints")
    checkpoint = checkpoints.path_of(step)
    if checkpoint is None:
        kept = ", ".join(str(s) for s in checkpoints.steps()) or "none"
        raise _refused(parent, new, f"{parent} keeps no checkpoint of step {step} (kept: {kept}); branch from one "
                                    f"of those, or keep more with learner.checkpoint_keep_every=M (every M-th step)")
    if not (parent / "settings.json").is_file():
        raise BranchError(f"{parent} has no settings.json: a branch takes its parent's settings; give a run directory "
                          f"a run or a replay made")
    saved = json.loads((parent / "settings.json").read_text())
    settings, changed = changed_settings(parent, saved, overrides)
    record = checkpoints.record(step) or {}
    lineage = {
        "format": BRANCH_FORMAT, "parent": str(parent), "step": step,
        "policy_version": record.get("policy_version"), "buffer_rows": record.get("buffer_rows"),
        "replay_source": saved.get("replay", {}).get("buffer"), "settings_changed": changed,
        "overrides": list(overrides), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    making = new.with_name(new.name + HALF_MADE_SUFFIX)  # renamed into place whole: a failed branch leaves no run
    # held throughout, so no other `branch` of this parent is making NEW meanwhile (_refused relies on it)
    with evicting_parent_stopped(parent), branches_settled(parent):  # and no drop or eviction of the rows named
        if making.exists():
            print(f"[branch] {making} was left half-made by a `branch` stopped midway: removing it and making the "
                  f"branch again", file=sys.stderr)
            shutil.rmtree(making)
        making.mkdir(parents=True)
        try:
            # first, so that the parent's `inspect` lists it if this is stopped midway (runs/lineage.py)
            (making / BRANCH_MAKING).write_text(json.dumps({"parent": str(parent), "step": step}))
            _write_branch(parent, making, checkpoint, step, settings, lineage)
            if new.exists():
                new.rmdir()  # empty (checked above)
            making.replace(new)
        except FileNotFoundError as exc:  # the running parent pruned that checkpoint (or weights) meanwhile
            shutil.rmtree(making, ignore_errors=True)
            raise BranchError(f"{exc.filename} went away while branching (the parent is running and pruned it); "
                              f"branch from a step it keeps: learner.checkpoint_keep_every=M keeps every M-th"
                              ) from None
        except BaseException:
            shutil.rmtree(making, ignore_errors=True)
            raise
    (new / BRANCH_MAKING).unlink()
    return lineage


def _refused(parent: Path, new: Path, reason: str) -> BranchError:
    """The refusal of a branch that cannot be made (any more), once the ``NEW.creating/`` that a
    ``branch`` of it stopped midway left is removed: no rerun would remove it any more, and it holds
    nothing anyone reads. Under the lock a branch being made holds throughout (:func:`branch_run`),
    so it is no other ``branch``'s work in progress."""
    from rlhf_pipeline.runs.lineage import half_made_parent

    making = new.with_name(new.name + HALF_MADE_SUFFIX)
    with branches_settled(parent):
        if not making.is_dir() or half_made_parent(making) not in (None, str(parent)):  # another parent's
            return BranchError(reason)
        shutil.rmtree(making)
    return BranchError(half_made_removed(reason, str(making)))


def half_made_removed(reason: str, where: str) -> str:
    """A refusal's line once the branch a ``branch`` stopped midway left half-made at ``where`` was removed."""
    return (f"{reason}. Removed {where}, the branch a `branch` stopped midway left half-made (it held nothing "
            f"anyone reads)")


def changed_settings(parent: Path, saved: dict[str, Any], overrides: Sequence[str]) -> tuple[dict, list[str]]:
    """The parent's ``settings.json`` with ``overrides`` applied (names and values checked by the
    parent's copy of its pipeline file; the learner checks the whole at its start), and what changed
    as ``key: was A, now B`` lines."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if "=" not in item:
            raise BranchError(f"--set expects key=value, got {item!r}")
        if not (key.startswith("learner.") or key in _CHANGEABLE):
            raise BranchError(
                f"--set {key}: cannot change at a branch point; the parent's rows up to the branch step were made "
                f"with it (only learner.* settings, steps and device may change). Start a new run to change it")
    if not overrides:
        return saved, []
    from rlhf_pipeline.files.run_paths import RunPaths
    from rlhf_pipeline.pipeline import PipelineError, load_pipeline_module, make_settings, settings_to_json
    from rlhf_pipeline.runs.pipeline_copy import importable_copy

    try:  # the parent's own pipeline file checks each name and parses each value to its type
        importable_copy(RunPaths(parent))
        updated = settings_to_json(make_settings(load_pipeline_module(parent / "pipeline.py"), overrides))
    except (PipelineError, FileNotFoundError) as exc:
        raise BranchError(f"--set: {exc}") from None
    settings, changed = json.loads(json.dumps(saved)), []
    for item in overrides:
        parts = item.split("=", 1)[0].strip().split(".")
        old, new = _get(saved, parts), _get(updated, parts)
        target = settings
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = new
        if old != new:
            changed.append(f"{'.'.join(parts)}: was {old!r}, now {new!r}")
    return settings, changed


def _get(data: dict[str, Any], parts: list[str]) -> Any:
    for part in parts:
        data = data.get(part, {}) if isinstance(data, dict) else {}
    return data if data != {} else None


def _write_branch(parent: Path, new: Path, checkpoint: Path, step: int, settings: dict, lineage: dict) -> None:
    from rlhf_pipeline.learn.metrics import truncate_metrics

    (new / "settings.json").write_text(json.dumps(settings, indent=2, sort_keys=True))
    for name in _COPIED:
        source = parent / name
        if source.is_dir():
            shutil.copytree(source, new / name)
        elif source.is_file():
            shutil.copyfile(source, new / name)
    (new / "checkpoints").mkdir()
    _link_or_copy(checkpoint, new / "checkpoints" / checkpoint.name)
    record = checkpoint.with_suffix(".json")
    if record.is_file():
        shutil.copyfile(record, new / "checkpoints" / record.name)
    for name in _LOGS:  # the lines of steps up to the branch point: a resumed learner writes the later ones
        if (parent / name).is_file():
            shutil.copyfile(parent / name, new / name)
            truncate_metrics(new / name, step)
    _publish_checkpoint_weights(parent, new, checkpoint, lineage.get("policy_version"))
    if lineage["replay_source"] is None and (parent / "buffer").exists():
        from rlhf_pipeline.storage.continues import continued_rows

        continues = continued_rows(parent / "buffer")
        if continues is not None:
            grandparent = Path(continues["parent_buffer"]).parent
            raise BranchError(f"{parent} is a branch continued online: its rows are partly its parent's, and "
                              f"branching it is not there yet; branch its parent ({grandparent}) instead")
        if lineage["buffer_rows"] is None:
            raise BranchError(f"the checkpoint of step {step} of {parent} has no rewind record (a run made before "
                              f"records): which of its rows were published at that step is not known; branch "
                              f"from a later step")
        write_parent_rows(parent / "buffer", new / PARENT_ROWS, lineage["buffer_rows"], step)
    elif lineage["replay_source"] is None and (parent / PARENT_ROWS).is_dir():
        # a branch that was never continued: its rows are its own parent's, named by its selection
        shutil.copytree(parent / PARENT_ROWS, new / PARENT_ROWS)
    (new / BRANCH_FILE).write_text(json.dumps(lineage, indent=2, sort_keys=True))


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the file system allows (a checkpoint can be gigabytes), else a copy. Safe
    because a checkpoint or weights file is never changed in place: a save writes a new file and
    renames it over the name, and pruning unlinks the parent's name, not the branch's."""
    import os

    try:
        os.link(source, target)
    except OSError:  # another file system, or one without hard links
        shutil.copyfile(source, target)


def write_parent_rows(buffer: Path, target: Path, buffer_rows: dict[str, int], step: int) -> None:
    """A saved selection of the rows of ``buffer`` published at the branch step: per shard, its
    held rows below the ``buffer_rows`` the checkpoint recorded (a shard made later had none).
    Those are one range per shard, saved as such (storage/row_ranges.py): O(shards) bytes."""
    from rlhf_pipeline.storage import open_buffer
    from rlhf_pipeline.storage.row_keys import parts_of
    from rlhf_pipeline.storage.selection import write_range_selection

    with open_buffer(buffer, mode="r") as source:
        names = source.shard_names if hasattr(source, "shard_names") else {0: ""}
        ranges = {}
        for part in parts_of(source):
            limit = buffer_rows.get(names.get(part.index, ""))
            if limit is None:
                continue
            if part.next_row < limit:
                raise BranchError(f"{part.store.location} holds {part.next_row} rows, fewer than the {limit} it had "
                                  f"published at step {step}: it was truncated or replaced since")
            ranges[part.index] = (part.first_row, limit)  # rows evicted before the step are gone
        if not sum(max(0, end - first) for first, end in ranges.values()):
            raise BranchError(f"{buffer} held no rows at step {step}; branch from a later step")
        write_range_selection(target, source, ranges, where=f"rows published by step {step}",
                              source_location=str(buffer))


def offline_branch(root: str | Path) -> dict[str, Any] | None:
    """The ``branch.json`` of a branch of a run with collectors (it continues offline, over
    ``parent-rows/``), else None."""
    try:
        lineage = read_parent(root)
    except (ValueError, OSError) as exc:  # a damaged branch.json (json's errors are ValueErrors): one line
        raise BranchError(str(exc)) from None
    return lineage if lineage is not None and lineage.get("replay_source") is None else None


def _publish_checkpoint_weights(parent: Path, new: Path, checkpoint: Path, version: int | None) -> None:
    """The policy the branch starts with as its newest weights version: the parent's file of that
    version while it is kept, else the checkpoint's model (the parent prunes old versions)."""
    from rlhf_pipeline.coordination.weights import publish_weights, weights_path

    if version is not None and weights_path(parent, version).is_file():
        target = weights_path(new, version)
        target.parent.mkdir(parents=True, exist_ok=True)
        _link_or_copy(weights_path(parent, version), target)
        return
    from rlhf_pipeline.files.state_files import load_state

    state = load_state(checkpoint, what="learner checkpoint", legacy_numpy_arrays=True)
    version = int(state["progress"]["policy_version"])
    publish_weights(new, state["model"], version)


def refuse_online_start(root: str | Path) -> None:
    """``run``/``collect``/``learn`` on a branch of a run with collectors: sets it up to continue
    online (``runs/branch_online.py``), or refuses in one line saying why, with the ``replay`` command."""
    lineage = offline_branch(root)
    if lineage is not None:
        from rlhf_pipeline.files.run_paths import RunPaths
        from rlhf_pipeline.runs.branch_command import offline_command
        from rlhf_pipeline.runs.branch_online import prepare_online_branch

        prepare_online_branch(root, lineage,
                              lambda: offline_command(RunPaths(Path(root)), lineage, str(Path(root) / PARENT_ROWS)))


def describe_continuation(new: Path, lineage: dict[str, Any]) -> str:
    """The command that continues the branch, for ``branch`` to print: the parent's, with every
    setting it was started with and the branch's changes (``runs/branch_command.py``)."""
    from rlhf_pipeline.files.run_paths import RunPaths
    from rlhf_pipeline.pipeline import PipelineError
    from rlhf_pipeline.runs.branch_command import branch_commands, describe, not_rebuilt

    try:
        return describe(branch_commands(RunPaths(new), lineage, str(new / PARENT_ROWS)), lineage["step"])
    except (PipelineError, ValueError, OSError) as exc:
        return not_rebuilt(lineage["overrides"], exc)


def main_message(new: Path, lineage: dict[str, Any]) -> None:
    changed = "; ".join(lineage["settings_changed"]) or "no setting changed"
    print(f"[branch] {new}: from {lineage['parent']} at step {lineage['step']} ({changed})", file=sys.stderr)
    print(f"[branch] {describe_continuation(new, lineage)}", file=sys.stderr)


def refuse_evicting_parent(root: str | Path) -> None:
    """A parent whose buffer evicts its oldest rows (a store with a capacity) may not run while a
    branch reads its rows by reference (``parent-rows/``): the eviction would take rows from under
    the branch. Refused in one line naming the branch, before the run starts (and again once the
    run holds its directory, which :func:`evicting_parent_stopped` holds while a branch is made)."""
    root = Path(root)
    readers = [b["run"] for b in find_branches(root)
               if (Path(b["run"]) / PARENT_ROWS).exists() and not is_detached(b["run"])]
    if not readers:
        return
    evicting = _evicting_shards(root)
    if evicting:
        raise BranchError(
            f"{evicting[0]} evicts its oldest rows (it has a capacity), and branch {readers[0]} reads rows of "
            f"{root} by reference; running it would take them from the branch. Make the branch self-contained first: "
            f"rlhf-pipeline detach {readers[0]} (copies the rows it reads into its own store)")


def _evicting_shards(root: Path) -> list[str]:
    """The shards of ``root``'s buffer that evict their oldest rows (a store with a capacity)."""
    if not (root / "buffer").exists():
        return []
    from rlhf_pipeline.storage import open_buffer

    with open_buffer(root / "buffer", mode="r") as store:
        shards = list(store.shards.values()) if hasattr(store, "shards") else [store]
        return [shard.location for shard in shards if shard.supports_eviction]


@contextmanager
def evicting_parent_stopped(parent: Path) -> Iterator[None]:
    """While a branch of a parent whose buffer evicts is made: the parent's ``run.lock`` (the lock
    its commands hold while they run; opened read-only, nothing written), so the parent is not
    running and does not start until the branch exists, and its start then refuses to evict the
    rows the branch reads. A running parent is refused by name."""
    from rlhf_pipeline.runs.run_directory import HOLDER_FILE

    evicting = _evicting_shards(parent)
    if not evicting or not (parent / HOLDER_FILE).is_file():
        yield
        return
    with open(parent / HOLDER_FILE, "rb") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BranchError(f"{parent} is running and {evicting[0]} evicts its oldest rows (it has a capacity): "
                              f"they could be taken from the branch as it is made. Stop the parent, branch it, and "
                              f"detach the branch (rlhf-pipeline detach NEW_RUN) before starting the parent again; "
                              f"or bound the buffer with retention.* instead, which keeps a branch's rows") from None
        yield
