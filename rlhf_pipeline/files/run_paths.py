"""Where runs live on disk (``$RLHF_PIPELINE_HOME`` or ``storage/`` beside the package), and
where one run keeps each piece of its state (:class:`RunPaths`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

HOME_ENV_VAR = "RLHF_PIPELINE_HOME"


class RunLocationError(ValueError):
    """A run directory (or the home of run directories) given as a URL."""


def local_run_path(location: str | Path, what: str) -> Path:
    """``location`` as a path, refusing a URL: ``Path("s3://bucket/x")`` is ``s3:/bucket/x``, a
    local directory named ``s3:`` that a run would silently fill. ``what`` names the field."""
    text = str(location)
    if "://" in text:
        raise RunLocationError(
            f"{what} {text!r} is a URL, but a run directory's state (settings, weights, checkpoints, "
            f"metrics) lives on a file system for now: give a local or shared-file-system path. Only the "
            f"buffer may live at a URL: set the pipeline's buffer_url (e.g. --set buffer_url=s3://bucket/run/buffer)")
    return Path(text)


def default_home() -> Path:
    """The data home: ``$RLHF_PIPELINE_HOME`` if set, else ``<repo>/storage``.

    Only the *location* of data comes from the environment; pipeline settings never do.
    """
    override = os.environ.get(HOME_ENV_VAR)
    if override:
        return local_run_path(override, f"${HOME_ENV_VAR}").expanduser().resolve()
    return (Path(__file__).resolve().parents[2] / "storage").resolve()


def run_dir(run_name: str, home: str | Path | None = None) -> Path:
    """Run ``run_name``'s directory under ``home`` (default :func:`default_home`); no URL."""
    return (local_run_path(home, "--home") if home is not None else default_home()) / local_run_path(run_name,
                                                                                                     "--run-name")


# ====================================================================== run directory
@dataclass(frozen=True)
class RunPaths:
    """Where one run keeps its state; collector and learner processes meet here."""

    root: Path
    buffer_url: str | None = None
    """The buffer's URL prefix when it is not in the run directory (``Pipeline.buffer_url``):
    collector k writes ``<buffer_url>/shard-kkkk``; weights, checkpoints and metrics stay here."""

    @property
    def buffer(self) -> Path:
        """The buffer directory: ``shard-NNNN/`` stores, one per collector (or, in runs made
        before shards, one store right here; see :attr:`single_store_buffer`)."""
        return self.root / "buffer"

    @property
    def buffer_location(self) -> str:
        """Where the learner reads the buffer: ``buffer_url`` when set, else :attr:`buffer`."""
        return self.buffer_url.rstrip("/") if self.buffer_url else str(self.buffer)

    def shard_location(self, collector_index: int) -> str:
        """The store collector ``collector_index`` writes: ``shard-NNNN`` under :attr:`buffer_location`."""
        if self.buffer_url:
            if collector_index < 0:
                raise ValueError(f"collector index must be >= 0, got {collector_index}")
            return f"{self.buffer_location}/shard-{collector_index:04d}"
        return str(self.shard(collector_index))

    def shard(self, collector_index: int) -> Path:
        """The store collector ``collector_index`` writes: ``buffer/shard-NNNN``."""
        if collector_index < 0:
            raise ValueError(f"collector index must be >= 0, got {collector_index}")
        return self.buffer / f"shard-{collector_index:04d}"

    @property
    def single_store_buffer(self) -> bool:
        """True when ``buffer/`` is itself one store (a run made before shards): one collector."""
        if self.buffer_url:
            return False
        buffer = self.buffer
        if not buffer.is_dir():
            return False
        names = [p.name for p in buffer.iterdir()]
        return bool(names) and not any(n.startswith("shard-") for n in names)

    def collector_state(self, collector_index: int) -> Path:
        """Collector ``collector_index``'s position (prompt order, id counters, sampling RNG)."""
        if self.single_store_buffer:
            return self.root / "collector" / "state.pt"
        return self.root / "collector" / f"shard-{collector_index:04d}.pt"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def settings_file(self) -> Path:
        return self.root / "settings.json"

    @property
    def pacing(self) -> Path:
        """What the learner has taken in, rewritten after every batch; collectors pace by it
        (``rlhf_pipeline/coordination/pacing.py``)."""
        return self.root / "pacing.json"

    def collector_metrics(self, collector_index: int) -> Path:
        """Collector ``collector_index``'s metrics: one JSON line per round."""
        return self.root / "collector" / f"metrics-{collector_index:04d}.jsonl"

    @property
    def pipeline_file(self) -> Path:
        """A copy of the pipeline file the run was started with (with ``settings.json``, what
        ``export-model`` and ``import`` rebuild the run's model and tokenizer from)."""
        return self.root / "pipeline.py"

    @property
    def stop_file(self) -> Path:
        """Written by ``run`` when the learner is done: a standalone collector stops too."""
        return self.root / "STOP"
