"""What a pipeline file is, how it is loaded by path, and how ``--set`` edits its settings.

Why one file: the three change together; they are the contract between a user's pipeline file and
the framework (the run's settings themselves: ``run_settings.py``). A pipeline file (copy
``pipelines/default.py``) defines ``Settings``, a ``@dataclass`` subclassing ``RunSettings``, with a default
and a docstring below every field it adds and its own rules in ``validate``; ``build(settings, run) ->
Pipeline``, the task's parts, starting no long work (models are built only when a part is called); and
optionally ``check(settings)``, torch-free checks of what the settings point at, run before any process.
Settings come from the defaults and the command line only, never from environment variables.
Design: docs/pipelines.md#writing-a-pipeline-file.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import inspect
import sys
import textwrap
import traceback
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rlhf_pipeline.files.run_paths import RunPaths  # noqa: F401 -- pipeline files import it from here
from rlhf_pipeline.setting_checks import (choice_error, field_bounds, finite_error, fixed_length, literal_choices,
                                          not_finite)
from rlhf_pipeline.run_settings import RunSettings

if typing.TYPE_CHECKING:
    from rlhf_pipeline.evaluation.sets import EvalSet


class PipelineError(ValueError):
    """Bad pipeline file or settings; the message names the field and the fix."""


# ====================================================================== the contract
class CollectorLike(Protocol):
    """Everything ``rlhf-pipeline collect`` (``runs/processes.py``, ``collect_main``) calls of the collector
    a pipeline makes (``rlhf_pipeline.collect.Collector``): its sink publishes each append's rows with the
    state after them (``make_replay_buffer(store, ...).extend``), which ``load_state_dict`` takes back on
    restart."""

    config: Any  # its ``collector_index`` names the ids it writes
    engine: Any  # a GenerationEngine: its ``stats``, ``name`` and ``retries`` are said on the console
    runner_state: dict[str, Any]  # the runner's own state, published with the collector's
    last_metrics: dict[str, float]  # the last round's
    batches_emitted: int  # rounds written, counted on across restarts
    sink: Any  # ``sink(rows | None, *, writer_state=...)``: the runner wraps it to keep a branch's restart points

    def collect(self, next_round: Callable[[int], bool] | None = None) -> Any: ...  # one round

    @property
    def round_rows(self) -> int: ...  # rows a round writes (an estimate for agents)

    @property
    def policy_version(self) -> int: ...

    @property
    def continues_a_round(self) -> bool: ...  # started ahead, or written in part before a stop: no new weights

    def set_policy_state(self, state_dict: dict, version: int) -> None: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclass
class Pipeline:
    """What ``build`` returns: the task's parts, which ``run`` / ``collect`` / ``learn`` wire together
    with what the run's settings say (the buffer, the engine, the learner's settings).

    Every callable is cheap to hold and does its work only when called, so a ``Pipeline``
    can be built in the parent process just to check settings.
    """

    settings: RunSettings
    """The pipeline's ``Settings``: the run's and the task's."""
    make_policy: Callable[[], Any]
    """Builds the initial policy (warm start included); run once per run, published as v0. The
    learner that published it trains this very object, so it must be what ``make_model`` builds
    (architecture, dtype) with the warm start's weights in it."""
    make_model: Callable[[], Any]
    """Builds the model architecture only (random init); weights are loaded into it."""
    tokenizer: Any
    """The policy's tokenizer (a ``transformers`` tokenizer, with its chat template): its pad and end
    tokens, what ``import`` tokenizes text with and what ``export-model`` saves beside the weights."""
    collector: Callable[..., CollectorLike]
    """``collector(engine, sink, store, collector_index)`` -> the task's collector, sampling with the
    engine the run's ``generation`` settings name and writing rows with ``sink`` (the write path into
    ``store``, whose schema says which fields it holds). It passes ``collector_index`` on
    (``CollectorConfig(collector_index=...)``) so ids stay unique across shards; it is closed when
    collection ends."""
    make_write_path: Callable[[Any], Sequence[Any]] | None = None
    """``make_write_path(writable_store)`` -> the write-path transforms bound to that store, in
    write order (group advantage, reference log-probs, KL reward...). Collected and imported rows
    go through it alike. None: rows are stored as they come."""
    row_fields: tuple[str, ...] = ("advantage",)
    """The optional row fields the buffer stores (``schema.StoreSchema(optional=...)``): what the
    write path adds (``advantage``) and the task's own (an agent's ``step_advantage``...)."""
    sampler_dtype: str | None = None
    """The dtype the collector's copy of the policy samples in (``bfloat16``); None: as built."""
    preflight: Callable[[], None] = lambda: None
    """Cheap checks that need code to run (the reward on one sample); called before any work."""
    eval_sets: Callable[[], Sequence[EvalSet]] | None = None
    """``eval_sets()`` -> the task's named held-out sets (``rlhf_pipeline.evaluation.sets.EvalSet``:
    prompts or tasks drawn apart from the training ones, and the scorer of each), which ``eval.*``
    and ``rlhf-pipeline eval`` evaluate published versions on. None: the task has none."""
    learner: Any = field(init=False)
    """The learner's settings, derived once from the run's (``RunSettings.learner_settings``)."""

    def __post_init__(self) -> None:
        self.learner = self.settings.learner_settings()

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    def create_buffer(self, location: Path | str) -> Any:
        """Creates the (empty) replay buffer shard at ``location`` (a path, or a URL under
        ``buffer_url``) and returns the open, writable store."""
        from rlhf_pipeline.schema import StoreSchema
        from rlhf_pipeline.storage import create_store

        return create_store(location, self.settings.buffer_backend, schema=StoreSchema(optional=self.row_fields),
                            segment_rows=self.settings.segment_rows)

    def initial_policy(self) -> Any:
        """``make_policy()``, refused when one of its weights is not finite (a warm start that diverged):
        never published as version 0, trained or scored with, where every collector would die sampling
        from it and a learner would refuse its first step blaming ``learner.lr``. So is one that a LoRA
        run's ``learner.lora.target_modules`` do not fit, before anything is published."""
        import torch

        model = self.make_policy()
        if self.learner.lora.enabled:
            from rlhf_pipeline.models.lora import check_target_modules

            try:
                check_target_modules(model, self.learner.lora.target_modules)
            except ValueError as exc:
                raise PipelineError(f"{exc}; nothing was published or trained") from None
        # values, not a norm: a half-precision model's norm may overflow where no value does
        found = next((name for name, value in model.state_dict().items()
                      if value.is_floating_point() and not bool(torch.isfinite(value).all())), None)
        if found is not None:
            raise PipelineError(
                f"the initial policy the pipeline's make_policy() built is not finite ({found!r} holds nan or "
                f"inf): nothing was published or trained. A warm start with too high a learning rate does "
                f"this (pipelines/default.py: warm_start_lr). Fix make_policy or its settings and start again: a run "
                f"that holds nothing built yet keeps no settings of this start, so the same --run-name takes the "
                f"corrected ones")
        return model

    def make_collector(self, model: Any, store: Any, collector_index: int = 0) -> CollectorLike:
        """Collector ``collector_index`` writing to ``store`` through the write path, sampling with the
        engine ``settings.generation`` names, started from ``model``'s weights. An engine that cannot
        serve this run is one PipelineError, before any row."""
        from rlhf_pipeline.generation.engine import EngineFailed, EngineStopped
        from rlhf_pipeline.generation.settings import make_engine
        from rlhf_pipeline.storage import make_replay_buffer

        settings = self.settings
        write_path = self.make_write_path(store) if self.make_write_path is not None else ()
        buffer = make_replay_buffer(store, batch_size=self.learner.batch_size, transforms=write_path)
        if self.sampler_dtype is not None:
            import torch

            model = model.to(dtype=getattr(torch, self.sampler_dtype))
        model = model.to(settings.device)
        adapters = None
        if self.learner.lora.enabled and settings.generation.chosen_engine != "loop":
            from rlhf_pipeline.generation.vllm_adapters import AdapterServing

            adapters = AdapterServing.of(self.learner.lora, self.learner.max_staleness)
        try:  # the loop samples with this model; a vLLM engine or a server at generation.url starts from its weights
            engine = make_engine(settings.generation, model, pad_token_id=self.tokenizer.pad_token_id,
                                 stop_token_ids=[self.tokenizer.eos_token_id], device=settings.device,
                                 seed=settings.seed, tokenizer=self.tokenizer, adapters=adapters)
        except EngineStopped:  # its process is stopping: no fault of the engine's
            raise
        except (ValueError, EngineFailed) as exc:  # one that cannot serve this run: one line, no rows
            raise PipelineError(str(exc)) from None
        return self.collector(engine=engine, sink=buffer.extend, store=store, collector_index=collector_index)


