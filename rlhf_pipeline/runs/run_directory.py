"""The run directory's one-time preparation, shared by ``run``, ``collect``, ``learn``, ``replay``
and the Ray driver: ``settings.json`` checked against a previous start, the pipeline file's copy,
the buffer shards, the initial policy as weights version 0. Each step is idempotent, under one file
lock (:func:`run_lock`), so processes started side by side agree on one preparation; the command
that owns the run holds the directory for its whole life (:func:`hold_run_directory`), so a second
one is refused before it changes anything. Design: docs/pipelines.md#one-command-per-run-directory.

Why one file: it is a start's one check of a run directory, from who holds it to which settings may
differ from its rows' (:func:`may_change_on_resume`: a resume and a branch's ``--set`` ask the same).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.atomic import fsync_dir, why_unwritable
from rlhf_pipeline.files.processes import pid_running, processes_with_open
from rlhf_pipeline.files.run_lease import LeaseHeldError, ObjectLease
from rlhf_pipeline.files.run_paths import HOME_ENV_VAR
from rlhf_pipeline.files.run_store import StaleWriterError
from rlhf_pipeline.files.settings_history import (
    flat_settings,
    record_resume,
    saved_settings,
    settings_in_force,
    trains_with,
)
from rlhf_pipeline.pipeline import Pipeline, PipelineError, RunPaths, settings_to_json
from rlhf_pipeline.runs.pipeline_copy import keep_pipeline_copy


class RunError(RuntimeError):
    """The run directory disagrees with the command (another run's settings, a child failed)."""


HOLDER_FILE = "run.lock"
PREPARE_LOCK_FILE = ".prepare.lock"  # run_lock's
ENDING_HOLDER_WAIT_S = 30.0  # for the lock of a holder that has ended (_lock_or_wait_for_an_ending_holder)


class RunDirectoryBusyError(RunError):
    """Another command (``run``, ``learn``, ``replay``, ``import``) holds the run directory."""


class RunHolder(AbstractContextManager):
    """The one command that owns a run directory while it runs: an exclusive ``flock`` on
    ``run.lock``, taken before the command changes anything and held until it ends.

    The kernel drops the lock when every process holding it has exited, so a holder killed with
    ``kill -9`` blocks no later start; its details in the file are only read for a refusal's
    message. Child processes that get :attr:`fd` (``pass_fds``) keep the lock alive after their
    parent dies, until they too have stopped writing. A run at a URL is held by a lease object
    instead (:class:`UrlRunHolder`).
    """

    def __init__(self, fd: int, root: Path, made: list[Path]) -> None:
        self.fd = fd
        self._root = root
        self._made = made  # the directories taking it made, the run directory first

    def release(self) -> None:
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        try:
            if self._made and {p.name for p in self._root.iterdir()} <= {HOLDER_FILE, PREPARE_LOCK_FILE}:
                # a command refused for a bad setting or input (replay's --init-from, checked while the run
                # is prepared) leaves no directory behind, as before the locks: nor a --home it made
                for name in (PREPARE_LOCK_FILE, HOLDER_FILE):
                    (self._root / name).unlink(missing_ok=True)
                for made in self._made:
                    with contextlib.suppress(OSError):  # one another command made use of meanwhile stays
                        made.rmdir()
        finally:
            os.close(fd)  # closing the last descriptor of the open file unlocks it

    def __exit__(self, *exc) -> None:
        self.release()


class UrlRunHolder(AbstractContextManager):
    """The one command that owns a run at a URL: ``run.lock`` there, a lease object
    (``files/run_lease.py``) renewed while the command runs. Its children inherit nothing: when
    the holder dies its lease runs out (or, on the same host, is taken over at once)."""

    fd = -1  # no descriptor for children to inherit

    def __init__(self, lease) -> None:
        self.lease = lease

    @property
    def lost(self) -> bool:
        """Another command took the run over (this one's lease ran out unrenewed)."""
        return self.lease.lost.is_set()

    def release(self) -> None:
        self.lease.release()

    def __exit__(self, *exc) -> None:
        self.release()


def hold_run_directory(paths: RunPaths, command: str) -> RunHolder | UrlRunHolder:
    """Takes ``paths.root`` for ``command``, or raises :class:`RunDirectoryBusyError` naming the
    holder (pid, host, command, start time) without changing anything in the directory."""
    refuse_unwritable(paths.root)  # at a URL, this machine's cache of the run
    if paths.url is not None:
        return _hold_run_url(paths, command)
    made = [d for d in (paths.root, *paths.root.parents) if not d.exists()]  # the run directory, and a new --home
    paths.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(paths.root / HOLDER_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if not _lock_or_wait_for_an_ending_holder(fd):
            holder = _describe_holder(_holder_record(fd), paths.root / HOLDER_FILE)
            raise RunDirectoryBusyError(
                f"run directory {paths.root} is in use by {holder}; wait for it to end or stop it, or choose "
                f"another --run-name (or --home)")
    except BaseException:
        os.close(fd)
        raise
    record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    return RunHolder(fd, paths.root, made)


def refuse_unwritable(root: Path) -> None:
    """Refuses a run directory that cannot be made or written in, before anything is made."""
    if (why := why_unwritable(root)) is not None:
        raise RunError(f"the run directory {root} cannot be written: {why}; choose another --home (or ${HOME_ENV_VAR}) "
                       f"or --run-name")


def _lock_or_wait_for_an_ending_holder(fd: int) -> bool:
    """Takes the lock; False if it is held. A holder that has ended on this machine leaves the lock
    only to its stopping children (re-run right after a kill -9, a killed child's last threads may
    still be exiting): they are waited for, up to ENDING_HOLDER_WAIT_S."""
    deadline = time.monotonic() + ENDING_HOLDER_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if not _holder_has_ended(_holder_record(fd)) or time.monotonic() > deadline:
                return False
        time.sleep(0.2)


def _holder_has_ended(record: Any) -> bool:
    try:
        return record["host"] == socket.gethostname() and not pid_running(int(record["pid"]))
    except (ValueError, KeyError, TypeError):
        return False


def _holder_record(fd: int, wait_s: float = 1.0) -> Any:
    """The holder's record, parsed (None: unreadable); a holder that has just taken the lock writes it a
    moment later (two commands started at once meet there), so an empty or partial record is read again
    for up to ``wait_s`` before the refusal says only that the holder is writing its details."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return json.loads(os.pread(fd, 4096, 0))
        except ValueError:
            if time.monotonic() > deadline:
                return None
        time.sleep(0.02)


def _describe_holder(record: Any, holder_file: Path) -> str:
    try:
        described = (f"`{record['command']}` (pid {record['pid']} on host {record['host']}, started "
                     f"{record['started']})")
        if _holder_has_ended(record):
            # the lock is still held, so processes it started, which inherited its descriptor, still hold it
            children = processes_with_open(holder_file)
            named = f" (pid {', '.join(map(str, children))})" if children else ""
            described += f", which has ended while its child processes{named} are still stopping"
        return described
    except (KeyError, TypeError):
        return "another command (it is writing its details)"  # between its lock and its pwrite


def _hold_run_url(paths: RunPaths, command: str) -> UrlRunHolder:
    lease = ObjectLease(paths.store, HOLDER_FILE, record={"command": command,
                                                          "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    try:
        lease.acquire()
    except LeaseHeldError as exc:
        raise RunDirectoryBusyError(
            f"run {paths.url} is in use by {exc}; wait for it to end or stop it, or choose another --run-name "
            f"(or --home). A holder on another machine that died lets go once its lease runs out") from None
    return UrlRunHolder(lease)


@contextmanager
def run_lock(paths: RunPaths):
    """Processes preparing the run on this machine, one at a time (a file lock; at a URL, in this
    machine's cache: starts on several machines meet only in create-only writes)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    with open(paths.root / PREPARE_LOCK_FILE, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # said: `collect` beside a `learn` that builds the initial policy waits its warm start
            print(f"[run] another process is preparing {paths.location} (building its initial policy, or creating "
                  f"its buffer): waiting for it", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)  # blocking: the other side is only preparing
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare_run(pipeline: Pipeline, paths: RunPaths, shards: Sequence[int] = (0,)) -> Any:
    """Creates what a run needs once; checks a resumed run uses the same settings.

    ``shards``: the collectors whose buffer shards (``buffer/shard-kkkk``) must exist. A run
    made before shards keeps its single-store ``buffer/``, which takes collector 0 only.
    Returns :func:`publish_initial_policy`'s model (None unless this call published version 0).
    """
    prepare_run_directory(pipeline, paths, shards)
    return publish_initial_policy(pipeline, paths)


def prepare_run_directory(pipeline: Pipeline, paths: RunPaths, shards: Sequence[int] = (0,), *,
                          trains: bool = True) -> None:
    """``settings.json`` (checked against a previous start; with ``trains``, a resume's changed training
    settings recorded: files/settings_history.py), the pipeline file's copy (compared with the file given,
    :mod:`rlhf_pipeline.runs.pipeline_copy`) and the buffer shards of ``shards``; no model."""
    if trains:  # before anything is written: a refused start leaves nothing that refuses the corrected one
        refuse_a_loss_the_rows_cannot_feed(pipeline)
    with run_lock(paths):
        current = settings_to_json(pipeline.settings)
        store, key = paths.store, paths.key(paths.settings_file)
        saved = saved_settings(store)
        if saved is None:
            text = json.dumps(current, indent=2, sort_keys=True).encode()
            try:
                store.create(key, text, partial_name=paths.settings_file.name + ".partial")
            except StaleWriterError:  # a start on another machine wrote it meanwhile: compare with that
                saved = saved_settings(store)
        if saved is not None:
            from rlhf_pipeline.learn.checkpoint import run_checkpoints

            resumed_from = run_checkpoints(paths).latest_step() or 0  # the checkpoint the learner trains on from
            in_force = settings_in_force(store, saved, resumed_from)
            changed = settings_changes(in_force, pipeline.settings, tag="[run]",
                                       since=f"step {resumed_from}" if resumed_from else "the run started")
            if changed:
                giving_back = sets_giving_back(in_force, changed)
                raise RunError(
                    f"run directory {paths.location} was started with other settings "
                    f"({'; '.join(changed.values())}). "
                    f"Resume with the same settings{f' ({giving_back})' if giving_back else ''}, or start a new "
                    f"run with --run-name NAME"
                )
            if trains:
                record_resume(store, saved, current, resumed_from)
        keep_pipeline_copy(pipeline, paths)
        if paths.single_store_buffer:
            extra = sorted(k for k in shards if k != 0)
            if extra:
                raise RunError(
                    f"run directory {paths.root} has a single-store buffer (made before buffer shards), "
                    f"which takes one collector; collector(s) {extra} need a new run (--run-name NAME)"
                )
        elif paths.buffer_url:
            _create_url_shards(pipeline, paths, shards)
        else:
            from rlhf_pipeline.storage.buffers import find_shard

            for index in shards:  # under the name it has (a run copied from a URL keeps its spread names)
                _create_local_shard(pipeline, Path(find_shard(paths.buffer, index)))


def refuse_a_loss_the_rows_cannot_feed(pipeline: Pipeline) -> None:
    """A KL penalty (``learner.loss.kl_coef > 0``) compares each token's log-prob with the reference's,
    which the write path stores in each row (``ref_log_probs``): a pipeline whose rows have none is
    refused by name here, not by the learner's loss at its first step, after the collectors started."""
    kl_coef = pipeline.learner.loss.kl_coef
    if kl_coef and "ref_log_probs" not in pipeline.row_fields:
        raise PipelineError(
            f"setting 'learner.loss.kl_coef' is {kl_coef:g}: a KL penalty needs reference log-probs in every row, "
            f"and this pipeline's rows have none (its row_fields: {', '.join(pipeline.row_fields)}). Set "
            f"learner.loss.kl_coef=0, or make the pipeline store them: ReferenceLogProbs in its write path and "
            f"'ref_log_probs' in its row_fields, as pipelines/qwen_math.py does")


CREATING_SUFFIX = ".creating"  # a shard being made; list_shards never takes it for one


def _create_local_shard(pipeline: Pipeline, shard: Path) -> None:
    """Creates the shard at ``shard`` unless it exists: made under another name and renamed into
    place, so a start killed midway leaves no directory that counts as a shard but holds no store
    (every later start would then fail to open it). What such a start left is removed here; the
    caller holds the run lock, so no other process is making it."""
    if shard.exists() and any(shard.iterdir()):
        return
    making = shard.with_name(shard.name + CREATING_SUFFIX)
    if making.exists():
        shutil.rmtree(making)
    making.parent.mkdir(parents=True, exist_ok=True)
    pipeline.create_buffer(making).close()
    if shard.exists():
        shard.rmdir()  # empty: os.replace cannot put a directory over a non-empty one anyway
    making.replace(shard)
    fsync_dir(shard.parent)


def publish_initial_policy(pipeline: Pipeline, paths: RunPaths) -> Any:
    """Builds the initial policy (``make_policy``: the warm start) and publishes it as weights
    version 0, unless a version exists. Under the run lock, so two processes never both build it.
    Returns the model it published (a learner in this process trains it without loading version 0
    again), else None."""
    from rlhf_pipeline.coordination.weights import latest_version, publish_weights

    with run_lock(paths):
        if latest_version(paths.store) is None:
            print(f"[run] building the initial policy in {paths.location}", file=sys.stderr, flush=True)
            try:
                model = pipeline.initial_policy()
            except Exception:
                _forget_settings_of_an_empty_run(paths)
                raise
            try:
                publish_weights(paths.store, model.state_dict(), 0)
                return model
            except (StaleWriterError, ValueError):
                # published meanwhile by a start on another machine (refused at the create, or seen
                # by publish_weights' own listing after ours): that one stands
                if latest_version(paths.store) is None:
                    raise
    return None


def _forget_settings_of_an_empty_run(paths: RunPaths) -> None:
    """Removes the ``settings.json`` of a run whose initial policy could not be built (a diverged warm start, a
    bug in ``make_policy``) when nothing was built with those settings (no policy, no checkpoint, no row), so
    the start with corrected settings is not refused as one with other settings under the same name."""
    from rlhf_pipeline.files.settings_history import HISTORY_KEY, SETTINGS_KEY
    from rlhf_pipeline.learn.checkpoint import run_checkpoints
    from rlhf_pipeline.storage import StoreError, open_buffer
    from rlhf_pipeline.storage.errors import StoreNotFoundError

    if run_checkpoints(paths).latest_step() is not None:
        return
    try:
        with open_buffer(paths.buffer_location, mode="r") as buffer:
            if len(buffer):
                return
    except StoreNotFoundError:  # no shard made yet
        pass
    except StoreError:  # a buffer that cannot be read may hold rows: the settings they were written with stay
        return
    for key in (HISTORY_KEY, SETTINGS_KEY):  # the history first: it refines the settings it names
        paths.store.delete(key)


def _create_url_shards(pipeline: Pipeline, paths: RunPaths, shards: Sequence[int]) -> None:
    """Creates the shards under ``buffer_url`` that hold no store yet (one listing of the prefix)."""
    from rlhf_pipeline.storage.buffers import list_shards, shard_location
    from rlhf_pipeline.storage.errors import LocalOnlyStoreError, StoreLockedError

    existing = {index for index, location in list_shards(paths.buffer_location) if _is_store(location)}
    for index in shards:
        if index in existing:
            continue
        try:
            store = pipeline.create_buffer(shard_location(paths.buffer_location, index))
        except (FileExistsError, StoreLockedError):
            # created since the listing by a start on another machine (a collector started beside
            # this learner may already hold its writer lock): its rows stay
            continue
        except LocalOnlyStoreError as exc:
            raise PipelineError(f"a run at a URL ({paths.url or paths.buffer_url}) keeps its buffer there, but the "
                                f"pipeline's create_buffer makes a store that lives on a file system only ({exc}). "
                                f"Make create_buffer create a Zarr store, or run with a local --home") from None
        backend = getattr(store, "backend_name", None)
        store.close()
        if backend != "zarr":
            raise PipelineError(f"setting 'buffer_url' ({paths.buffer_url}) needs Zarr buffer shards, but the "
                                f"pipeline's create_buffer made a {backend!r} store; use a Zarr buffer "
                                f"(--set buffer_backend=zarr in pipelines/default.py) or drop buffer_url")


def _is_store(location: str) -> bool:
    from rlhf_pipeline.storage import detect_backend
    from rlhf_pipeline.storage.errors import NotAStoreError

    try:
        detect_backend(location)
        return True
    except NotAStoreError:
        return False  # a prefix a killed create left without its commit record: created again


# ====================================================================== settings a start may change
# a resume (prepare_run_directory, replay) and a branch's --set (runs/branch.py) ask the same
# may_change_on_resume; settings_changes says what differs, notes what may, and returns what may not.
# Design: docs/branching.md.

# settings that may change between starts of one run; the training settings (learner.*, max_lag: recorded
# per resume, files/settings_history.py) and a section's RESUMABLE ones may too, with a note; the rest define
# the data in the buffer and must match (the buffer's writer lock does not; eval.* says what is evaluated)
_RESUMABLE_SETTINGS = {"steps", "device", "ray", "buffer_lock_wait_s", "buffer_lock_lease_s", "max_lag", "eval"}


def settings_changes(saved: dict, settings: Any, *, tag: str, since: str) -> dict[str, str]:
    """What differs between ``saved`` settings JSON and ``settings`` and may not, as ``key: was X, now Y``
    by dotted key; learner knobs and how the collector reaches its engine may change on resume (the data
    stays valid): those are printed as a note."""
    retired = _declared(settings, "REMOVED", "RENAMED")  # a setting gone or renamed since: the rows it saw stand
    saved, current, defaults = (flat_settings(d) for d in (saved, settings_to_json(settings),
                                                           _default_settings(settings)))
    changed = differences(saved, current, [
        key for key in sorted(saved.keys() | current.keys()) if not _named_by(key, retired)
        # a setting added to the pipeline since the run started, left at its default
        and not (key not in saved and key in defaults and current[key] == defaults[key])])
    allowed = {key for key in changed if may_change_on_resume(key, settings, saved.get(key), current.get(key))}
    noted = [key for key in changed if key in allowed and (key.split(".")[0] not in _RESUMABLE_SETTINGS
                                                           or trains_with(key))]
    if noted:
        print(f"{tag} note: settings changed since {since}: {'; '.join(changed[key] for key in noted)}",
              file=sys.stderr, flush=True)
    return {key: line for key, line in changed.items() if key not in allowed}


def differences(was: dict[str, Any], now: dict[str, Any], keys: Iterable[str] | None = None) -> dict[str, str]:
    """``key: was X, now Y`` (values as ``repr``) by key, for each of ``keys`` (default: every key of
    either, sorted) whose value differs between the flat settings ``was`` and ``now``."""
    keys = sorted(was.keys() | now.keys()) if keys is None else keys
    return {key: f"{key}: was {was.get(key)!r}, now {now.get(key)!r}" for key in keys if was.get(key) != now.get(key)}


def as_set_value(value: Any) -> str:
    """``value`` as ``--set`` spells it (``pipeline.parse_value`` reads it back)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(as_set_value(v) for v in value)
    return str(value)


def sets_giving_back(saved: dict, refused: Iterable[str]) -> str:
    """The ``--set`` words that give back the ``saved`` values of the dotted settings ``refused``: what a
    start refused for them adds to resume."""
    flat = flat_settings(saved)
    return " ".join(f"--set {shlex.quote(f'{key}={as_set_value(flat[key])}')}" for key in refused if key in flat)


def may_change_on_resume(key: str, settings: Any, was: Any = None, now: Any = None) -> bool:
    """Whether a start of a run (a resume, or a branch's ``--set``) may give the dotted setting ``key``
    another value (``was`` -> ``now``) than the rows so far were made with: the training settings
    (recorded: files/settings_history.py), the run settings that shape no row (steps, device, Ray,
    evaluation, lock waits), and how the collector reaches its engine (a section's ``RESUMABLE``:
    ``generation.url`` from one address to another, not to or from none, which would change the engine)."""
    if key.split(".")[0] in _RESUMABLE_SETTINGS or trains_with(key):
        return True
    return key in _declared(settings, "RESUMABLE") and (key != "generation.url" or None not in (was, now))


def _declared(settings: Any, *tables: str, prefix: str = "") -> set[str]:
    """The dotted names the settings classes of ``settings`` list in their ``tables`` (``REMOVED``,
    ``RENAMED``, ``RESUMABLE``). A renamed key is not mapped onto its new name: an old value need not mean
    one value of the new one (``rounds_ahead`` became ``max_lag``); the new name is compared from its default."""
    names = {prefix + name for table in tables for name in getattr(type(settings), table, ())}
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            names |= _declared(value, *tables, prefix=prefix + field.name + ".")
    return names


def _named_by(key: str, names: set[str]) -> bool:
    """Whether ``key`` or a section holding it is one of ``names``."""
    parts = key.split(".")
    return any(".".join(parts[:end]) in names for end in range(1, len(parts) + 1))


def _default_settings(settings: Any) -> dict:
    """The pipeline's default settings as JSON ({} when its settings class needs arguments)."""
    try:
        return settings_to_json(type(settings)())
    except TypeError:
        return {}
