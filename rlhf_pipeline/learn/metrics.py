"""Learner metrics: one JSON line per step, TensorBoard scalars, and a progress display.

:class:`MetricsWriter` writes ``metrics.jsonl`` (the source of truth; TensorBoard is a view of the same
numbers), names grouped as ``losses/`` and ``charts/`` as GRPO trainers (TRL, verl, cleanrl) show them.
A run at a URL cannot append to an object, so its lines are numbered part objects
(``metrics.jsonl.parts/00000000.jsonl``, ...), the newest re-PUT whole, fenced; :func:`read_metrics`
reads either. Design: docs/learner.md#metrics.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from typing import Any
from pathlib import Path

import torch

from rlhf_pipeline.files.atomic import naming
from rlhf_pipeline.files.log_parts import part_key, part_numbers, read_log_records
from rlhf_pipeline.files.run_store import LocalRunStore, RunStore

PART_LINES = 1000  # ~1.5 MB of learner lines: the most one re-PUT of the newest part sends
UPLOAD_EVERY_S = 5.0


# ====================================================================== writer
def _quiet_tensorboard_writer_threads() -> None:
    """TensorBoard writes events on a thread of its own, which ends on an OSError (a full disk) with
    Python's traceback of it, then hands the error to the next write or close here, which names it.
    The thread's traceback is left out: the error is said once, in one line."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__module__.startswith("tensorboard."):
            return
        previous(args)

    hook.quiets_tensorboard = True
    threading.excepthook = hook


class MetricsWriter:
    """Appends step metrics to ``metrics.jsonl`` and to TensorBoard event files.

    ``store``: the run's store when it lives at a URL; ``jsonl_path`` is then the key whose parts
    hold the lines: the newest part is re-PUT whole (fenced, so a superseded writer cannot overwrite
    it) at most every ``upload_every_s`` seconds, at every :meth:`flush` (the learner flushes before
    each checkpoint, so a resumed run never lacks the lines of steps it will not redo) and at close;
    a part that reaches ``PART_LINES`` lines is left as it is and the next one begins.
    ``tensorboard_dir`` is then a local cache directory uploaded under ``tensorboard_key`` at close.
    ``resumed_after``: the step of the checkpoint a resumed run continues from."""

    def __init__(self, jsonl_path: str | Path, tensorboard_dir: str | Path | None = None, *,
                 store: RunStore | None = None, tensorboard_key: str = "tensorboard",
                 upload_every_s: float = UPLOAD_EVERY_S, resumed_after: int | None = None) -> None:
        self._store = store
        self._file = None
        if store is None:
            self.jsonl_path = Path(jsonl_path)
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            drop_torn_line(self.jsonl_path)
            self._file = open(self.jsonl_path, "a", encoding="utf-8")
        else:
            self._parts = _Parts(store, str(jsonl_path))
            self._upload_every_s = upload_every_s
            self._uploaded_at = time.monotonic()
        self._tensorboard_dir = tensorboard_dir
        self._tensorboard_key = tensorboard_key
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run logs the steps after its checkpoint again: TensorBoard hides the earlier
            # event files' steps from there on (what truncate_metrics does for metrics.jsonl)
            purge = None if resumed_after is None else resumed_after + 1
            self._tb = SummaryWriter(log_dir=str(tensorboard_dir), purge_step=purge)
            _quiet_tensorboard_writer_threads()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({k: _plain(v) for k, v in metrics.items()})
        line = json.dumps(record) + "\n"
        if self._file is not None:
            with naming(self.jsonl_path):
                self._file.write(line)
                self._file.flush()
        else:
            self._parts.append(line)
            if time.monotonic() - self._uploaded_at >= self._upload_every_s:
                self.flush()
        if self._tb is not None:
            with naming(self._tensorboard_dir):
                self._log_tensorboard(step, record)

    def flush(self) -> None:
        """At a URL: every line logged so far is in the store when this returns."""
        if self._store is not None:
            self._parts.upload()
            self._uploaded_at = time.monotonic()

    def _log_tensorboard(self, step: int, record: Mapping[str, Any]) -> None:
        """All of a step's scalars as one event: ``add_scalar`` writes an event per scalar, and
        for the ~45 metrics of a learner step that took 6.7 ms of a ~60 ms step on the default
        pipeline, against 0.4-0.6 ms for one event (``benchmarks/bench_step_overhead.py``)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=key, simple_value=float(value)) for key, value in record.items()
                  if key not in ("step", "time") and isinstance(value, (int, float))]
        if values:
            self._tb._get_file_writer().add_summary(Summary(value=values), step)

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            with naming(self.jsonl_path):  # what a failed write left in the file's buffer is written again
                self._file.close()
        if self._store is not None:
            self.flush()
        if self._tb is not None:
            tb, self._tb = self._tb, None
            with naming(self._tensorboard_dir):
                tb.close()
            if self._store is not None:
                for event_file in sorted(Path(self._tensorboard_dir).glob("*")):
                    if event_file.is_file():
                        self._store.write(f"{self._tensorboard_key}/{event_file.name}", event_file.read_bytes(),
                                          fence=False)


class _Parts:
    """The numbered part objects of one metrics log at a URL; this writer owns the newest."""

    def __init__(self, store: RunStore, key: str) -> None:
        self.store, self.key = store, key
        numbers = part_numbers(store, key)
        self.number = numbers[-1] if numbers else 0
        existing = store.read(self._part_key()) if numbers else None
        self.lines = (existing or b"").decode("utf-8", errors="replace").splitlines(keepends=True)
        if len(self.lines) >= PART_LINES:
            self.number, self.lines = self.number + 1, []
        self.dirty = False

    def _part_key(self) -> str:
        return part_key(self.key, self.number)

    def append(self, line: str) -> None:
        self.lines.append(line)
        self.dirty = True

    def upload(self) -> None:
        if not self.dirty:
            return
        self.store.write(self._part_key(), "".join(self.lines).encode("utf-8"))
        self.dirty = False
        if len(self.lines) >= PART_LINES:
            self.number, self.lines = self.number + 1, []


def drop_torn_line(path: Path) -> None:
    """Cuts a last line that has no newline: what a process killed while writing it leaves. Appended
    to, it joined the next record into one unreadable line, losing that record as well (a collector's
    log, which no resume truncates as the learner's is)."""
    try:
        with open(path, "rb+") as log:
            end = log.seek(0, 2)
            start = end
            while start > 0:  # back to the last newline, a block at a time
                step = min(start, 1 << 16)
                log.seek(start - step)
                block = log.read(step)
                if (at := block.rfind(b"\n")) >= 0:
                    start = start - step + at + 1
                    break
                start -= step
            if start < end:
                log.truncate(start)
    except FileNotFoundError:
        return


def truncate_metrics(jsonl_path: str | Path, after_step: int, *, store: RunStore | None = None) -> None:
    """Drops lines of steps after ``after_step``: a resumed run redoes them (and writes them again).
    At a URL, parts are cut from the newest back, so a crash midway leaves lines of a prefix."""
    if store is not None:
        for number in reversed(part_numbers(store, str(jsonl_path))):
            part = part_key(str(jsonl_path), number)
            lines = (store.read(part) or b"").decode("utf-8", errors="replace").splitlines()
            kept = [line for line in lines if line.strip() and _step_of(line) <= after_step]
            if len(kept) == len([line for line in lines if line.strip()]):
                return
            if kept:
                store.write(part, "".join(line + "\n" for line in kept).encode("utf-8"))
                return
            store.delete(part)
        return
    path = Path(jsonl_path)
    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
            if line.strip() and _step_of(line) <= after_step]
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    partial.replace(path)