def preflight_rewards(rewards: Any, records: Sequence[Any], group_size: int) -> None:
    """Scores ``group_size`` placeholder completions of the first prompt with every reward.

    Catches, before any model is built, a reward that returns the wrong number of values,
    non-numbers, or needs a prompt field the records lack.
    """
    from rlhf_pipeline.collect.rewards import as_rewards, score

    record = records[0]
    prompt = record.text if record.text is not None else str(record.messages)
    fields = {k: [v] * group_size for k, v in record.fields.items()}
    score(as_rewards(rewards), [prompt] * group_size, ["0"] * group_size, fields)


# ====================================================================== loading
# modules of ours that moved, and where their names live now: a pipeline file that imports the old one
# is refused naming the new place
MOVED_MODULES = {
    "rlhf_pipeline.collate": "rlhf_pipeline.schema.padding",
    "rlhf_pipeline.ray_settings": "rlhf_pipeline.run_settings (RaySettings; a pipeline's RunSettings has them)",
    "rlhf_pipeline.cluster.settings": "rlhf_pipeline.run_settings (RaySettings; a pipeline's RunSettings has them)",
    "rlhf_pipeline.collect.generate": "rlhf_pipeline.generation (loop.py, sampling.py)",
    "rlhf_pipeline.finite_settings": "rlhf_pipeline.setting_checks (check_fields, Bounds)",
}


