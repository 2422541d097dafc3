"""Which engine a pipeline generates with: :class:`GenerationSettings` (``--set generation.engine=vllm``,
or ``--set generation.url=http://...``), which checks itself (an option set for another engine is
refused), :func:`check_generation` (what the collector's own server asks of this machine) and
:func:`make_engine`. The vLLM engine's Python (``generation.python``): the one given, else
``.venv-vllm`` beside this checkout (``rlhf-pipeline setup-vllm``), else this one when it has vllm.
Design: docs/generation.md#the-settings-by-engine.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from rlhf_pipeline.setting_checks import Bounds, check_fields
from rlhf_pipeline.generation.vllm_http import Retries
from rlhf_pipeline.generation.vllm_setup import check_cpu_head_size, check_nccl_device, default_vllm_env, python_has_vllm

if TYPE_CHECKING:
    from rlhf_pipeline.generation.engine import GenerationEngine


Engine = Literal["loop", "vllm", "url"]
"""The engine a run generates with: ``generation.engine`` (loop or vllm), or ``url`` when ``generation.url``
names a server the user started."""
EVERY: tuple[Engine, ...] = ("loop", "vllm", "url")
SERVERS: tuple[Engine, ...] = ("vllm", "url")
CHOSEN_BY: dict[Engine, str] = {"loop": "generation.engine=loop", "vllm": "generation.engine=vllm",
                                "url": "generation.url"}
GENERATES_WITH: dict[Engine, str] = {
    "loop": "the loop", "vllm": "the collector's own vLLM server (generation.engine=vllm)",
    "url": "the server at generation.url"}


@dataclass
class GenerationSettings:
    """Which engine samples the collector's completions, and how it runs. Each option belongs to the
    engines :attr:`ENGINES` names: set to other than its default for another engine, it is refused."""

    RENAMED: ClassVar[dict[str, str]] = {
        "url_retries": "retries", "max_restarts": "retries", "url_backoff_s": "backoff_s",
        "restart_backoff_s": "backoff_s", "url_wait_s": "start_timeout_s", "url_timeout_s": "timeout_s",
        "hung_after_s": "timeout_s", "url_weights": "weight_transfer",
    }
    """Settings of one engine each that became one for every vLLM server (issue 42): ``--set`` with an
    old name is refused, naming the new one (``pipeline.py``)."""
    REMOVED: ClassVar[dict[str, str]] = {
        "url_api_key_env": "a server started with --api-key gets the key in $VLLM_API_KEY, vLLM's own variable for it",
        "url_lease_s": "a round's lease on a shared server's weights lives 60 s without renewal, which only a collector "
                       "that died mid-round makes the others wait out",
        "enforce_eager": "the collector's own vLLM server runs eager on a CPU and compiled (CUDA graphs) on a GPU",
        "stream_groups": "every round writes each group as soon as it and every group before it ended (issue 42: "
                         "what the one collector does, with every engine)",
        "overlap_rounds": "the next round goes to the engine while this round's tail decodes whenever pacing lets it "
                          "start with the weights this round uses (issue 42: what the one collector does)",
        "agent_turns": "each episode's next turn goes to the engine as soon as its environment answered; our loop "
                       "decodes a round's waiting turns together (issue 42: what the one collector does)",
    }
    """Settings that went (issue 42), each with what replaced it: ``--set`` with one is refused in one line
    saying so (``pipeline.py``); a run started with one resumes without it (``runs/run_directory.py``)."""

    RESUMABLE: ClassVar[frozenset[str]] = frozenset({
        "url", "url_model", "url_weights_dir", "weight_transfer", "url_check_tolerance", "python", "kv_cache_gib",
        "gpu_memory_utilization", "start_timeout_s", "retries", "backoff_s", "timeout_s"})
    """How the collector reaches its engine and waits on it: a resume may change these, with a note
    (``runs/run_directory.py``), for a server restarted at another address, a vLLM environment made
    again elsewhere, more patience. Not which engine samples: ``url`` may go from one address to
    another, not to or from none."""

    ENGINES: ClassVar[dict[str, tuple[Engine, ...]]] = {
        "engine": EVERY, "url": ("url",),  # the choice itself (a URL and engine=vllm: __post_init__)
        "python": ("vllm",), "kv_cache_gib": ("vllm",), "gpu_memory_utilization": ("vllm",),
        "max_model_len": ("vllm",), "max_num_seqs": ("vllm",),
        "start_timeout_s": SERVERS, "retries": SERVERS, "backoff_s": SERVERS, "timeout_s": SERVERS,
        "url_model": ("url",), "url_weights_dir": ("url",), "url_check_tolerance": ("url",),
        "weight_transfer": SERVERS, "weight_transfer=inline": ("url",), "weight_transfer=nccl": ("vllm",),
    }
    """The engines each setting means something for (``name=value``: that value only, before the name's
    own entry). Set to other than its default while the run generates with another engine, it is
    refused in one line naming it, its engines and the run's (:meth:`__post_init__`)."""

    engine: Literal["loop", "vllm"] = "loop"
    """loop: our sampling loop in the collector's process (the default); vllm: a vLLM server the
    collector starts under the vLLM environment's Python, reached as one at generation.url is, and
    stops with the run."""
    python: str | None = None
    """vllm: the Python that has vLLM; none: .venv-vllm/bin/python of this checkout (rlhf-pipeline
    setup-vllm makes it), else this Python if it has vllm."""
    kv_cache_gib: Annotated[int, Bounds(ge=1, why=" (GiB)")] = 1
    """vllm on a CPU: GiB of memory for the KV cache (vLLM's default is 4)."""
    gpu_memory_utilization: Annotated[float, Bounds(gt=0, le=1)] = 0.5
    """vllm on a GPU: share of the GPU's memory vLLM may take (the learner may share the GPU)."""
    max_model_len: Annotated[int | None, Bounds(ge=2)] = None
    """vllm: longest prompt + response in tokens; none: the model's max_position_embeddings."""
    max_num_seqs: Annotated[int, Bounds(ge=1)] = 256
    """vllm: most sequences decoded at once (its continuous batch)."""
    start_timeout_s: Annotated[float, Bounds(ge=0, why=" (seconds)")] = 900.0
    """vllm or url: how long the server may take to start (importing vLLM alone took 16-90 s on a busy
    2-core machine; a server at the URL may still be starting) before the collector gives up."""
    retries: int = 5
    """vllm or url: tries after the first for a request the server did not answer, before the collector
    stops; the collector's own server is restarted (given the weights it held) before each, in a row:
    a request it answers resets the count. 0: never."""
    backoff_s: float = 1.0
    """vllm or url: pause before the first retry (or restart), doubled for each further one (at most
    30 s for a server at a URL, 60 s for a restart)."""
    timeout_s: float | None = 600.0
    """vllm or url: longest wait for one reply (a prompt's completions, a weight load); the collector's
    own server that does not answer within it hangs, and is killed and restarted. none: wait for ever."""
    url: str | None = None
    """A vLLM server the user started (http://host:port), instead of one the collector starts: checked
    against the pipeline's model before any row is written; see docs/generation.md for its command."""
    url_model: str | None = None
    """url: the served model name to ask for; none: the only one the server serves."""
    url_weights_dir: str | None = None
    """url: where new weights are written for the server to read, a path its machine sees too;
    none: a temporary directory on this machine (a server on this machine)."""
    url_check_tolerance: Annotated[float, Bounds(gt=0)] = 1e-3
    """url: largest log-prob difference between the server and the pipeline's model at the start
    check; raise it for a server in lower precision than the pipeline's model."""
    weight_transfer: Literal["files", "inline", "nccl"] = "files"
    """How new weights reach the server: files (each version's safetensors file, read by the server
    and reloaded in place; CPU and GPU; url: written to url_weights_dir), inline (url: the file's bytes
    in the request, base64, for a server on a machine with no file system in common; a third more than
    the weights travel per update) or nccl (vllm: vLLM's NCCL weight transfer from the collector's GPU
    copy; GPU only, and vllm must import in the collector's own Python; retries=0 spares the disk write
    of each version a restart would reload)."""

    @property
    def chosen_engine(self) -> Engine:
        """The engine this run generates with: the server at ``url`` when one is named, else ``engine``."""
        return "url" if self.url is not None else self.engine

    def __post_init__(self) -> None:
        check_fields(self, "generation.")  # each choice one its type allows, every number finite and in bounds
        if self.url is not None and self.engine == "vllm":
            raise ValueError(f"generation.url={self.url} names a server you started and generation.engine=vllm "
                             f"starts one of the collector's own: drop one of them")
        chosen = self.chosen_engine
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value == field.default:
                continue
            shown = f"{field.name}={value}" if f"{field.name}={value}" in self.ENGINES else field.name
            if chosen not in self.ENGINES[shown]:
                raise ValueError(f"setting 'generation.{shown}' is for "
                                 f"{' or '.join(CHOSEN_BY[e] for e in self.ENGINES[shown])}; this run generates "
                                 f"with {GENERATES_WITH[chosen]}: drop it")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"setting 'generation.url' must be an http:// or https:// URL (http://host:port), got "
                             f"{self.url!r}")
        self.engine_retries()  # refuses each by name

    def engine_retries(self) -> Retries:
        """``retries``, ``backoff_s`` and ``timeout_s`` as a server's client uses them."""
        return Retries(self.retries, self.backoff_s, self.timeout_s)


