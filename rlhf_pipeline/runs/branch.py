"""``rlhf-pipeline branch RUN --from-step N NEW_RUN``: a new run that starts from RUN's checkpoint of
step N and reads RUN's rows up to it by reference (``parent-rows/``), through the two runs' run
stores, so a directory and a URL take one path. Made in place: ``branch.making`` first, ``branch.json``
last; the parent is only read. What a branch holds and how it continues: ``docs/branching.md``.

Why one file: making a branch is one sequence (checks, ``branch.making``, copies, ``parent-rows/``,
``branch.json``, the command that continues it) whose refusals and online start read the same marker
and records.
"""

from __future__ import annotations

import fcntl
import json
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlhf_pipeline.coordination.eval_pins import PINNED_FROM
from rlhf_pipeline.files.atomic import json_object
from rlhf_pipeline.files.run_paths import RunPaths, is_url
from rlhf_pipeline.files.shard_names import is_import_shard
from rlhf_pipeline.files.settings_history import flat_settings, saved_settings, set_dotted, settings_in_force
from rlhf_pipeline.files.state_files import StateFileError, load_state_bytes
from rlhf_pipeline.pipeline import (
    PipelineError,
    make_settings,
    means_none,
    settings_to_json,
    split_override,
    zarr_where_the_buffer_is_a_url,
)
from rlhf_pipeline.runs.branch_online import prepare_online_branch
from rlhf_pipeline.runs.lineage import (
    BRANCH_FILE,
    BRANCH_FORMAT,
    BRANCH_MAKING,
    PARENT_ROWS,
    PARENT_ROWS_MANIFEST,
    branches_settled,
    branch_records,
    is_run,
    read_parent,
    resolved_location,
)
from rlhf_pipeline.runs.pipeline_copy import load_copy
from rlhf_pipeline.runs.replay_options import ReplayOptions
from rlhf_pipeline.runs.retention import wait_for_drops
from rlhf_pipeline.runs.run_directory import HOLDER_FILE, RunError, as_set_value, differences, may_change_on_resume

_LOGS = ("metrics.jsonl", "batches.jsonl")
# settings the replay command gives by its own flags (it sets `steps` from --epochs/--steps)
_REPLAY_FLAGS_SET = ("steps",)


class BranchError(RunError):
    """The parent, the step, the new run's place or a setting change does not allow this branch."""


def check_same_kind(parent: str, new: str) -> None:
    """A parent at a URL branches at a URL of the same cloud; a local parent branches locally."""
    if is_url(parent) != is_url(new):
        where, other = (parent, new) if is_url(parent) else (new, parent)
        raise BranchError(
            f"RUN and NEW_RUN must both be local directories or both URLs ({where} is a URL, {other} is not): a "
            f"parent finds its branches beside it, and a branch elsewhere would be found by neither. Give NEW_RUN as "
            f"a name (made beside RUN) or a URL beside it")
    if is_url(parent) and parent.split("://", 1)[0] != new.split("://", 1)[0]:
        raise BranchError(f"RUN {parent} and NEW_RUN {new} are on different clouds; branch within one "
                          f"(give NEW_RUN as a name: it is made beside RUN)")


