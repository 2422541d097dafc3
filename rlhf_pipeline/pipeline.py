"""What a pipeline file is, how it is loaded by path, and how ``--set`` edits its settings.

Why one file: the three change together; they are the contract between a user's pipeline file and
the framework (issue 42 splits task from run settings, which will cut it along that line).

A pipeline is a Python file (``pipelines/default.py`` is the model to copy) that defines:

* ``Settings`` -- a ``@dataclass`` with a default for every field. Each field is documented
  by a docstring right below it (or ``metadata={"help": ...}``); ``--list-settings`` prints
  them. It must have the fields ``steps: int`` (learner steps) and ``device: str``, which the
  ``--steps`` / ``--device`` flags set. Nested dataclasses are allowed and addressed with
  dots (``--set learner.lr=1e-4``).
* ``build(settings, run: RunPaths) -> Pipeline`` -- checks the settings (paths exist,
  prompts have their fields, the reward returns one value per completion...) and returns a
  :class:`Pipeline`. ``build`` must raise :class:`PipelineError` on bad settings and must not
  start any long work: models are built only when a ``Pipeline`` callable is called.
* ``check(settings)`` (optional) -- the settings checks that need no torch (ranges, learner
  settings), raising :class:`PipelineError`. ``run`` imports no torch: it calls ``check`` before
  it starts any process, and its learner process calls ``build``, whose errors ``run`` reports
  the same way, only seconds later. ``build`` calls ``check`` too (``collect`` / ``learn``).

Settings come from the dataclass defaults and the command line only; they are never read
from environment variables (``RLHF_PIPELINE_HOME`` only says where run directories live).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import inspect
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from rlhf_pipeline.files.run_paths import RunPaths  # noqa: F401 -- pipeline files import it from here
from rlhf_pipeline.finite_settings import check_finite

REQUIRED_SETTINGS = ("steps", "device")
MIN_LOCK_LEASE_S = 3.0  # an object-store writer lock renews every third of its lease: a request a second at most


class PipelineError(ValueError):
    """Bad pipeline file or settings; the message names the field and the fix."""


# ====================================================================== the contract
class CollectorLike(Protocol):
    """Everything ``rlhf-pipeline collect`` calls (``rlhf_pipeline.collect.Collector`` and
    ``AgentCollector`` are two): its sink publishes each append's rows with the state after them
    (``make_replay_buffer(store, ...).extend``), which ``load_state_dict`` takes back on restart."""

    config: Any  # its ``collector_index`` names the ids it writes
    engine: Any  # a GenerationEngine: its ``stats`` and ``name`` are said on the console
    runner_state: dict[str, Any]  # the runner's own state, published with the collector's
    last_metrics: dict[str, float]  # the last round's
    batches_emitted: int  # rounds written, counted on across restarts
    rounds_at_version: int  # rounds written with the weights it holds (pacing's rounds_per_version)

    def collect(self, next_round: Callable[[int], bool] | None = None) -> Any: ...  # one round

    @property
    def round_rows(self) -> int: ...  # rows a round writes (an estimate for agents)

    @property
    def policy_version(self) -> int: ...

    @property
    def has_round_ahead(self) -> bool: ...  # the next round went ahead: it takes no new weights

    def set_policy_state(self, state_dict: dict, version: int) -> None: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclass
class Pipeline:
    """What ``build`` returns: the parts ``run`` / ``collect`` / ``learn`` wire together.

    Every callable is cheap to hold and does its work only when called, so a ``Pipeline``
    can be built in the parent process just to check settings.
    """

    settings: Any
    learner: Any  # rlhf_pipeline.learn.settings.LearnerSettings
    make_policy: Callable[[], Any]
    """Builds the initial policy (warm start included); run once per run, published as v0. The
    learner that published it trains this very object, so it must be what ``make_model`` builds
    (architecture, dtype) with the warm start's weights in it."""
    make_model: Callable[[], Any]
    """Builds the model architecture only (random init); weights are loaded into it."""
    create_buffer: Callable[[Path], Any]
    """Creates the (empty) replay buffer at the path; returns the open, writable store."""
    make_collector: Callable[..., CollectorLike]
    """``make_collector(model, writable_store, collector_index=0)`` -> a collector whose rows reach
    the store through the pipeline's write-path transforms (e.g. ``ReplayBuffer.extend`` with
    them attached). With several collectors each gets its own shard store and index, which it
    must pass on (``CollectorConfig(collector_index=...)``) so ids stay unique across shards; a
    ``make_collector(model, store)`` without the parameter runs as collector 0 only. The collector
    is closed (its engine's process, if any) when collection ends."""
    pad_token_id: int
    tokenizer: Any = None
    """The policy's tokenizer (a ``transformers`` tokenizer, with its chat template): what
    ``import`` tokenizes text with and ``export-model`` saves beside the weights. Without it
    those commands stop with an error saying so."""
    make_write_path: Callable[[Any], Sequence[Any]] | None = None
    """``make_write_path(writable_store)`` -> the write-path transforms bound to that store, in
    write order (group advantage, reference log-probs, KL reward...). ``make_collector`` builds
    its buffer from it and ``import`` writes through it, so collected and imported rows share
    one definition. None: rows are stored as they come."""
    preflight: Callable[[], None] = lambda: None
    """Cheap checks that need code to run (the reward on one sample); called before any work."""
    collect_rounds_per_version: int | None = 2
    """A collector writes at most this many rounds per policy version, then waits for new
    weights: rows much older than the learner would only be dropped as stale. Rounds the learner's
    next batch needs are written whatever this says (it cannot publish new weights without them;
    ``coordination/pacing.py``). None: no limit."""
    collect_rounds_ahead: int | None = 0
    """Pacing: a collector generates what the learner's next batch needs (its share, with
    several collectors) plus at most this many rounds, then waits for the learner to take them
    in (``rlhf_pipeline/coordination/pacing.py``): no generation the learner would not train on. 0 overlaps
    generation with exactly one learner step; None: no pacing."""
    torch_threads: int | None = None
    """Intra-op torch threads of each process (collector, learner, the warm start). Collector and
    learner run side by side, so one each is often fastest on a small CPU machine; None: torch's
    default."""
    buffer_url: str | None = None
    """The buffer on object storage: a URL prefix (``s3://bucket/run/buffer``) under which
    collector k writes ``shard-kkkk`` with ``create_buffer`` (which must make a Zarr store) and
    the learner reads the union; endpoint and credentials from the ``AWS_*`` environment
    variables (``az://container/run/buffer``: from ``AZURE_STORAGE_CONNECTION_STRING``). None: ``<run>/buffer``. The run directory (weights, checkpoints, metrics) stays local."""
    buffer_lock_wait_s: float = 60.0
    """With ``buffer_url``: how long a collector waits for its shard's writer lock while another
    writer holds it (a collector that died on another machine holds it until its lease runs
    out); it says whose lease it is and until when."""
    buffer_lock_lease_s: float = 30.0
    """With ``buffer_url``: the lease of a collector's writer lock on its shard, renewed every third
    of it. A shorter lease lets a restarted collector take over sooner from one that died or hangs
    (a paused writer is fenced once its lease has run out) and costs more requests (one PUT per
    renewal); a writer that cannot renew for a whole lease (a long GC pause, a network outage)
    loses its shard. At least 3 s."""

    retention: Any = None
    """Each collector's retention of its shard (storage/retention.py RetentionSettings); None: all rows."""

    def __post_init__(self) -> None:
        if not self.buffer_lock_lease_s >= MIN_LOCK_LEASE_S:
            raise PipelineError(
                f"setting 'buffer_lock_lease_s' must be >= {MIN_LOCK_LEASE_S:g} seconds (the lock is renewed every "
                f"third of it), got {self.buffer_lock_lease_s!r}; the default is 30"
            )
        if not self.buffer_lock_wait_s >= 0:
            raise PipelineError(f"setting 'buffer_lock_wait_s' must be >= 0 seconds, got {self.buffer_lock_wait_s!r}")


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
    "rlhf_pipeline.ray_settings": "rlhf_pipeline.cluster.settings",
    "rlhf_pipeline.collect.generate": "rlhf_pipeline.generation (loop.py, sampling.py)",
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
    except ModuleNotFoundError as exc:
        sys.modules.pop(module_name, None)
        if exc.name in MOVED_MODULES:  # a pipeline file (or a run's copy of one) written before a move
            raise PipelineError(f"{path} imports {exc.name}, which moved: import from {MOVED_MODULES[exc.name]} "
                                f"instead") from None
        raise
    except Exception:
        sys.modules.pop(module_name, None)
        raise
    settings_cls = getattr(module, "Settings", None)
    if settings_cls is None or not dataclasses.is_dataclass(settings_cls):
        raise PipelineError(f"{path} must define `Settings`, a @dataclass of its settings")
    if not callable(getattr(module, "build", None)):
        raise PipelineError(f"{path} must define `build(settings, run) -> Pipeline`")
    names = {f.name for f in dataclasses.fields(settings_cls)}
    missing = [n for n in REQUIRED_SETTINGS if n not in names]
    if missing:
        raise PipelineError(
            f"{path}: Settings lacks the field(s) {missing}, which --steps/--device set; add them"
        )
    return module