def check_generation(settings: GenerationSettings, *, head_size: int | None = None, device: str = "cpu",
                     head_hint: str = "") -> str | None:
    """What the collector's own vLLM server asks of this machine, which the settings cannot check
    themselves (they do in ``__post_init__``): raises ValueError naming the setting; returns the Python
    it runs under (None for another engine).

    ``head_size``: the model's attention head size when the pipeline knows it (refused on a CPU when
    vLLM's CPU attention does not take it; ``head_hint`` says which setting changes it).
    """
    if settings.chosen_engine != "vllm":
        return None
    if settings.weight_transfer == "nccl":
        check_nccl_device(device)
    if device == "cpu" and head_size is not None:
        check_cpu_head_size(head_size, head_hint)
    return find_vllm_python(settings.python)


def find_vllm_python(explicit: str | None = None) -> str:
    """The interpreter the vLLM engine runs under (see the module docstring); ValueError when none."""
    if explicit:
        if not Path(explicit).exists():
            raise ValueError(f"setting 'generation.python' is {explicit!r}, which does not exist; point it at the "
                             f"bin/python of an environment with vLLM, or run `rlhf-pipeline setup-vllm`")
        if not python_has_vllm(explicit):
            raise ValueError(f"setting 'generation.python' is {explicit!r}, which has no vllm package; install it "
                             f"there (`rlhf-pipeline setup-vllm --path ...` makes such an environment)")
        return explicit
    beside = default_vllm_env() / "bin" / "python"
    if beside.exists():
        return str(beside)
    if python_has_vllm(sys.executable):
        return sys.executable
    raise ValueError(f"generation.engine=vllm needs a Python with vLLM, and there is no {beside} and no vllm in "
                     f"{sys.executable}: run `rlhf-pipeline setup-vllm` (makes {default_vllm_env()}), or "
                     f"--set generation.python=/path/to/bin/python")


