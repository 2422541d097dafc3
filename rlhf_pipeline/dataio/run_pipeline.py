"""Rebuilding a run's pipeline: its model architecture and tokenizer, as the run was configured.

A run directory keeps ``settings.json`` (the settings of its first start) and ``pipeline.py`` with the
modules beside it that it imports (``pipeline_modules/``: ``rlhf_pipeline/runs/pipeline_copy.py``).
:func:`load_run_pipeline` loads that file (or another one given), applies the saved settings and calls
its ``build``, so ``export-model`` and ``import`` get the same ``make_model`` and ``tokenizer`` the run
used. A run at a URL is read through its store; its pipeline file is loaded from this machine's cache.
Design: docs/pipelines.md#the-run-directory.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.run_paths import is_url
from rlhf_pipeline.files.settings_history import saved_settings
from rlhf_pipeline.files.shard_names import shard_index
from rlhf_pipeline.pipeline import Pipeline, PipelineError, RunPaths, load_pipeline_module


def find_run(location: str | Path) -> RunPaths | None:
    """The run ``location`` is or belongs to (``<run>``, ``<run>/buffer``, ``<run>/buffer/<shard>``), a
    directory or a URL, recognised by its ``settings.json`` and published weights; None for anything
    else. A URL whose scheme no run can live at raises ``RunLocationError``."""
    where = str(location).rstrip("/") if is_url(str(location)) else str(Path(location).resolve())
    parts = where.split("/")
    candidates = [where]
    if parts[-1] == "buffer":
        candidates.append("/".join(parts[:-1]))
    elif shard_index(parts[-1]) is not None and len(parts) > 2 and parts[-2] == "buffer":
        candidates.append("/".join(parts[:-2]))
    for candidate in candidates:
        if not candidate.split("://", 1)[-1].strip("/"):  # a bucket's or the file system's top holds no run
            continue
        paths = RunPaths.at(candidate)
        if paths.store.exists("settings.json") and paths.store.list("weights"):
            return paths
    return None


def load_run_pipeline(run_root: str | Path | RunPaths, pipeline_path: str | Path | None = None, *,
                      device: str | None = None) -> Pipeline:
    """The run's pipeline built with the run's settings (``device`` may differ: it only says where
    models run). ``pipeline_path`` stands for the run's copy of its pipeline file where the run keeps
    none (runs started before copies were kept), and must be that copy where it keeps one: another
    file's model, tokenizer and write path would export the run's weights under another tokenizer, or
    shape rows the run trains on. ``run_root``: a directory, a run's URL or its :class:`RunPaths`."""
    from rlhf_pipeline.runs.pipeline_copy import PIPELINE_KEY, differs_from_copy, load_copy
    from rlhf_pipeline.runs.processes import build_pipeline

    paths = run_root if isinstance(run_root, RunPaths) else RunPaths.at(
        run_root if is_url(str(run_root)) else Path(run_root).resolve())
    store = paths.store
    saved = saved_settings(store)
    if saved is None:
        raise PipelineError(f"{paths.location} is not a run directory: it has no settings.json")
    if pipeline_path is not None and differs_from_copy(Path(pipeline_path), store):
        raise PipelineError(f"--pipeline {pipeline_path} differs from the copy run {paths.location} was started with "
                            f"({store.describe(PIPELINE_KEY)}), which rebuilds its model, tokenizer and write path: "
                            f"drop --pipeline (it stands for the copy of a run that keeps none)")
    try:
        module = load_pipeline_module(pipeline_path) if pipeline_path is not None else load_copy(
            paths, missing=" (runs started before this was recorded); pass --pipeline PIPELINE.py, the file the run "
                           "was started with")
        settings = settings_from_json(module, saved)
        if device is not None:
            settings = dataclasses.replace(settings, device=device)
        return build_pipeline(module, settings, paths)
    except (ModuleNotFoundError, PipelineError) as exc:
        # the copy's own imports (loading it) or its build()'s
        missing = exc if isinstance(exc, ModuleNotFoundError) else exc.__cause__
        if pipeline_path is not None or not isinstance(missing, ModuleNotFoundError) or missing.name is None:
            raise
        raise PipelineError(
            f"the run's copy of its pipeline file ({paths.store.describe(paths.key(paths.pipeline_file))}) imports "
            f"{missing.name!r}, which is neither installed here nor kept by the run (runs started before runs kept the "
            f"modules beside the pipeline file have only pipeline.py): install it, or pass --pipeline PIPELINE.py, "
            f"the file the run was started with") from None


def settings_from_json(module: types.ModuleType, data: dict) -> Any:
    """The pipeline's ``Settings`` with the values of ``settings.json`` (the inverse of
    ``settings_to_json``); settings added to the pipeline since keep their defaults."""
    try:
        defaults = module.Settings()
    except TypeError as exc:
        raise PipelineError(f"every field of Settings needs a default ({exc})") from None
    unknown: list[str] = []
    settings = _apply(defaults, data, "", unknown)
    if unknown:
        print(f"[pipeline] note: settings.json has settings this pipeline file lacks (ignored): {', '.join(unknown)}",
              file=sys.stderr, flush=True)
    return settings


def _apply(obj: Any, data: dict, prefix: str, unknown: list[str]) -> Any:
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    unknown += [prefix + k for k in data if k not in names]
    changes = {}
    for f in dataclasses.fields(obj):
        if f.name not in data:
            continue
        current, value = getattr(obj, f.name), data[f.name]
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            changes[f.name] = _apply(current, value, prefix + f.name + ".", unknown)
        else:
            changes[f.name] = _coerce(hints[f.name], value)
    try:
        return dataclasses.replace(obj, **changes)
    except (TypeError, ValueError) as exc:
        raise PipelineError(f"settings.json does not fit this pipeline's Settings: {exc}") from None


def _coerce(annotation: Any, value: Any) -> Any:
    """A JSON value back in the annotated type (JSON keeps Paths as strings, tuples as lists)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        if Path in args and isinstance(value, str):
            return Path(value)
        tuple_arg = next((a for a in args if typing.get_origin(a) is tuple or a is tuple), None)
        if tuple_arg is not None and isinstance(value, list):
            return _coerce(tuple_arg, value)
        return value
    if annotation is Path:
        return Path(value)
    if (origin is tuple or annotation is tuple) and isinstance(value, list):
        item = args[0] if args and args[-1] is Ellipsis else None
        return tuple(_coerce(item, v) if item is not None else v for v in value)
    return value
