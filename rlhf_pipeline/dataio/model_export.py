"""``export-model``: a run's policy of one version as a ``save_pretrained`` directory.

A version comes from ``weights/`` or from the checkpoint of the step that published it
(:func:`available_versions`), in a run directory or, through its store, a run at a URL. The pipeline's ``make_model()`` with those weights and its tokenizer
are saved so that ``from_pretrained(OUT)`` computes the same logits; ``rlhf_pipeline_export.json``
says where they came from. Nothing in the run directory runs code. Design: docs/architecture.md#rows-in-and-out.
A LoRA run's version is exported merged into its base (version 0), or with ``--adapter`` as the adapter
alone (:func:`export_adapter`; docs/lora.md).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_pipeline.files.run_paths import is_url, local_run_path
from rlhf_pipeline.files.settings_history import saved_settings
from rlhf_pipeline.pipeline import PipelineError, RunPaths

if TYPE_CHECKING:
    import torch


class VersionNotFoundError(LookupError):
    """The version asked for is not on disk; the message lists the ones that are."""


class RunNotFoundError(FileNotFoundError):
    """The path given as a run does not exist or is not a run directory."""


@dataclass(frozen=True)
class VersionSource:
    version: int
    path: Path | str
    """Where it is: a file, or an object's URL."""
    kind: str  # "weights" or "checkpoint"
    run: RunPaths
    """The run whose store it is read through."""

    def describe(self) -> str:
        return f"v{self.version} ({self.kind} {str(self.path).rstrip('/').rsplit('/', 1)[-1]})"


@dataclass
class ExportedModel:
    out: str
    version: int
    source: str
    model_class: str


def available_versions(run_root: str | Path | RunPaths) -> dict[int, VersionSource]:
    """Policy versions whose weights are kept: published weights, and checkpoints that hold one (the
    published file where both do). ``run_root``: a run directory or a run's URL, read through its store,
    or the :func:`run_at` of one."""
    from rlhf_pipeline.coordination.weights import WEIGHTS, published_objects
    from rlhf_pipeline.learn.checkpoint import run_checkpoints

    paths = run_root if isinstance(run_root, RunPaths) else run_at(run_root)
    found: dict[int, VersionSource] = {}
    publish_every = _publish_every(paths)
    checkpoints = run_checkpoints(paths)
    for step in checkpoints.steps():
        path = checkpoints.path_of(step)
        # the rewind record beside it (a few bytes); in a directory, where a run made before records has
        # none, the checkpoint's own progress
        version = (checkpoints.record(step) or {}).get("policy_version")
        if version is None and paths.url is None:
            version = (_checkpoint_progress(Path(path)) or {}).get("policy_version")
        if publish_every and step % publish_every == 0 and isinstance(version, int):
            found[version] = VersionSource(version, path, "checkpoint", paths)
    for version, name in published_objects(paths.store).items():
        found[version] = VersionSource(version, paths.store.describe(f"{WEIGHTS}/{name}"), "weights", paths)
    return dict(sorted(found.items()))


def run_at(run_root: str | Path) -> RunPaths:
    """The run at ``run_root`` (a directory or a URL), or :class:`RunNotFoundError` saying why it is none."""
    if is_url(str(run_root)):
        paths = RunPaths.at_url(str(run_root))
        where = f"{paths.url} holds no run (no settings.json, weights or checkpoints): give the URL a run was " \
                f"started at, --home URL plus its --run-name"
    else:
        paths = RunPaths(local_run_path(run_root, "RUN").resolve())
        if not paths.root.is_dir():
            raise RunNotFoundError(f"{paths.root} does not exist" if not paths.root.exists()
                                   else f"{paths.root} is not a directory; give a run directory")
        where = f"{paths.root} is not a run directory (it has no settings.json, weights/ or checkpoints/); give " \
                f"the directory a run wrote, e.g. storage/<run-name>"
    store = paths.store
    if not store.exists(paths.key(paths.settings_file)) and not store.list("checkpoints") \
            and not store.list("weights"):
        raise RunNotFoundError(where)
    return paths