def load_pipeline_module(path: str | Path) -> types.ModuleType:
    """Imports a pipeline file by path and checks that it defines ``Settings`` and ``build``."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"pipeline file {str(path)!r} does not exist; pass a path such as pipelines/default.py")
    # a name derived from the path keeps two pipelines in one process apart
    module_name = f"rlhf_pipeline_user_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise PipelineError(f"{path} is not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve string annotations through sys.modules
    sys.modules[module_name] = module
    # modules beside the file import (also later, in build()); last on the path, so nothing there hides
    # an installed module and a run's kept copies of them (put first by runs/pipeline_copy.py) win
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:  # the file's own mistake: where it is, not the import machinery's frames
        sys.modules.pop(module_name, None)
        raise PipelineError(_describe_syntax_error(exc, path)) from None
    except Exception as exc:
        sys.modules.pop(module_name, None)
        if isinstance(exc, ModuleNotFoundError) and exc.name in MOVED_MODULES:  # written before a move
            raise PipelineError(f"{path} imports {exc.name}, which moved: import from {MOVED_MODULES[exc.name]} "
                                f"instead") from None
        raise PipelineError(_describe_load_error(exc, path)) from exc
    settings_cls = getattr(module, "Settings", None)
    if settings_cls is None or not dataclasses.is_dataclass(settings_cls) or not issubclass(settings_cls, RunSettings):
        raise PipelineError(f"{path} must define `Settings`, a @dataclass subclassing "
                            f"rlhf_pipeline.run_settings.RunSettings (the run's settings) with its task's own")
    if not callable(getattr(module, "build", None)):
        raise PipelineError(f"{path} must define `build(settings, run) -> Pipeline`")
    return module


def _describe_load_error(exc: Exception, path: Path) -> str:
    """``path:LINE: ModuleNotFoundError: ...``: the line of the pipeline file that raised while it was
    loaded, and where the error came from when that is deeper (a module it imports)."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [frame for frame in frames if Path(frame.filename).resolve() == path.resolve()]
    where = f"{path}:{own[-1].lineno}" if own else str(path)
    deeper = frames[-1] if frames and (not own or frames[-1] is not own[-1]) else None
    origin = f" (raised in {deeper.filename}:{deeper.lineno})" if deeper is not None else ""
    hint = (f"; is it installed in this Python ({sys.executable})?"
            if isinstance(exc, ModuleNotFoundError) else "")
    return f"{where}: {type(exc).__name__}: {exc}{origin}, while the pipeline file was loaded{hint}"