def _describe_syntax_error(exc: SyntaxError, path: Path) -> str:
    """``path:LINE:COLUMN: IndentationError: unexpected indent: <the line>``, in one line."""
    where = ":".join(str(n) for n in (exc.filename or path, exc.lineno, exc.offset) if n is not None)
    text = (exc.text or "").strip()
    return f"{where}: {type(exc).__name__}: {exc.msg}" + (f": {text}" if text else "")


def make_settings(module: types.ModuleType, overrides: Sequence[str] = ()) -> Any:
    """Default settings of a loaded pipeline, ``key=value`` overrides applied, every float finite (nan, inf refused)."""
    try:
        defaults = module.Settings()
    except TypeError as exc:
        raise PipelineError(f"every field of Settings needs a default ({exc})") from None
    return check_finite(apply_overrides(defaults, overrides), defaults=defaults, error=PipelineError)


# ====================================================================== --set
def apply_overrides(settings: Any, overrides: Sequence[str]) -> Any:
    """Returns a copy of ``settings`` with each ``key=value`` (dotted keys for nesting) applied."""
    for item in overrides:
        if "=" not in item:
            raise PipelineError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        settings = _set_path(settings, key.strip().split("."), raw.strip(), key.strip(), "")
    return settings


def _set_path(obj: Any, parts: list[str], raw: str, full_key: str, prefix: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    name = parts[0]
    if name not in fields:
        known = sorted(_all_keys(type(obj), prefix))
        close = suggest_setting(full_key, known)
        hint = f" Did you mean {close!r}?" if close else ""
        # a pointer, not the list: a pipeline has over a hundred settings, which made a 2,000-character line
        raise PipelineError(f"unknown setting {full_key!r}.{hint} `rlhf-pipeline run PIPELINE.py --list-settings` "
                            f"prints every setting with its documentation")
    hints = typing.get_type_hints(type(obj))
    if len(parts) > 1:
        child = getattr(obj, name)
        if not dataclasses.is_dataclass(child):
            raise PipelineError(f"setting {full_key!r}: {name!r} has no sub-settings")
        return dataclasses.replace(obj, **{name: _set_path(child, parts[1:], raw, full_key, prefix + name + ".")})
    value = parse_value(hints[name], raw, full_key)
    try:
        return dataclasses.replace(obj, **{name: value})
    except (ValueError, TypeError) as exc:  # the dataclass's own checks (__post_init__)
        raise PipelineError(f"setting {full_key!r}={raw!r} was rejected: {exc}") from None


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
        if dataclasses.is_dataclass(t):
            keys += _all_keys(t, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_value(annotation: Any, raw: str, key: str) -> Any:
    """Parses ``raw`` as ``annotation`` (bool, int, float, str, Path, Literal, Optional, tuple)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and raw.lower() in ("none", "null", ""):
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return parse_value(arg, raw, key)
            except PipelineError as exc:
                errors.append(str(exc))
        raise PipelineError(errors[0] if len(errors) == 1 else f"setting {key!r}: cannot parse {raw!r} as {annotation}")
    if origin is Literal:
        for choice in args:
            if str(choice) == raw:
                return choice
        raise PipelineError(f"setting {key!r} must be one of {list(args)}, got {raw!r}")
    if origin in (tuple, list):
        item_type = args[0] if args else str
        items = [s.strip() for s in raw.split(",") if s.strip()]
        values = [parse_value(item_type, s, key) for s in items]
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
    """Field name -> help text, from ``metadata["help"]`` or the docstring under the field."""
    docs: dict[str, str] = {}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
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
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if dataclasses.is_dataclass(value):
            lines.append(describe_settings(value, prefix + f.name + "."))
            continue
        hint = hints[f.name]
        if typing.get_origin(hint) is Literal:
            type_name = "|".join(str(a) for a in typing.get_args(hint))
        else:
            type_name = getattr(hint, "__name__", str(hint).replace("typing.", ""))
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