def read_metrics(jsonl_path: str | Path, *, store: RunStore | None = None) -> list[dict]:
    """The records of the log at ``jsonl_path``: a file, or with ``store`` its key there (parts at a URL)."""
    if store is None:
        store, jsonl_path = LocalRunStore(Path(jsonl_path).parent), Path(jsonl_path).name
    return read_log_records(store, str(jsonl_path))


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # an unreadable (torn) line is dropped


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


# ====================================================================== progress display
class ProgressDisplay:
    """A tqdm bar on a terminal; a plain line every ``log_every`` steps otherwise (logs, CI)."""

    KEYS = (("reward", "charts/reward_mean"), ("loss", "losses/loss"), ("kl", "losses/kl"),
            ("stale", "charts/staleness_mean"), ("tok/s", "charts/tokens_per_s"),
            ("wait", "charts/data_wait_s"))
    #: for a replay, whose rows were sampled by another run's policies: how far they are from ours
    OFF_POLICY_KEYS = (("reward", "charts/reward_mean"), ("loss", "losses/loss"), ("kl", "losses/kl"),
                       ("ratio", "losses/ratio_mean"), ("kl_old", "losses/approx_kl_old"),
                       ("tok/s", "charts/tokens_per_s"))

    def __init__(self, total: int, initial: int = 0, log_every: int = 10, stream=None, keys=KEYS) -> None:
        self.stream = stream or sys.stderr
        self.keys = keys
        self.log_every = max(1, log_every)
        self.total = total
        self._bar = None
        if getattr(self.stream, "isatty", lambda: False)():
            import threading

            from tqdm import tqdm

            if not hasattr(tqdm, "_lock"):
                # tqdm's default lock holds a multiprocessing RLock: a named semaphore once torchrl has
                # made "spawn" the start method. `run`'s learner ends with os._exit, so nothing unlinked
                # it and the resource tracker warned of a leaked semaphore after every run on a
                # terminal. One process draws this bar: a thread lock is all it needs.
                tqdm.set_lock(threading.RLock())
            self._bar = tqdm(total=total, initial=initial, file=self.stream, desc="learner",
                             dynamic_ncols=True)

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        shown = {short: metrics[key] for short, key in self.keys if key in metrics}
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
            self._bar.update(step - self._bar.n)
        elif step % self.log_every == 0 or step == self.total:
            parts = " ".join(f"{k}={v:.3g}" for k, v in shown.items())
            print(f"[learner] step {step}/{self.total} {parts}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