def _describe_syntax_error(exc: SyntaxError, path: Path) -> str:
    """``path:LINE:COLUMN: IndentationError: unexpected indent: <the line>``, in one line."""
    where = ":".join(str(n) for n in (exc.filename or path, exc.lineno, exc.offset) if n is not None)
    text = (exc.text or "").strip()
    return f"{where}: {type(exc).__name__}: {exc.msg}" + (f": {text}" if text else "")


def make_settings(module: types.ModuleType, overrides: Sequence[str] = ()) -> Any:
    """Default settings of a loaded pipeline with ``key=value`` overrides applied; every value is
    checked where it is declared (its type, its class's ``__post_init__``), so a bad one is one
    PipelineError naming the setting."""
    try:
        defaults = module.Settings()
    except TypeError as exc:
        raise PipelineError(f"every field of Settings needs a default ({exc})") from None
    except ValueError as exc:
        raise PipelineError(f"the defaults of Settings are refused: {exc}") from None
    return apply_overrides(defaults, zarr_where_the_buffer_is_a_url(overrides))


def means_none(raw: str) -> bool:
    """Whether a ``--set`` value spells None (``none``, ``null``, or nothing) for a setting that takes it."""
    return raw.strip().lower() in ("none", "null", "")


def zarr_where_the_buffer_is_a_url(overrides: Sequence[str], *, run_at_a_url: bool = False) -> list[str]:
    """``overrides``, with ``buffer_backend=zarr`` added where the buffer lives at a URL (``buffer_url``
    given, or ``run_at_a_url``) and no ``buffer_backend`` is given: only Zarr lives there."""
    given = dict(split_override(item) for item in overrides)
    at_a_url = run_at_a_url or not means_none(given.get("buffer_url", "none"))
    return [*overrides, "buffer_backend=zarr"] if at_a_url and "buffer_backend" not in given else list(overrides)


# ====================================================================== --set
def with_flags(overrides: Sequence[str], **flags: object) -> list[str]:
    """``overrides`` and the flags given (``--steps N`` is ``--set steps=N``; None: not given); a flag and
    a ``--set`` of its setting that disagree are refused, naming both, where the later one silently won."""
    given = dict(split_override(item) for item in overrides)
    combined = list(overrides)
    for name, value in flags.items():
        if value is None:
            continue
        if name in given and given[name] != str(value):
            raise PipelineError(f"--{name} {value} and --set {name}={given[name]} disagree (--{name} sets {name}): "
                                f"give one of them")
        combined.append(f"{name}={value}")
    return combined


def split_override(item: str) -> tuple[str, str]:
    """``(key, value)`` of one ``--set key=value``, each stripped; PipelineError for anything else."""
    key, equals, raw = (part.strip() for part in item.partition("="))
    if not equals or not key:
        raise PipelineError(f"--set expects key=value, got {item!r}")
    return key, raw


def apply_overrides(settings: Any, overrides: Sequence[str]) -> Any:
    """Returns a copy of ``settings`` with each ``key=value`` (dotted keys for nesting) applied.

    Each settings dataclass is rebuilt once with all of its changes, so rules between its fields
    (``sample_window >= batch_size``) see the values given together, in whatever order."""
    changes: dict[str, Any] = {}
    for item in overrides:
        key, raw = split_override(item)
        level = changes
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            level = level.setdefault(part, {})
            if not isinstance(level, dict):
                raise PipelineError(f"--set {item!r}: {'.'.join(parts[:depth + 1])!r} was given a value of its own")
        level[parts[-1]] = raw
    return _rebuild(settings, changes, "", settings)


