"""Learner checkpoints (:class:`CheckpointManager`): a ``Progress`` record and every state a resume needs.

One file ``checkpoints/step_XXXXXXXX.pt`` per checkpoint (model, optimizer, scheduler, RNG, the buffer's
position, the sampler's state after the last draw a step used), written atomically, holding only tensors
and plain values (``torch.load(weights_only=True)``); beside it, written after it, the rewind record
``step_XXXXXXXX.json``. The manager keeps the newest ``keep_last``, every multiple of ``keep_every``,
and with ``keep_best`` the best by a held-out score, read from the checkpoints and scores on disk
whenever it is wanted, never recorded, so a ``kill -9`` at any moment leaves a best that exists.
Design: docs/learner.md#checkpoints; the best: docs/evaluation.md#the-best-checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.atomic import PARTIAL_SUFFIX, json_object
from rlhf_pipeline.files.run_store import LocalRunStore, RunStore
from rlhf_pipeline.files.state_files import load_state, load_state_bytes
from rlhf_pipeline.learn.keep_best import BestCheckpoint, EvalScores, KeepBest, NoBestCheckpoint, recorded_keep_best

FORMAT_VERSION = 2
_NAME = re.compile(r"^step_(\d{8,})\.pt$")
RECORD_FORMAT = 1


@dataclass
class Progress:
    """Where training stands; the record a resumed run continues from."""

    seed: int
    step: int = 0  # optimizer steps taken
    draws: int = 0  # batches drawn from the buffer (a batch can be dropped whole as stale)
    policy_version: int = 0  # last weights version this learner published
    rows_used: int = 0  # rows that went into a loss
    rows_dropped_stale: int = 0  # sampled rows rejected by the staleness bound
    trajectories_masked: int = 0  # sampled rows (trajectories) left out for a masked termination reason
    tokens_seen: int = 0  # response tokens that went into a loss
    buffer_next_row: int = 0  # rows published in the buffer at the last draw
    min_next_row: int = 0  # legacy: read only from checkpoints made before learner samplers

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Progress:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# ====================================================================== RNG
def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states as tensors and plain values (safe to load)."""
    import numpy as np
    import torch

    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),  # (version, tuple of ints, float or None)
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),  # uint32 words
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        np.random.set_state({
            "bit_generator": numpy_state["bit_generator"],
            "state": {"key": numpy_state["key"].numpy().astype(np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        })
    else:  # format 1: np.random.get_state()'s tuple
        np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ====================================================================== manager
class CheckpointManager:
    """Saves, finds and loads checkpoints in one directory; keeps the newest ``keep_last`` and,
    with ``keep_every`` > 0, every one whose step is a multiple of it.

    ``store``: the run's store (a run at a URL); ``directory`` is then the key prefix in it.
    ``keep_best``: also keep the best checkpoint by an evaluation metric, and every checkpoint whose version
    the evaluator has not settled yet (docs/evaluation.md#the-best-checkpoint)."""

    def __init__(self, directory: str | Path, keep_last: int = 2, *, keep_every: int = 0,
                 store: RunStore | None = None, keep_best: KeepBest | None = None) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (got {keep_last}); the newest checkpoint is always kept")
        if keep_every < 0:
            raise ValueError(f"keep_every must be >= 0 (got {keep_every}); 0 keeps no checkpoint beyond the last")
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.keep_best = keep_best
        if store is None:
            self.directory: Path | str = Path(directory)
            self._store: RunStore = LocalRunStore(directory)
            self._prefix = ""
        else:
            self._store, self._prefix = store, str(directory).strip("/")
            self.directory = store.describe(self._prefix)
        self._saved_step: int | None = None  # the step this process last saved

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}" if self._prefix else name

    def _location(self, name: str) -> Path | str:
        store = self._store
        return store.path(self._key(name)) if isinstance(store, LocalRunStore) else store.describe(self._key(name))

    def paths(self) -> list[Path | str]:
        """Complete checkpoints, oldest first (``*.partial`` leftovers are ignored): paths, or
        URLs for a run at a URL."""
        found = [(int(m.group(1)), name) for name in self._store.list(self._prefix) if (m := _NAME.match(name))]
        return [self._location(name) for _, name in sorted(found)]

    def latest(self) -> Path | str | None:
        paths = self.paths()
        return paths[-1] if paths else None

    def latest_step(self) -> int | None:
        """The step of the newest checkpoint, from its name (cheap: no file is read, no torch import)."""
        latest = self.latest()
        return int(_NAME.match(_name(latest)).group(1)) if latest is not None else None

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first (from their names)."""
        return [int(_NAME.match(_name(path)).group(1)) for path in self.paths()]

    def path_of(self, step: int) -> Path | str | None:
        """The checkpoint of ``step``, or None when it is not kept."""
        return next((path for path in self.paths() if _name(path) == _checkpoint_name(step)), None)

    def record(self, step: int) -> dict[str, Any] | None:
        """The rewind record saved beside the checkpoint of ``step`` (docs/learner.md#checkpoints); None when
        there is none (a run made before records) or it is damaged."""
        data = json_object(self._store.read(self._key(_record_name(step))))
        return data if data is not None and data.get("step") == step else None

    def damaged_record(self, step: int) -> str | None:
        """Where the rewind record of ``step`` is, when it is there but not one this library wrote
        (:meth:`record` gives None for it as for none); else None."""
        key = self._key(_record_name(step))
        return self._store.describe(key) if self._store.exists(key) and self.record(step) is None else None

    def rewind_points(self) -> list[dict[str, Any]]:
        """Each kept checkpoint's rewind record, oldest first (``{"step": N}`` alone where it has none)."""
        return [self.record(step) or {"step": step} for step in self.steps()]

    def save(self, progress: Progress, state: dict[str, Any], *,
             record: dict[str, Any] | None = None) -> Path | str:
        """Writes ``state`` plus ``progress`` atomically as the checkpoint of ``progress.step``,
        then its rewind record: ``record`` (the buffer position) plus the progress's counters."""
        import torch

        name = _checkpoint_name(progress.step)
        if progress.step == self._saved_step and not isinstance(self._store, LocalRunStore):
            # at a URL a step's checkpoint is created once: the same step saved again by this process
            # (the periodic save, then a stop's right after it) holds the same training state, and
            # would be refused as "another process wrote this version"
            return self._location(name)
        payload = dict(state, progress=progress.to_dict(), format=FORMAT_VERSION)

        def write(file) -> None:
            try:
                torch.save(payload, file)
            except RuntimeError as exc:  # torch's zip writer takes a failed write for a wrong position
                raise _os_error_under(exc) or exc

        self._store.create(self._key(name), write, partial_name=name + PARTIAL_SUFFIX)
        rewind = {"format": RECORD_FORMAT, "step": progress.step, "policy_version": progress.policy_version,
                  "draws": progress.draws, **(record or {})}
        record_name = _record_name(progress.step)
        self._store.create(self._key(record_name), json.dumps(rewind, sort_keys=True).encode(),
                           partial_name=record_name + PARTIAL_SUFFIX)
        self._saved_step = progress.step
        self.prune()
        return self._location(name)

    def prune(self) -> list[int]:
        """Deletes the checkpoints (and their records) the schedule does not keep, nor ``keep_best``
        (the best, and those still awaiting their score); returns their steps."""
        steps = self.steps()
        newest = set(steps[-self.keep_last:]) | self._held_for_best(steps)
        gone = [step for step in steps
                if step not in newest and not (self.keep_every and step % self.keep_every == 0)]
        for step in gone:
            self._store.delete(self._key(_checkpoint_name(step)))
            self._store.delete(self._key(_record_name(step)))
        return gone

    def saves_at(self, step: int) -> bool:
        """Whether the learner saves a checkpoint at ``step`` besides every ``checkpoint_every``: a rewind
        point (a multiple of ``keep_every``: asked for every 20 steps, saving only every 50 kept one in
        five) or a ``keep_best`` candidate. From the settings alone, the same on every rank."""
        return bool(self.keep_every and step % self.keep_every == 0) or self.best_candidate(step)

    def best_candidate(self, step: int) -> bool:
        """Whether the learner saves a checkpoint at ``step`` for ``keep_best``: the step published a
        version the evaluator scores. From the settings alone, the same on every rank."""
        return self.keep_best is not None and self.keep_best.candidate(step)

    def best(self) -> BestCheckpoint | None:
        """The kept checkpoint whose version scores highest on ``keep_best``'s metric (the earliest step
        among equal scores; docs/evaluation.md#the-best-checkpoint); None without ``keep_best`` or
        before any kept checkpoint's version has a score."""
        if self.keep_best is None:
            return None
        steps = self.steps()
        return self._best(self._versions(steps), self.keep_best.look())

    def _versions(self, steps: list[int]) -> dict[int, int]:
        """Step -> the policy version its checkpoint holds (from its rewind record)."""
        versions = {}
        for step in steps:
            version = (self.record(step) or {}).get("policy_version")
            versions[step] = version if isinstance(version, int) else self.keep_best.version_at(step)
        return versions

    def _best(self, versions: dict[int, int], look: EvalScores) -> BestCheckpoint | None:
        scored = [step for step, version in versions.items() if version in look.scores]
        if not scored:
            return None
        # the highest score; of equal ones, the earliest step (no more training for the same score)
        step = max(scored, key=lambda s: (look.scores[versions[s]], -s))
        return BestCheckpoint(step, versions[step], self.keep_best.metric, look.scores[versions[step]],
                              self._location(_checkpoint_name(step)))

    def held_for_best(self) -> set[int]:
        """The kept steps ``keep_best`` holds beyond the schedule (the best, and those awaiting a score)."""
        return self._held_for_best(self.steps())

    def _held_for_best(self, steps: list[int]) -> set[int]:
        """The steps ``keep_best`` holds: the best, and the candidates whose version is not settled."""
        if self.keep_best is None:
            return set()
        versions = self._versions(steps)
        look = self.keep_best.look()
        held = {step for step, version in versions.items() if self.keep_best.candidate(step)
                and version >= look.settled_below and version not in look.scores}
        best = self._best(versions, look)
        return held | ({best.step} if best is not None else set())

    def load(self, path: str | Path | None = None) -> tuple[Progress, dict[str, Any]]:
        """Loads ``path`` (default: the latest); raises ``FileNotFoundError`` when there is none."""
        path = path if path is not None else self.latest()
        if path is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        # tensors and plain values only (format 1's NumPy RNG array too); raises StateFileError
        if isinstance(self._store, LocalRunStore):
            payload = load_state(path, what="learner checkpoint", legacy_numpy_arrays=True)
        else:
            key = self._key(_name(path))
            data = self._store.read(key)
            if data is None:
                raise FileNotFoundError(self._store.describe(key))
            payload = load_state_bytes(data, what="learner checkpoint", where=self._store.describe(key),
                                       legacy_numpy_arrays=True)
        progress = Progress.from_dict(payload.pop("progress"))
        payload.pop("format", None)
        return progress, payload


def _os_error_under(exc: BaseException) -> OSError | None:
    """The OSError (a full disk: ENOSPC) that ``exc`` was raised while handling, if any.

    ``torch.save`` into a file object swallows the file's own error and fails a write later with
    ``[enforce fail at inline_container.cc] unexpected pos``; the OSError stays in the exception's
    context. Raised as it is, the atomic write names the file and the command says it in one line,
    as every other writer's full disk (``cli/run_cmd.py``)."""
    seen = exc.__cause__ or exc.__context__
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    return seen


def _checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def _record_name(step: int) -> str:
    return f"step_{step:08d}.json"


def _name(location: str | Path) -> str:
    return str(location).rstrip("/").rsplit("/", 1)[-1]


def run_checkpoints(paths: Any, keep_last: int = 2, keep_every: int = 0,
                    keep_best: KeepBest | None = None) -> CheckpointManager:
    """The checkpoints of the run at ``paths`` (a ``RunPaths``: a directory or a URL)."""
    where, store = paths.state_object(paths.checkpoints)
    return CheckpointManager(where, keep_last=keep_last, keep_every=keep_every, store=store, keep_best=keep_best)


def kept_best(paths: Any) -> tuple[KeepBest | None, BestCheckpoint | None]:
    """The run's ``learner.keep_best`` rule (None: it keeps no best) and its best checkpoint by it (None
    while no kept checkpoint's version has a score)."""
    keep_best = recorded_keep_best(paths.store)
    return keep_best, None if keep_best is None else run_checkpoints(paths, keep_best=keep_best).best()


def run_best(paths: Any, instead: str = "a step or a version") -> BestCheckpoint:
    """The best checkpoint of the run at ``paths`` (a ``RunPaths``), or :class:`NoBestCheckpoint`
    saying why there is none: the run does not keep one (``instead``: what the command takes in its
    place, e.g. ``--version N``), or no kept checkpoint has a score yet."""
    keep_best, best = kept_best(paths)
    if keep_best is None:
        raise NoBestCheckpoint(f"{paths.location} keeps no best checkpoint: it was not run with "
                               f"learner.keep_best (--set learner.keep_best=eval/<evaluation>/pass@1 with --set "
                               f"eval.every_steps=N, <evaluation> as the run's eval/metrics.jsonl spells it: held_out, "
                               f"or held_out-k4-t1 for 4 samples at temperature 1); give {instead} instead")
    if best is None:
        raise NoBestCheckpoint(f"{paths.location} has no best checkpoint yet: no kept checkpoint's policy version "
                               f"has a score of {keep_best.metric} (the evaluator scores them as the run goes; "
                               f"`rlhf-pipeline eval RUN --step N` scores a kept step)")
    return best


def buffer_rows(buffer_state: dict[str, Any] | None) -> dict[str, int]:
    """Rows published per shard in a store's ``state_dict`` (a checkpoint's ``"buffer"``): shard
    name -> next row; a single store (no shards) is ``{"": next_row}``."""
    if not buffer_state:
        return {}
    if "shards" in buffer_state:
        return {name: int(shard["next_row"]) for name, shard in buffer_state["shards"].items()}
    return {"": int(buffer_state["next_row"])}