class _Inert:
    """Stands for every object named in a checkpoint: built from anything, does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _ProgressReader(pickle.Unpickler):
    # Every class or function the pickle names (tensor rebuilders, storages, and whatever a
    # planted file names) becomes _Inert, so no code of the file's choosing runs; the progress
    # record is a plain dict of ints, which pickle builds without naming anything.
    def find_class(self, module: str, name: str) -> type:
        return _Inert

    def persistent_load(self, pid: Any) -> None:
        return None  # tensor storages: not read


def _checkpoint_progress(path: Path) -> dict[str, int] | None:
    """``{"step", "policy_version"}`` of a checkpoint, without torch and without reading its tensors
    (a real model's checkpoint is gigabytes); None when the file is not a readable checkpoint."""
    try:
        with zipfile.ZipFile(path) as archive:
            record = next(n for n in archive.namelist() if n.count("/") == 1 and n.endswith("/data.pkl"))
            with archive.open(record) as pickled:
                progress = _ProgressReader(pickled).load()["progress"]
        return {"step": int(progress["step"]), "policy_version": int(progress["policy_version"])}
    except (OSError, zipfile.BadZipFile, StopIteration, pickle.UnpicklingError, EOFError, KeyError,
            TypeError, ValueError, AttributeError, IndexError):
        return None


def _publish_every(paths: RunPaths) -> int | None:
    try:
        settings = saved_settings(paths.store)  # damaged: a StateFileError, a ValueError
        return int(settings["learner"]["publish_every"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # without it a checkpoint cannot be matched to a version


def load_version(run_root: str | Path, version: int | None = None) -> tuple[dict[str, torch.Tensor], VersionSource]:
    """The policy weights of ``version`` (default: the newest on disk)."""
    versions = available_versions(run_root)
    if not versions:
        raise VersionNotFoundError(f"{run_root} holds no policy weights (weights/ and checkpoints/ are empty)")
    if version is None:
        version = max(versions)
    if version not in versions:
        listed = ", ".join(v.describe() for v in versions.values())
        if version < 0:
            reason = "does not exist: versions count from 0"
        elif version > max(versions):
            # versions only increase and the newest is always kept, so a larger one was never published
            reason = f"of {run_root} does not exist: the newest is v{max(versions)}"
        else:
            reason = (f"of {run_root} is no longer on disk (weights/ keeps the last few, checkpoints/ the "
                      f"last N)")
        raise VersionNotFoundError(f"policy version {version} {reason}; available: {listed}")
    source = versions[version]
    return version_state(source), source


def version_state(source: VersionSource) -> dict[str, torch.Tensor]:
    """The policy weights of ``source`` (one of :func:`available_versions`); a LoRA run's version
    merged into its base, version 0."""
    from rlhf_pipeline.models.lora import PolicyAdapter, merged_state

    published = _published(source)
    if isinstance(published, PolicyAdapter):
        from rlhf_pipeline.coordination.weights import load_weights

        return merged_state(load_weights(source.run.store, 0)[0], published)
    return published


def _published(source: VersionSource) -> dict[str, torch.Tensor]:
    """The version's state as the run keeps it: whole weights, or (a LoRA run) a ``PolicyAdapter``."""
    if source.kind == "weights":
        from rlhf_pipeline.coordination.weights import load_published

        return load_published(source.run.store, source.version)[0]
    from rlhf_pipeline.learn.checkpoint import run_checkpoints
    from rlhf_pipeline.models.lora import PolicyAdapter

    checkpoint = run_checkpoints(source.run).load(source.path)[1]  # raises StateFileError

    lora = checkpoint.get("lora")
    if lora is None:
        return checkpoint["model"]
    return PolicyAdapter(checkpoint["model"], config=lora["adapter_config"], base_digest=lora["base_digest"])


def export_adapter(run_root: str | Path, out: str | Path, *, version: int | None = None) -> ExportedModel:
    """Writes the adapter of a LoRA run's ``version`` alone to ``out``: ``adapter_model.safetensors`` and
    ``adapter_config.json``, what ``PeftModel.from_pretrained(base, OUT)`` and vLLM's LoRA requests read
    (the base is the run's version 0: ``export-model RUN BASE --version 0``)."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose another path or remove it")
    versions = available_versions(run_root)
    chosen = max(versions) if version is None and versions else version
    if chosen not in versions:
        load_version(run_root, version)  # raises, listing the versions on disk
    from rlhf_pipeline.models.lora import PolicyAdapter

    source = versions[chosen]
    adapter = _published(source)
    if not isinstance(adapter, PolicyAdapter):
        raise VersionNotFoundError(f"policy version {chosen} of {run_root} is whole weights, not an adapter (a full "
                                   f"fine-tuning run, or a LoRA run's base, version 0): export it without --adapter")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        adapter.save_peft_directory(partial)
        info = {"run": _run_named(run_root), "version": chosen, "from": str(source.path),
                "model_class": "LoRA adapter", "base": "version 0 of the run"}
        (partial / "rlhf_pipeline_export.json").write_text(json.dumps(info, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.replace(partial, out)
    return ExportedModel(str(out), chosen, str(source.path), "LoRA adapter")


def export_model(run_root: str | Path, out: str | Path, *, version: int | None = None,
                 pipeline_path: str | Path | None = None) -> ExportedModel:
    """Writes the run's policy of ``version`` to ``out`` (see the module docstring)."""
    from rlhf_pipeline.dataio.run_pipeline import load_run_pipeline

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose another path or remove it")
    state, source = load_version(run_root, version)
    pipeline = load_run_pipeline(run_root, pipeline_path, device="cpu")
    if pipeline.tokenizer is None:
        raise PipelineError("the run's pipeline sets no `tokenizer`, so the export would lack one; set "
                            "Pipeline(tokenizer=...) in its build()")
    model = pipeline.make_model()
    model.load_state_dict(state)
    model.eval()
    # from_pretrained picks its own default attention unless the config names one, and eager vs
    # sdpa differ in the last bits of the logits
    model.config.attn_implementation = model.config._attn_implementation
    generation = model.generation_config
    tokenizer = pipeline.tokenizer
    generation.do_sample = True
    generation.temperature = float(pipeline.learner.temperature)
    if tokenizer.eos_token_id is not None:
        generation.eos_token_id = tokenizer.eos_token_id
    if tokenizer.pad_token_id is not None:
        generation.pad_token_id = tokenizer.pad_token_id

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    from rlhf_pipeline.models.loading import transformers_bars_off

    try:
        with transformers_bars_off():  # the command prints where it wrote; a bar for one shard is noise
            model.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
        info = {"run": _run_named(run_root), "version": source.version, "from": str(source.path),
                "model_class": type(model).__name__}
        record = partial / "rlhf_pipeline_export.json"
        record.write_text(json.dumps(info, indent=2) + "\n")
        _readable_as_the_rest(partial, record.stat().st_mode & 0o777)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.replace(partial, out)
    return ExportedModel(str(out), source.version, str(source.path), type(model).__name__)


def _run_named(run_root: str | Path) -> str:
    return str(run_root) if is_url(str(run_root)) else str(Path(run_root).resolve())


def _readable_as_the_rest(directory: Path, mode: int) -> None:
    """Gives every file the mode of a file written plainly here (the user's umask applied):
    ``save_pretrained`` writes the weights through a private temporary file (0600), which
    would leave the model unreadable to the others who can read its config."""
    for file in directory.rglob("*"):
        if file.is_file() and file.stat().st_mode & 0o777 != mode:
            file.chmod(mode)