def _rebuild(obj: Any, changes: dict[str, Any], prefix: str, root: Any) -> Any:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj))
    values: dict[str, Any] = {}
    for name, change in changes.items():
        key = prefix + name
        if name not in fields:
            renamed = getattr(type(obj), "RENAMED", {}).get(name)  # a settings class's own table of old names
            if renamed is not None:
                raise PipelineError(f"setting {key!r} is now {prefix + renamed!r}: --set {prefix + renamed}=...")
            removed = getattr(type(obj), "REMOVED", {}).get(name)  # and of settings that went, with what replaced them
            if removed is not None:
                raise PipelineError(f"setting {key!r} was removed: {removed}; drop it")
            raise PipelineError(_unknown_setting(key, root))
        derived = fields[name].metadata.get("derived_from")
        if derived is not None:
            raise PipelineError(f"setting {key!r} is set from {derived!r} by the run; set that instead "
                                f"(--set {derived}=...)")
        current = getattr(obj, name)
        if isinstance(change, dict):
            if not dataclasses.is_dataclass(current):
                raise PipelineError(f"setting {key + '.' + next(iter(change))!r}: {name!r} has no sub-settings")
            values[name] = _rebuild(current, change, key + ".", root)
        elif dataclasses.is_dataclass(current):
            raise PipelineError(f"setting {key!r} is a group of settings; set one of them, e.g. "
                                f"--set {key}.{dataclasses.fields(current)[0].name}=...")
        else:
            values[name] = parse_value(hints[name], change, key, default=current)
    if not values:
        return obj
    try:
        return dataclasses.replace(obj, **values)
    except (ValueError, TypeError) as exc:  # the class's own checks (__post_init__)
        raise PipelineError(str(exc)) from None


def _unknown_setting(key: str, root: Any) -> str:
    close = suggest_setting(key, sorted(_all_keys(type(root))))
    hint = f" Did you mean {close!r}?" if close else ""
    # a pointer, not the list: a pipeline has over a hundred settings, which made a 2,000-character line
    return (f"unknown setting {key!r}.{hint} `rlhf-pipeline run PIPELINE.py --list-settings` prints every "
            f"setting with its documentation")


# names people bring from other trainers (TRL, verl, torchtune...) -> the name used here
_SYNONYMS = {
    "learning_rate": "lr", "lr_rate": "lr", "max_steps": "steps", "num_steps": "steps", "total_steps": "steps",
    "train_steps": "steps", "n_steps": "steps", "num_generations": "group_size", "num_samples": "group_size",
    "grad_clip": "max_grad_norm", "clip_grad_norm": "max_grad_norm", "max_norm": "max_grad_norm",
    "kl_coeff": "kl_coef", "kl_beta": "kl_coef", "beta": "kl_coef", "warmup": "warmup_steps",
    "num_warmup_steps": "warmup_steps", "bs": "batch_size", "train_batch_size": "batch_size", "temp": "temperature",
    "max_length": "max_new_tokens", "max_completion_length": "max_new_tokens", "save_steps": "checkpoint_every",
    "save_every": "checkpoint_every", "logging_steps": "log_every", "log_interval": "log_every",
}


