"""Where runs live (``$RLHF_PIPELINE_HOME`` or ``storage/`` beside the package, or a URL), and
where one run keeps each piece of its state (:class:`RunPaths`).

A run at a URL (``--home s3://bucket/prefix`` or ``az://container/prefix``) keeps every piece of its state
under that URL (:attr:`RunPaths.store`); its :attr:`RunPaths.root` is then only this machine's cache
directory (:func:`cache_dir`): TensorBoard's event files, the run-lock of processes preparing the run here.
Design: docs/pipelines.md#the-run-directory; at a URL: docs/object-storage.md#a-whole-run-at-a-url.
"""

from __future__ import annotations

import functools
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_pipeline.files.shard_names import shard_index, shard_location, shard_name

if TYPE_CHECKING:
    from rlhf_pipeline.files.run_store import RunStore

HOME_ENV_VAR = "RLHF_PIPELINE_HOME"
RUN_URL_SCHEMES = ("s3://", "az://")
"""Schemes a run may live at: every piece of state is then an object (``files/object_run_store.py``)."""


class RunLocationError(ValueError):
    """A run directory (or the home of run directories) given as a URL that cannot hold a run."""


def is_url(location: str | Path) -> bool:
    return "://" in str(location)


def resolved_location(location: str) -> str:
    """A location as runs and saved selections record it: a URL as it is, a path made absolute."""
    return location if is_url(location) else str(Path(location).resolve())


def check_run_url(location: str, what: str) -> str:
    """``location`` if it is a URL a run can live at; else :class:`RunLocationError` naming ``what``."""
    if not location.startswith(RUN_URL_SCHEMES):
        raise RunLocationError(
            f"{what} {location!r} is a URL with a scheme a run cannot live at yet: use "
            f"{' or '.join(RUN_URL_SCHEMES)} (S3 or an S3-compatible server, AWS_ENDPOINT_URL; Azure Blob Storage, "
            f"AZURE_STORAGE_CONNECTION_STRING), or a local or shared-file-system path")
    if not location.split("://", 1)[1].strip("/"):
        raise RunLocationError(f"{what} {location!r} names no bucket or container; give s3://BUCKET/PREFIX or "
                               f"az://CONTAINER/PREFIX")
    return location.rstrip("/")


def local_run_path(location: str | Path, what: str) -> Path:
    """``location`` as a path, refusing a URL: ``Path("s3://bucket/x")`` is ``s3:/bucket/x``, a
    local directory named ``s3:`` that a command would silently fill. ``what`` names the field."""
    text = str(location)
    if is_url(text):
        raise RunLocationError(
            f"{what} {text!r} is a URL, but this command reads a run directory on a file system only: give a "
            f"local or shared-file-system path")
    return Path(text)


def default_home() -> Path | str:
    """The data home: ``$RLHF_PIPELINE_HOME`` if set (a path, an ``s3://`` or ``az://`` URL), else ``<repo>/storage``.

    Only the *location* of data comes from the environment; pipeline settings never do.
    """
    override = os.environ.get(HOME_ENV_VAR)
    if override:
        if is_url(override):
            return check_run_url(override, f"${HOME_ENV_VAR}")
        return Path(override).expanduser().resolve()
    return (Path(__file__).resolve().parents[2] / "storage").resolve()


def check_run_name(run_name: str) -> str:
    """``run_name`` if it names one directory (or prefix) right under the home, else
    :class:`RunLocationError`: ``--run-name ../x`` or ``/tmp/x`` wrote its run outside the home, where
    the commands that take a run's name never look, and ``a/b`` made a run inside another's place."""
    if run_name in ("", ".", "..") or "/" in run_name or os.sep in run_name:
        raise RunLocationError(
            f"--run-name {run_name!r} is not a plain name: a run's name is one directory right under --home "
            f"(or ${HOME_ENV_VAR}); give a name without '/' and choose where with --home")
    return run_name


def _home_or_default(home: str | Path | None) -> Path | str:
    """``home`` as given, else :func:`default_home`. An empty ``--home`` (``--home "$DIR"`` with DIR
    unset) is refused: it put runs in the current directory."""
    if home is None:
        return default_home()
    if not str(home).strip():
        raise RunLocationError(f"--home is empty: give a directory or an s3:// or az:// URL, or leave it out for "
                               f"${HOME_ENV_VAR} (else storage/)")
    return home


def run_dir(run_name: str, home: str | Path | None = None) -> Path:
    """Run ``run_name``'s directory under ``home`` (default :func:`default_home`); no URL."""
    base = _home_or_default(home)
    return local_run_path(base, "--home" if home is not None else f"${HOME_ENV_VAR}") / local_run_path(
        check_run_name(run_name), "--run-name")


def run_paths(run_name: str, home: str | Path | None = None) -> RunPaths:
    """Where run ``run_name`` under ``home`` (a directory, an ``s3://`` or ``az://`` URL) keeps its state."""
    local_run_path(run_name, "--run-name")
    check_run_name(run_name)
    base = _home_or_default(home)
    if is_url(str(base)):
        url = check_run_url(str(base), "--home" if home is not None else f"${HOME_ENV_VAR}")
        return RunPaths.at_url(f"{url}/{run_name.strip('/')}")
    return RunPaths(run_dir(run_name, home).resolve())