def make_engine(settings: GenerationSettings, model: Any, *, pad_token_id: int, stop_token_ids: Sequence[int],
                device: str = "cpu", policy_version: int = 0, seed: int = 0, tokenizer: Any = None,
                adapters: Any = None) -> GenerationEngine:
    """The engine ``settings`` name, serving ``model`` (its current weights, as ``policy_version``).

    The loop engine samples with ``model`` itself; the vLLM engine saves it and starts its process
    (tens of seconds); a server at ``generation.url`` is checked against ``model`` and ``tokenizer``
    (the pipeline's, for the server's /tokenize) and given its weights: the caller owns the engine and
    closes it (a collector's ``close``). Several collectors may share one server at ``generation.url``:
    each round holds a lease on the weights it samples with (``generation/vllm_lease.py``).
    ``adapters``: a LoRA run's (``vllm_adapters.AdapterServing``): a vLLM engine loads each adapter
    version by name; the loop merges them itself. Whatever keeps the engine from serving this run is a
    ValueError or an ``EngineFailed`` naming it, before any row: callers say it in one line."""
    if settings.url is not None:
        from rlhf_pipeline.generation.vllm_url import API_KEY_ENV, VLLMURLEngine

        return VLLMURLEngine(settings.url, model, stop_token_ids=stop_token_ids, tokenizer=tokenizer,
                             policy_version=policy_version, served_model=settings.url_model,
                             weights_dir=settings.url_weights_dir, inline_weights=settings.weight_transfer == "inline",
                             retries=settings.engine_retries(), wait_s=settings.start_timeout_s,
                             check_tolerance=settings.url_check_tolerance,
                             api_key=os.environ.get(API_KEY_ENV) or None, adapters=adapters)
    if settings.engine == "loop":
        from rlhf_pipeline.generation.loop import LoopEngine

        return LoopEngine(model, pad_token_id=pad_token_id, eos_token_id=list(stop_token_ids),
                          policy_version=policy_version)
    python = check_generation(settings, device=device)
    if settings.weight_transfer == "nccl":
        from rlhf_pipeline.generation.vllm_nccl import NCCLVLLMEngine as engine
    else:
        from rlhf_pipeline.generation.vllm_engine import VLLMEngine as engine
    return engine.from_model(
        model, python=python, stop_token_ids=stop_token_ids, policy_version=policy_version, device=device, seed=seed,
        kv_cache_gib=settings.kv_cache_gib, max_num_seqs=settings.max_num_seqs, max_model_len=settings.max_model_len,
        start_timeout_s=settings.start_timeout_s, adapters=adapters,
        gpu_memory_utilization=None if device == "cpu" else settings.gpu_memory_utilization,
        # a server that died is started again and given the version it held, from its file (vllm_url_weights.py)
        retries=settings.engine_retries())