def branch_run(parent: str | Path, step: int | str, new: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Makes the branch ``new`` of run ``parent`` at ``step`` (``docs/branching.md``; ``"best"``: the step of
    the parent's best checkpoint by ``learner.keep_best``); returns its ``branch.json``."""
    parent_at, new_at = resolved_location(str(parent)).rstrip("/"), resolved_location(str(new)).rstrip("/")
    check_same_kind(parent_at, new_at)
    if parent_at == new_at:
        raise BranchError(f"NEW_RUN is RUN ({new_at}); a branch is a new run: choose another name")
    parent_paths, new_paths = RunPaths.at(parent_at), RunPaths.at(new_at)
    source, target = parent_paths.store, new_paths.store
    if not is_run(parent_at):
        raise BranchError(f"{parent_at} is not a run (no settings.json or checkpoints/); give the directory or URL "
                          f"a run wrote, e.g. storage/<run-name> or s3://BUCKET/runs/<run-name>")
    if (half_made := half_made_branch(parent_paths)) is not None:
        raise BranchError(half_made)
    saved = saved_settings(source)
    if saved is None:
        raise BranchError(f"{parent_at} has no settings.json: a branch takes its parent's settings; give a run "
                          f"a run or a replay made")
    from rlhf_pipeline.learn.checkpoint import run_best, run_checkpoints
    from rlhf_pipeline.learn.keep_best import NoBestCheckpoint

    if step == "best":  # then as from its step (a running parent may prune it once a better one is scored: said below)
        try:
            best = run_best(parent_paths, "--from-step N (inspect RUN lists the kept steps)")
        except NoBestCheckpoint as exc:
            raise BranchError(str(exc)) from None
        print(f"[branch] the best checkpoint of {parent_at}: {best.describe()}", file=sys.stderr)
        step = best.step
    checkpoints = run_checkpoints(parent_paths)
    # held throughout in a directory, so that no other `branch` of this parent is making NEW meanwhile
    # and the parent's retention drops nothing while the rows are named (runs/retention.py)
    with evicting_parent_stopped(parent_paths), branches_settled(parent_paths.store):
        if checkpoints.path_of(step) is None:
            kept = ", ".join(str(s) for s in checkpoints.steps()) or "none"
            reason = (f"{parent_at} keeps no checkpoint of step {step} (kept: {kept}); branch from one of those, or "
                      f"keep more with learner.checkpoint_keep_every=M (every M-th step)")
            if step == 0:  # the start of a run is no checkpoint: its pipeline builds it again from the seed
                reason += (f". Step 0 is the initial policy, which the parent's pipeline builds again from the same seed "
                           f"and settings: to start over from it, {start_over_command(parent_paths, saved)}")
            # a branch of it left half-made there cannot be made any more, and no rerun would remove it
            if _remove_half_made(target, parent_at):
                reason += (f". Removed {new_at}, the branch a `branch` stopped midway left half-made (it held nothing "
                           f"anyone reads)")
            raise BranchError(reason)
        _clear_place(target, new_at)
        try:  # a parent resumed with other learner settings continued with them
            in_force = settings_in_force(source, saved, step)
        except StateFileError as exc:
            raise BranchError(str(exc)) from None
        resumed_with = [f"{line}: the parent was resumed with it before the steps after {step} (settings_history.json)"
                        for line in differences(flat_settings(saved), flat_settings(in_force)).values()]
        settings, changed = changed_settings(parent_paths, in_force, overrides)
        changed = resumed_with + changed
        changed += _steps_past(settings, step, checkpoints.latest_step(), overrides)
        record = checkpoints.record(step) or {}
        buffer = str(saved.get("buffer_url") or parent_paths.buffer_location)
        lineage = {
            "format": BRANCH_FORMAT, "parent": parent_at, "step": step,
            "policy_version": record.get("policy_version"), "buffer_rows": record.get("buffer_rows"),
            "replay_source": saved.get("replay", {}).get("buffer"), "settings_changed": changed,
            "overrides": list(overrides), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if lineage["replay_source"] is None:  # a run with collectors: the branch names its rows by reference
            _refuse_parent_rows(parent_paths, buffer, lineage, step)
        # first, so that the parent's `inspect` lists it (and retention holds its rows) if this is stopped midway
        target.create(BRANCH_MAKING, json.dumps({"parent": parent_at, "step": step}).encode())
        try:
            _copy_branch(source, new_paths, step, lineage["policy_version"])
            if lineage["replay_source"] is None:  # a run with collectors: its rows up to the step, by reference
                _parent_rows(parent_paths, buffer, new_paths, lineage, step)
        except FileNotFoundError as exc:  # the running parent pruned that checkpoint (or weights) meanwhile
            raise BranchError(f"{exc.filename} went away while branching (the parent is running and pruned it); "
                              f"branch from a step it keeps: learner.checkpoint_keep_every=M keeps every M-th; "
                              f"{new_at} is left half-made: `branch` again removes it") from None
        target.create("settings.json", json.dumps(settings, indent=2, sort_keys=True).encode())
        target.create(BRANCH_FILE, json.dumps(lineage, indent=2, sort_keys=True).encode())  # last: the branch is whole
    target.delete(BRANCH_MAKING)
    return lineage


def _half_made(holds: Callable[[str], bool]) -> bool:
    """Whether a place is a branch left half-made: ``branch.making`` there and no ``branch.json``
    (``branch`` was stopped while making it). ``holds(key)``: a store's ``exists``, or a listing's ``in``."""
    return holds(BRANCH_MAKING) and not holds(BRANCH_FILE)


def half_made_branch(paths: RunPaths) -> str | None:
    """The line ``replay``/``run``/``branch`` print for a run that is a branch left half-made, else None."""
    if not _half_made(paths.store.exists):
        return None
    return (f"{paths.location} is a branch left half-made ({BRANCH_MAKING}, no {BRANCH_FILE}: `branch` was stopped "
            f"while making it); run the same `rlhf-pipeline branch ... {paths.location}` again: it removes it and "
            f"makes it whole")


def _clear_place(target: Any, where: str) -> None:
    """NEW must hold nothing, or a branch left half-made (then it is removed)."""
    keys = target.walk()
    if not keys:
        return
    if not _half_made(keys.__contains__):
        raise BranchError(f"{where} exists and holds objects already; a branch is a new run: choose another NEW_RUN "
                          f"name")
    print(f"[branch] {where} holds a branch left half-made ({BRANCH_MAKING}, no {BRANCH_FILE}): removing its "
          f"{len(keys)} objects and making it again", file=sys.stderr)
    _delete(target, keys)


def _remove_half_made(target: Any, parent: str) -> bool:
    """Removes the branch of ``parent`` left half-made at ``target`` (``branch.making``, no
    ``branch.json``), if there is one; whether it did."""
    keys = target.walk()
    if not _half_made(keys.__contains__):
        return False
    named = (json_object(target.read(BRANCH_MAKING)) or {}).get("parent", parent)
    if resolved_location(str(named)).rstrip("/") != parent:
        return False  # another parent's
    _delete(target, keys)
    return True


def _delete(target: Any, keys: list[str]) -> None:
    for key in keys:
        if key != BRANCH_MAKING:
            target.delete(key)
    target.delete_prefix()  # the marker last: a kill before here is still recognisable


def changed_settings(parent: RunPaths, saved: dict[str, Any], overrides: Sequence[str]) -> tuple[dict, list[str]]:
    """The parent's ``settings.json`` with ``overrides`` applied (names and values checked by the
    parent's copy of its pipeline file; the learner checks the whole at its start), and what changed
    as ``key: was A, now B`` lines."""
    for item in overrides:
        try:
            split_override(item)
        except PipelineError as exc:
            raise BranchError(str(exc)) from None
    if not overrides:
        return saved, []
    try:
        module = load_copy(parent)
        defaults, was = make_settings(module), flat_settings(saved)
        known = flat_settings(settings_to_json(defaults))  # an unknown name is make_settings' to say below
        for item in overrides:  # the rows so far were made with the rest: refused before their values are read
            key, raw = split_override(item)
            given = None if means_none(raw) else raw
            if key in known and not may_change_on_resume(key, defaults, was.get(key), given):
                raise BranchError(
                    f"--set {key}: cannot change at a branch point; the parent's rows up to the branch step were "
                    f"made with it (what a resume may change may change here: learner.*, max_lag, steps, device, "
                    f"eval.*, ray.*, and how the collector reaches its engine, such as generation.url). Start a new "
                    f"run to change it")
        # the parent's own pipeline file checks each name and parses each value to its type
        now = flat_settings(settings_to_json(make_settings(module, overrides)))
    except (PipelineError, FileNotFoundError) as exc:
        raise BranchError(f"--set: {exc}") from None
    settings, keys = json.loads(json.dumps(saved)), [split_override(item)[0] for item in overrides]
    for key in keys:
        set_dotted(settings, key, now.get(key))
    lines = differences(was, now, keys)
    return settings, [lines[key] for key in keys if key in lines]  # in --set's order; a key set twice, twice


def _steps_past(settings: dict[str, Any], step: int, newest: int, overrides: Sequence[str]) -> list[str]:
    """``steps`` beyond the branch point when the parent's is not (it was resumed with a higher ``--steps``,
    which is not recorded): ``newest``, the parent's newest checkpoint's step, or, branched from that, as
    many steps again as the parent was started with, so that the printed command trains. An explicit
    ``--set steps`` stands. A replay parent's count is its ``replay`` record's, which the printed command
    gives as ``--steps``. Changes ``settings``; returns the line for what changed."""
    replay = settings.get("replay")
    counted = settings if replay is None else replay
    was = counted.get("steps")
    if any(split_override(item)[0] == "steps" for item in overrides):
        if replay is not None:  # the printed replay command gives --steps from the record, not --set steps
            replay.update(steps=settings["steps"], epochs=None)
        return []
    if not isinstance(was, int) or was > step:
        return []
    steps = counted["steps"] = newest if newest > step else step + was
    if replay is not None:
        replay["epochs"] = None  # the count is given as --steps now
    reason = "the parent's newest step" if newest > step else f"{was} past the branch point"
    name, other = ("--steps", "the printed command's --steps N") if replay is not None else ("steps", "--set steps=N")
    return [f"{name}: was {was}, now {steps}: {reason}, {other} for another"]


def _copy_branch(source: Any, new: RunPaths, step: int, version: int | None) -> None:
    """The parent's pipeline copy, checkpoint of ``step`` with its record, log lines up to ``step``
    and the checkpoint's weights, copied into the branch's store."""
    from rlhf_pipeline.learn.metrics import truncate_metrics

    target = new.store
    for key in ["pipeline.py", *source.walk("pipeline_modules")]:
        if key == "pipeline.py" and not source.exists(key):
            continue
        target.copy(key, key, source=source)
    checkpoint = f"checkpoints/step_{step:08d}.pt"
    target.copy(checkpoint, checkpoint, source=source)
    if source.exists(checkpoint[:-3] + ".json"):
        target.copy(checkpoint[:-3] + ".json", checkpoint[:-3] + ".json", source=source)
    for log in _LOGS:  # the lines of steps up to the branch point: the resumed learner writes the later ones
        # a directory keeps a log as one file, a URL as parts (learn/metrics.py)
        for key in ([log] if source.exists(log) else []) + source.walk(f"{log}.parts"):
            target.copy(key, key, source=source)
        where, store = new.state_object(new.root / log)
        truncate_metrics(where, step, store=store)  # a new file or object: a linked one stays the parent's
    _copy_weights(source, target, checkpoint, version)
    if version is not None:  # the versions below are the parent's, scored in its eval store: not evaluated again
        target.write(PINNED_FROM, json.dumps({"from": version}).encode())


def _copy_weights(source: Any, target: Any, checkpoint: str, version: int | None) -> None:
    """The checkpoint's policy as the branch's newest weights version: the parent's object while it
    keeps it, else written from the checkpoint's model (the parent prunes old versions)."""
    from rlhf_pipeline.coordination.weights import WEIGHTS, published_objects, publish_weights

    published = published_objects(source)
    if (json_object(source.read(checkpoint[:-3] + ".json")) or {}).get("lora_rank"):
        # a LoRA checkpoint: its adapter applies to version 0, the base; a version the parent pruned
        # the branch's learner publishes from the checkpoint, with its canary (learn/learner.py)
        target.copy(f"{WEIGHTS}/{published[0]}", f"{WEIGHTS}/{published[0]}", source=source)
        if version is not None and version in published and version != 0:
            target.copy(f"{WEIGHTS}/{published[version]}", f"{WEIGHTS}/{published[version]}", source=source)
        return
    name = published.get(version) if version is not None else None
    if name is not None:
        target.copy(f"{WEIGHTS}/{name}", f"{WEIGHTS}/{name}", source=source)
        return
    state = load_state_bytes(target.read(checkpoint), what="learner checkpoint", where=target.describe(checkpoint),
                             legacy_numpy_arrays=True)
    publish_weights(target, state["model"], int(state["progress"]["policy_version"]))


def _refuse_parent_rows(parent: RunPaths, buffer: str, lineage: dict[str, Any], step: int) -> None:
    """What makes the rows of a parent with collectors unknown, refused before anything is written:
    a parent continued online (its rows are partly its own parent's), a checkpoint without a record."""
    from rlhf_pipeline.storage.continues import continued_rows

    continues = continued_rows(buffer)
    if continues is not None:
        grandparent = str(continues["parent_buffer"]).rstrip("/").rpartition("/")[0]
        raise BranchError(f"{parent.location} is a branch continued online: its rows are partly its parent's, and "
                          f"branching it is not there yet; branch its parent ({grandparent}) instead")
    if lineage["buffer_rows"] is None and not parent.store.exists(PARENT_ROWS_MANIFEST):
        from rlhf_pipeline.learn.checkpoint import run_checkpoints

        if (damaged := run_checkpoints(parent).damaged_record(step)) is not None:
            raise BranchError(f"the rewind record of the checkpoint of step {step} of {parent.location} ({damaged}) "
                              f"is damaged: which of its rows were published at that step is not known; restore it "
                              f"from a copy, or branch from another kept step")
        raise BranchError(f"the checkpoint of step {step} of {parent.location} has no rewind record (a run made "
                          f"before records): which of its rows were published at that step is not known; branch "
                          f"from a later step")


def _parent_rows(parent: RunPaths, buffer: str, new: RunPaths, lineage: dict[str, Any], step: int) -> None:
    """``parent-rows/`` in the branch's store: the saved selection of the parent's rows published at
    ``step``, naming the parent's shards where they are (read in place); a parent that is itself a
    branch never continued passes on its own selection."""
    from rlhf_pipeline.storage.selection import publish_selection

    source, target = parent.store, new.store
    if source.exists(PARENT_ROWS_MANIFEST):  # a branch that was never continued: its rows are its own parent's
        for key in source.walk(PARENT_ROWS):
            target.copy(key, key, source=source)
        return
    if not source.is_local:  # no lock there: our branch.making is up, so a drop decided from here on sees it
        wait_for_drops(source, lineage["buffer_rows"].keys())
    # written in the branch's directory (a URL's: this machine's cache of it), then put in its store
    local = new.root / PARENT_ROWS
    if local.exists():
        shutil.rmtree(local)
    write_parent_rows(buffer, local, lineage["buffer_rows"], step)
    publish_selection(local, target, PARENT_ROWS)


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


def offline_branch_of(paths: RunPaths) -> dict[str, Any] | None:
    """The ``branch.json`` of a branch of a run with collectors (it continues with ``replay`` over
    its ``parent-rows/``, or online), else None."""
    try:
        lineage = read_parent(paths.store)
    except (ValueError, OSError) as exc:  # a damaged branch.json: one line
        raise BranchError(str(exc)) from None
    return lineage if lineage is not None and lineage.get("replay_source") is None else None


def start_online(paths: RunPaths) -> None:
    """``run``/``collect``/``learn`` of a branch: one left half-made is refused in one line; one of a
    run with collectors is set up to continue online (``runs/branch_online.py``), or refused in one
    line saying why, with the ``replay`` command."""
    if (half_made := half_made_branch(paths)) is not None:
        raise BranchError(half_made)
    lineage = offline_branch_of(paths)
    if lineage is not None:
        prepare_online_branch(paths, lineage,
                              lambda: offline_command(paths, lineage, f"{paths.location}/{PARENT_ROWS}"))


def main_message(new: str, lineage: dict[str, Any]) -> None:
    """What ``branch`` prints: where from, and the parent's command that continues the branch
    (:func:`branch_message`)."""
    changed = "; ".join(lineage["settings_changed"]) or "no setting changed"
    print(f"[branch] {new}: from {lineage['parent']} at step {lineage['step']} ({changed})", file=sys.stderr)
    print(f"[branch] {branch_message(new, lineage)}", file=sys.stderr)
    # with nothing changed a branch is expected to train what its parent did: with several collectors, it may not
    if _collectors(lineage) > 1 and lineage.get("replay_source") is None and not lineage["settings_changed"]:
        print(f"[branch] note: the parent's {_collectors(lineage)} collectors each continue where they stood, "
              f"but online the steps after {lineage['step']} may differ from the parent's: which rows a step takes "
              f"from each shard depends on timing (docs/branching.md#continuing-online)", file=sys.stderr)


def _collectors(lineage: dict[str, Any]) -> int:
    """The parent's collectors at the branch step: its shards less those ``import`` wrote."""
    return sum(1 for name in lineage.get("buffer_rows") or {} if not is_import_shard(name))


def refuse_evicting_parent(root: str | Path) -> None:
    """A parent whose buffer evicts its oldest rows (a store with a capacity) may not run while a
    branch reads its rows by reference (``parent-rows/``): the eviction would take rows from under
    the branch. Refused in one line naming the branch, before the run starts (and again once the
    run holds its directory, which :func:`evicting_parent_stopped` holds while a branch is made)."""
    root = Path(root)
    readers = [b["run"] for b in branch_records(root)
               if (Path(b["run"]) / PARENT_ROWS).exists() and not b["lineage"].get("detached")]
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
def evicting_parent_stopped(parent: RunPaths) -> Iterator[None]:
    """While a branch of a parent whose buffer evicts is made: the parent's ``run.lock`` (the lock
    its commands hold while they run; opened read-only, nothing written), so the parent is not
    running and does not start until the branch exists, and its start then refuses to evict the
    rows the branch reads. A running parent is refused by name. (Eviction is a local store's: a
    store at a URL bounds its rows with retention, which holds a branch's rows.)"""
    evicting = _evicting_shards(parent.root) if parent.store.is_local else []
    if not evicting or not (parent.root / HOLDER_FILE).is_file():
        yield
        return
    with open(parent.root / HOLDER_FILE, "rb") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BranchError(f"{parent.root} is running and {evicting[0]} evicts its oldest rows (it has a capacity): "
                              f"they could be taken from the branch as it is made. Stop the parent, branch it, and "
                              f"detach the branch (rlhf-pipeline detach NEW_RUN) before starting the parent again; "
                              f"or bound the buffer with retention.* instead, which keeps a branch's rows") from None
        yield


# ====================================================================== the command that continues a branch
# A run records no command line, but its ``settings.json`` holds every setting it was started with and
# its pipeline copy (``pipeline.py``) gives the defaults: each setting that differs from its default is a
# ``--set``. All are given again because a setting left out resumes with its default, which for a
# ``learner.*`` setting is only noted (``runs/run_directory.py``), so it would change silently. A replay
# parent's own flags (``--buffer``, ``--epochs``, ``--order``, ``--seed``, ...) come from the ``replay``
# record its ``settings.json`` keeps. Design: docs/branching.md#the-command.


def recorded_sets(settings: dict[str, Any], module: Any, *, run_at_a_url: bool = False) -> list[str]:
    """``KEY=VALUE`` for each setting in ``settings`` (a run's ``settings.json``) that differs
    from the default of the pipeline ``module``, in the form ``--set`` parses, sorted by key;
    ``buffer_backend=zarr`` not where the buffer is at a URL (``run_at_a_url``, or ``buffer_url``),
    which makes it so. Checked by applying them: a value ``--set`` cannot give back raises
    ``ValueError`` naming it."""
    wanted = flat_settings({k: v for k, v in settings.items() if k != "replay"})

    def differing(defaults: dict[str, Any]) -> list[str]:
        flat = flat_settings(defaults)
        return [key for key in sorted(wanted) if wanted[key] != flat.get(key)]

    sets = [f"{key}={as_set_value(wanted[key])}" for key in differing(settings_to_json(make_settings(module)))]
    lost = differing(settings_to_json(make_settings(module, sets)))
    if lost:
        raise ValueError(f"setting(s) {', '.join(lost)} cannot be given back with --set")
    implied = [item for item in sets if item != "buffer_backend=zarr"]  # by where the buffer is: unsaid
    return implied if "buffer_backend=zarr" in zarr_where_the_buffer_is_a_url(implied, run_at_a_url=run_at_a_url) \
        else sets


def _pipeline_and_sets(paths: Any, settings: dict[str, Any]) -> tuple[str, list[str]]:
    """The pipeline file a command for the run at ``paths`` gives (its copy in a directory, else PIPELINE.py)
    and :func:`recorded_sets` of its ``settings``."""
    local = paths.url is None and not (paths.root / "pipeline_modules").exists()
    pipeline = str(paths.root / "pipeline.py") if local else "PIPELINE.py"
    return pipeline, recorded_sets(settings, load_copy(paths), run_at_a_url=paths.url is not None)


def branch_commands(paths: Any, lineage: dict[str, Any], parent_rows: str) -> dict[str, str]:
    """The commands that continue the branch at ``paths`` (a ``RunPaths``), as shell lines, from its
    ``settings.json`` and pipeline copy: ``"replay"`` for a branch of a replay; ``"online"`` and
    ``"offline"`` for a branch of a run with collectors (``parent_rows``: where its ``parent-rows/``
    is). The pipeline file given is the branch's copy in a directory, else PIPELINE.py: at a URL (any
    machine may continue it), or where the copy imports modules beside it (they load from
    ``pipeline_modules/`` only in a run's start). ``PipelineError``, ``ValueError`` or ``OSError``
    when it cannot be rebuilt."""
    settings = saved_settings(paths.store)
    if settings is None:
        raise ValueError(f"{paths.location} keeps no settings.json")
    pipeline, recorded = _pipeline_and_sets(paths, settings)
    sets = [word for item in recorded for word in ("--set", item)]
    replay_sets = [word for item in recorded if item.split("=", 1)[0] not in _REPLAY_FLAGS_SET
                   for word in ("--set", item)]
    place = ["--home", paths.home, "--run-name", paths.name]
    if lineage.get("replay_source") is not None:
        flags = ReplayOptions.recorded(settings.get("replay", {})).flags()  # each given back as recorded
        return {"replay": shlex.join(["rlhf-pipeline", "replay", pipeline, "--buffer", lineage["replay_source"],
                                      *flags, *place, *replay_sets])}
    collectors = _collectors(lineage)
    many = ["--collectors", str(collectors)] if collectors > 1 else []
    return {"online": shlex.join(["rlhf-pipeline", "run", pipeline, *many, *place, *sets]),
            "offline": shlex.join(["rlhf-pipeline", "replay", pipeline, "--buffer", parent_rows, *place,
                                   *replay_sets])}


def start_over_command(paths: Any, settings: dict[str, Any]) -> str:
    """How to start again from the initial policy of the run at ``paths`` (``settings``: its ``settings.json``),
    which no checkpoint keeps and its pipeline builds again from the same seed and settings: the parent's own
    command under a new name, for a branch asked for at step 0."""
    if "replay" in settings:
        return "give its replay command again under a new --run-name, with the --set values of yours"
    try:
        pipeline, recorded = _pipeline_and_sets(paths, settings)
    except (PipelineError, ValueError, OSError):
        return "run its pipeline under a new --run-name with every --set its settings.json records, and yours"
    command = shlex.join(["rlhf-pipeline", "run", pipeline, "--home", paths.home, "--run-name", "NAME",
                          *(word for item in recorded for word in ("--set", item))])
    return f"run {command} with the --set values of yours"


def branch_message(new: str, lineage: dict[str, Any]) -> str:
    """The line ``branch`` ends with: how to continue the branch at ``new``, the parent's command
    with every setting it was started with and the branch's changes."""
    step = lineage["step"]
    try:
        commands = branch_commands(RunPaths.at(new), lineage, f"{new}/{PARENT_ROWS}")
    except (PipelineError, ValueError, OSError) as exc:
        return (f"continue it with the parent's command under the branch's name, giving every --set the parent was "
                f"given (its settings.json has them) and the branch's: {' '.join(lineage['overrides'])} (the command "
                f"could not be rebuilt: {exc})")
    # PIPELINE.py where the branch's copy cannot be run in place (at a URL, or importing modules beside it)
    given = any("PIPELINE.py" in command for command in commands.values())
    note = f" (PIPELINE.py: the parent's pipeline file, kept at {new}/pipeline.py)" if given else ""
    if "replay" in commands:
        return f"continue it with the parent's replay command under the branch's name{note}: {commands['replay']}"
    return (f"continue it online with the parent's run command under the branch's name{note}: {commands['online']} "
            f"(or offline over the parent's rows up to step {step}, --epochs/--steps counting from the parent's "
            f"step 0: {commands['offline']})")


def offline_command(paths: Any, lineage: dict[str, Any], parent_rows: str) -> str:
    """The ``replay`` command that continues the branch of a run with collectors at ``paths``
    offline, as ``branch`` printed it: what a refusal to continue it online names."""
    try:
        return branch_commands(paths, lineage, parent_rows)["offline"]
    except (PipelineError, ValueError, OSError):  # the parent's own command, to be completed by hand
        return shlex.join(["rlhf-pipeline", "replay", "PIPELINE.py", "--buffer", parent_rows, "--home", paths.home,
                           "--run-name", paths.name]) + " with every --set of the parent"