def cache_dir(url: str) -> Path:
    """This machine's cache of the run at ``url``: ``$XDG_CACHE_HOME/rlhf_pipeline/runs/<scheme>/<path>``."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    scheme, rest = url.split("://", 1)
    return (base / "rlhf_pipeline" / "runs" / scheme / rest.strip("/")).resolve()


@functools.cache
def _object_store(url: str) -> RunStore:
    """One store per run URL per process: it remembers what this process wrote (fencing)."""
    from rlhf_pipeline.files.object_run_store import ObjectRunStore

    return ObjectRunStore(url)


# ====================================================================== run directory
@dataclass(frozen=True)
class RunPaths:
    """Where one run keeps its state; collector and learner processes meet here."""

    root: Path
    buffer_url: str | None = None
    """The buffer's URL prefix when it is not in the run directory (``Pipeline.buffer_url``):
    collector k writes ``<buffer_url>/shard-kkkk``."""
    url: str | None = None
    """The run's URL when its state lives on object storage (:meth:`at_url`); :attr:`root` is then
    this machine's cache directory, and every state object is read and written through :attr:`store`."""

    @classmethod
    def at_url(cls, url: str) -> RunPaths:
        """A run at ``url``: its buffer at ``<url>/buffer`` (unless the pipeline names another)."""
        url = check_run_url(url, "RUN")
        return cls(cache_dir(url), buffer_url=f"{url}/buffer", url=url)

    @classmethod
    def at(cls, location: str | Path) -> RunPaths:
        """A run given as a directory path or a URL (``inspect``, ``plot``, ``export-model``)."""
        if is_url(str(location)):
            return cls.at_url(str(location))
        return cls(Path(location))

    @property
    def store(self) -> RunStore:
        """Where the run's state objects are read and written (keys as below, relative to the run)."""
        if self.url is not None:
            return _object_store(self.url)
        from rlhf_pipeline.files.run_store import LocalRunStore

        return LocalRunStore(self.root)

    def key(self, path: Path) -> str:
        """The store key of ``path``, one of the paths below (``weights/policy_00000001.safetensors``)."""
        return Path(path).relative_to(self.root).as_posix()

    def state_object(self, path: Path) -> tuple[Path | str, RunStore | None]:
        """How the state modules take ``path`` (one of the paths below): ``(path, None)`` for a run
        directory, ``(key, store)`` for a run at a URL (their ``store=`` argument)."""
        if self.url is None:
            return path, None
        return self.key(path), self.store

    @property
    def location(self) -> str:
        """The run as a user names it: its URL, or its directory."""
        return self.url or str(self.root)

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
        """Where the store collector ``collector_index`` writes is made under :attr:`buffer_location`:
        ``shard-NNNN``, at an object-store URL ``<hh>-shard-NNNN`` (``files/shard_names.py``). One made
        before spread names keeps its name; ``storage.buffers.find_shard`` finds it."""
        return shard_location(self.buffer_location, collector_index)

    def shard(self, collector_index: int) -> Path:
        """The store collector ``collector_index`` writes in the run directory: ``buffer/shard-NNNN``."""
        return self.buffer / shard_name(collector_index)

    @property
    def single_store_buffer(self) -> bool:
        """True when ``buffer/`` is itself one store (a run made before shards): one collector."""
        if self.buffer_url:
            return False
        buffer = self.buffer
        if not buffer.is_dir():
            return False
        names = [p.name for p in buffer.iterdir()]
        # a shard, or one being made (shard-0000.creating): a buffer of shards
        return bool(names) and not any(shard_index(n.split(".", 1)[0]) is not None for n in names)

    def collector_state(self, collector_index: int) -> Path:
        """Collector ``collector_index``'s start as a continued branch's (``runs/branch_online.py``); a
        collector resumes from the state its shard's store published with its last append."""
        if self.single_store_buffer:
            return self.root / "collector" / "state.pt"
        return self.root / "collector" / f"shard-{collector_index:04d}.pt"

    def collector_history(self, collector_index: int) -> Path:
        """Collector ``collector_index``'s position history (``collect/position_history.py``): there
        once it wrote a round."""
        return self.collector_state(collector_index).with_suffix(".history")

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def fetched_weights(self) -> Path:
        """For a run at a URL: the objects this machine's processes fetched once and share (the
        collectors' weights, ``files/machine_cache.py``); beside ``weights/``, which ``plot`` and
        ``export-model`` mirror from the URL."""
        return self.root / "fetched" / "weights"

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

    def request_stop(self) -> None:
        """Writes ``STOP``: every collector of the run ends after its current round. Each is a new
        token, so a collector can tell a STOP written while it runs from one it found at its start."""
        self.store.write(self.key(self.stop_file), uuid.uuid4().hex.encode(), fence=False)

    def clear_stop(self) -> None:
        self.store.delete(self.key(self.stop_file))

    def stop_requested(self) -> bool:
        return self.store.exists(self.key(self.stop_file))

    def stop_token(self) -> bytes | None:
        """What ``STOP`` holds (None: there is none)."""
        return self.store.read(self.key(self.stop_file))

    @property
    def name(self) -> str:
        """The run's name: the last part of its directory or URL."""
        return self.url.rsplit("/", 1)[-1] if self.url else self.root.name

    @property
    def home(self) -> str:
        """Where the run lives (``--home``): its parent directory or URL."""
        return self.url.rsplit("/", 1)[0] if self.url else str(self.root.parent)