def suggest_setting(key: str, known: Sequence[str]) -> str | None:
    """The known setting a mistyped ``key`` most likely meant, or None.

    Matches on the last dotted part first (``learner.learning_rate`` -> ``learner.lr``, a
    top-level ``lr`` -> ``learner.lr``): the same name after synonyms, without underscores or as
    initials; then a close spelling under the same parent; then a very close one anywhere.
    """
    parent, _, last = key.rpartition(".")
    wanted = last.lower().replace("-", "_")
    wanted = _SYNONYMS.get(wanted, wanted)
    initials = "".join(word[0] for word in wanted.split("_") if word) if "_" in wanted else None

    def same_name(name: str) -> bool:
        name = name.lower()
        return name == wanted or name.replace("_", "") == wanted.replace("_", "") or name == initials

    hits = [k for k in known if same_name(k.rpartition(".")[2])]
    if hits:  # prefer the same parent, then the shortest key
        return min(hits, key=lambda k: (k.rpartition(".")[0] != parent, len(k)))
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    close = difflib.get_close_matches(wanted, list(siblings), n=1, cutoff=0.6)
    if close:
        return siblings[close[0]]
    anywhere = {k.rpartition(".")[2]: k for k in sorted(known, key=len, reverse=True)}  # shortest key wins
    close = difflib.get_close_matches(wanted, list(anywhere), n=1, cutoff=0.8)
    return anywhere[close[0]] if close else None


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if "derived_from" in f.metadata:
            continue
        if dataclasses.is_dataclass(t):
            keys += _all_keys(t, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_value(annotation: Any, raw: str, key: str, default: Any = None) -> Any:
    """Parses ``raw`` as ``annotation`` (bool, int, float, str, Path, Literal, Optional, tuple); a choice
    outside a ``Literal`` or a float that is not finite is refused naming ``key`` (and ``default``)."""
    value = _parse(annotation, raw, key)
    if not_finite(value):
        raise PipelineError(finite_error(key, value, default, takes_none=type(None) in typing.get_args(annotation)))
    return value


def _parse(annotation: Any, raw: str, key: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    choices = literal_choices(annotation)
    if choices is not None and not (type(None) in args and means_none(raw)):
        for choice in choices:
            if str(choice) == raw:
                return choice
        raise PipelineError(choice_error(key, raw, choices))
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and means_none(raw):
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _parse(arg, raw, key)
            except PipelineError as exc:
                errors.append(str(exc))
        raise PipelineError(errors[0] if len(errors) == 1 else f"setting {key!r}: cannot parse {raw!r} as {annotation}")
    if origin in (tuple, list):
        items = [s.strip() for s in raw.split(",") if s.strip()]
        if fixed_length(annotation) is not None:  # tuple[float, float]: one type per place
            if len(items) != len(args):
                raise PipelineError(f"setting {key!r} takes {len(args)} comma-separated values, got "
                                    f"{len(items)}: {raw!r}")
            return tuple(_parse(item_type, s, key) for item_type, s in zip(args, items))
        values = [_parse(args[0] if args else str, s, key) for s in items]
        return tuple(values) if origin is tuple else values
    if annotation is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise PipelineError(f"setting {key!r} expects true/false, got {raw!r}")
    if annotation in (int, float):
        try:
            return annotation(raw)
        except ValueError:
            raise PipelineError(f"setting {key!r} expects {annotation.__name__}, got {raw!r}") from None
    if annotation is Path:
        return Path(raw).expanduser()
    if annotation is str or annotation is Any:
        return raw
    raise PipelineError(f"setting {key!r} has type {annotation}, which --set cannot parse")


# ====================================================================== docs
def settings_docs(cls: type) -> dict[str, str]:
    """Field name -> help text, from ``metadata["help"]`` or the docstring under the field (a
    subclass's word for a field it declares again wins over its base's)."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
            body = tree.body[0].body  # type: ignore[attr-defined]
            for stmt, nxt in zip(body, body[1:]):
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)
                        and isinstance(nxt.value.value, str)):
                    docs[stmt.target.id] = " ".join(nxt.value.value.split())
        except (OSError, TypeError, SyntaxError, IndexError):
            pass
    for f in dataclasses.fields(cls):
        if "help" in f.metadata:
            docs[f.name] = f.metadata["help"]
    return docs


def describe_settings(settings: Any, prefix: str = "") -> str:
    """One line per setting: key, type, current value and help (what ``--list-settings`` prints)."""
    lines = []
    docs = settings_docs(type(settings))
    hints = typing.get_type_hints(type(settings))
    bounds = field_bounds(type(settings))
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if "derived_from" in f.metadata:  # not a setting of its own
            continue
        if dataclasses.is_dataclass(value):
            lines.append(describe_settings(value, prefix + f.name + "."))
            continue
        hint = hints[f.name]
        if literal_choices(hint) is not None:
            type_name = "|".join(str(a) for a in literal_choices(hint))
        else:
            type_name = getattr(hint, "__name__", str(hint).replace("typing.", ""))
        if f.name in bounds:
            type_name += f", {bounds[f.name]}"
        lines.append(f"  {prefix + f.name} ({type_name}) = {value!r}")
        if f.name in docs:
            lines.append(textwrap.fill(docs[f.name], width=96, initial_indent="      ",
                                       subsequent_indent="      "))
    return "\n".join(lines)


def settings_to_json(settings: Any) -> dict:
    """Plain-JSON form of the settings (Paths as strings), stored in the run directory."""

    def convert(value):
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [convert(v) for v in value]
        return value

    return convert(dataclasses.asdict(settings))
