"""The run's copy of its pipeline file and of the modules beside it that it imports
(``pipeline_modules/``), from which ``export-model``, ``import`` and ``show`` rebuild the run; every
start compares the file given with the copy. Design: docs/pipelines.md#the-run-directory.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import TYPE_CHECKING

from rlhf_pipeline.files.run_store import LocalRunStore, StaleWriterError
from rlhf_pipeline.pipeline import PipelineError, load_pipeline_module

if TYPE_CHECKING:
    from rlhf_pipeline.files.run_store import RunStore
    from rlhf_pipeline.pipeline import Pipeline, RunPaths

PIPELINE_KEY = "pipeline.py"
MODULES_KEY = "pipeline_modules"


def keep_pipeline_copy(pipeline: Pipeline, paths: RunPaths) -> None:
    """Copies the pipeline file and its neighbours into the run at its first start; at a later
    start compares them with the copy and updates it (nothing built from it yet) or refuses."""
    module = sys.modules.get(type(pipeline.settings).__module__)
    source = getattr(module, "__file__", None)
    if source is None:
        return
    source = Path(source).resolve()
    if paths.url is None and source == paths.pipeline_file.resolve():
        return  # started from the run's own copy
    store = paths.store
    current = pipeline_sources(source)
    kept = kept_sources(store)
    if PIPELINE_KEY not in kept:
        _write(store, current, kept, paths, first=True)
        return
    changed = _changed(current, kept)
    if not changed:
        return
    from rlhf_pipeline.coordination.weights import latest_version

    described = ", ".join(store.describe(key) for key in changed)
    if latest_version(store) is None:
        _write(store, current, kept, paths, first=False)
        print(f"[run] note: the run's copy of its pipeline file is replaced by {source} ({described} differed); "
              f"the run has published no policy, so nothing of it was built from the old copy",
              file=sys.stderr, flush=True)
        return
    copy = store.describe(PIPELINE_KEY) + (f" and {store.describe(MODULES_KEY)}/" if any(
        key.startswith(MODULES_KEY + "/") for key in current.keys() | kept.keys()) else "")
    raise PipelineError(
        f"pipeline file {source} (with the modules beside it that it imports) differs from the copy run directory "
        f"{paths.location} was started with, in {described}, and the run has published policy weights built with "
        f"it: a changed pipeline may change what the run trains, and export-model, import and show rebuild the run "
        f"from the copy. "
        f"Resume with the files as they were (the copy: {copy}), start a new run with --run-name NAME, or, to go on "
        f"with the changed files, remove {store.describe(PIPELINE_KEY)} and start again"
    )


def differs_from_copy(pipeline_file: Path, store: RunStore) -> bool:
    """Whether ``pipeline_file`` (with the modules beside it that it imports) is not the run's copy; a run
    with no copy yet has none to differ from."""
    kept = kept_sources(store)
    return PIPELINE_KEY in kept and bool(_changed(pipeline_sources(pipeline_file), kept))


def _changed(current: dict[str, bytes], kept: dict[str, bytes]) -> list[str]:
    return sorted(key for key in current.keys() | kept.keys() if current.get(key) != kept.get(key))


def pipeline_sources(pipeline_file: Path) -> dict[str, bytes]:
    """``{run key: content}`` of the pipeline file (``pipeline.py``) and of the modules beside it
    that it imports, directly or through each other (``pipeline_modules/helper.py``, and every
    ``.py`` file of a package ``pipeline_modules/tools/...``)."""
    directory = pipeline_file.parent
    found = {PIPELINE_KEY: pipeline_file.read_bytes()}
    pending, seen = [pipeline_file], set()
    distributions = None
    while pending:
        for name in sorted(_imported_names(pending.pop())):
            if name in seen or name in sys.stdlib_module_names:
                continue
            seen.add(name)
            module, package = directory / f"{name}.py", directory / name
            files = [module] if module.is_file() else (
                sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)
                if (package / "__init__.py").is_file() else [])
            if not files:
                continue
            if distributions is None:  # read only when a neighbour is there (it reads every installed package)
                from importlib.metadata import packages_distributions

                distributions = packages_distributions()
            if name in distributions:
                continue  # installed (an editable install beside the file, say): imported from there
            for file in files:
                found[f"{MODULES_KEY}/{file.relative_to(directory).as_posix()}"] = file.read_bytes()
            pending += files
    return found


def _imported_names(file: Path) -> set[str]:
    """The top-level names ``file`` imports absolutely, anywhere in it (functions included)."""
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except (SyntaxError, ValueError):
        return set()  # a neighbour that does not parse fails where it is imported, with Python's own error
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def kept_sources(store: RunStore) -> dict[str, bytes]:
    """``{run key: content}`` of the run's copy: ``pipeline.py`` and everything under ``pipeline_modules/``."""
    kept = {}
    pipeline = store.read(PIPELINE_KEY)
    if pipeline is not None:
        kept[PIPELINE_KEY] = pipeline
    for key in store.walk(MODULES_KEY):
        if not key.endswith(".py") or "/__pycache__/" in key:  # a *.partial a crash left; Python's own cache
            continue
        content = store.read(key)
        if content is not None:
            kept[key] = content
    return kept


def _write(store: RunStore, current: dict[str, bytes], kept: dict[str, bytes], paths: RunPaths, *,
           first: bool) -> None:
    # the modules first, pipeline.py last: a run whose pipeline.py is there has its modules too
    for key in sorted(kept.keys() - current.keys()):
        store.delete(key)
    for key, content in sorted(current.items()):
        if key != PIPELINE_KEY and kept.get(key) != content:
            store.write(key, content, fence=False, partial_name=PurePosixPath(key).name + ".partial")
    partial = paths.pipeline_file.name + ".partial"
    if first:
        try:
            store.create(PIPELINE_KEY, current[PIPELINE_KEY], partial_name=partial)
        except StaleWriterError:
            pass  # copied meanwhile by a start on another machine: the first copy stands
    else:
        store.write(PIPELINE_KEY, current[PIPELINE_KEY], fence=False, partial_name=partial)


def load_copy(paths: RunPaths, missing: str = "") -> ModuleType:
    """The run's pipeline module, loaded from its copy with the modules it imports put at the front of
    ``sys.path``, where they stay (a pipeline may import them lazily, in ``make_model``); a run at a
    URL's copy is written into this machine's cache of the run first. ``missing``: what a refusal
    adds when the run keeps no copy."""
    kept = kept_sources(paths.store)
    if PIPELINE_KEY not in kept:
        raise PipelineError(f"{paths.location} keeps no copy of its pipeline file{missing}")
    if paths.url is not None:
        cache = LocalRunStore(paths.root)
        for key, content in kept.items():
            cache.write(key, content, durable=False)
    modules = str(paths.root / MODULES_KEY)
    if len(kept) > 1 and modules not in sys.path:
        sys.path.insert(0, modules)
    return load_pipeline_module(paths.pipeline_file)
