"""Which engine a pipeline generates with: ``GenerationSettings`` (``--set generation.engine=vllm``, or
``--set generation.url=http://...`` for a vLLM server the user started) and ``make_engine``, which
builds it for a collector.

A pipeline holds ``generation: GenerationSettings`` in its ``Settings``, calls
:func:`check_generation` in its ``check`` (no torch, before any process starts) and
:func:`make_collector_engine` in its ``make_collector``; the collector gets the engine and knows nothing of
which one it is. The default, ``engine="loop"``, is our sampling loop in the collector's process:
rows are exactly those the collector wrote before engines existed.

Where the vLLM engine's Python comes from (``generation.python``, default none): the given
interpreter; else ``.venv-vllm/bin/python`` beside this package's checkout (what
``rlhf-pipeline setup-vllm`` makes); else this interpreter when it has vllm (a GPU machine where the
official ``vllm`` is installed with the project); else one line saying how to get one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from rlhf_pipeline.finite_settings import check_finite
from rlhf_pipeline.generation.vllm_setup import CPU_HEAD_SIZES, default_vllm_env, python_has_vllm

if TYPE_CHECKING:
    from rlhf_pipeline.generation.engine import GenerationEngine



@dataclass
class GenerationSettings:
    """Which engine samples the collector's completions, and how it runs."""

    RENAMED: ClassVar[dict[str, str]] = {
        "url_retries": "retries", "max_restarts": "retries", "url_backoff_s": "backoff_s",
        "restart_backoff_s": "backoff_s", "url_wait_s": "start_timeout_s", "url_timeout_s": "timeout_s",
        "hung_after_s": "timeout_s", "url_weights": "weight_transfer",
    }
    """Settings of one engine each that became one for every vLLM server (issue 42): ``--set`` with an
    old name is refused, naming the new one (``pipeline.py``)."""
    REMOVED: ClassVar[dict[str, str]] = {
        "stream_groups": "every round writes each group as soon as it and every group before it ended (issue 42: "
                         "what the one collector does, with every engine)",
        "overlap_rounds": "the next round goes to the engine while this round's tail decodes whenever pacing lets it "
                          "start with the weights this round uses (issue 42: what the one collector does)",
        "agent_turns": "each episode's next turn goes to the engine as soon as its environment answered; our loop "
                       "decodes a round's waiting turns together (issue 42: what the one collector does)",
    }
    """Settings that went, each with why: ``--set`` with one is refused in one line saying so (``pipeline.py``)."""

    engine: Literal["loop", "vllm"] = "loop"
    """loop: our sampling loop in the collector's process (the default); vllm: a vLLM server the
    collector starts under the vLLM environment's Python, reached as one at generation.url is, and
    stops with the run."""
    python: str | None = None
    """vllm: the Python that has vLLM; none: .venv-vllm/bin/python of this checkout (rlhf-pipeline
    setup-vllm makes it), else this Python if it has vllm."""
    kv_cache_gib: int = 1
    """vllm on a CPU: GiB of memory for the KV cache (vLLM's default is 4)."""
    gpu_memory_utilization: float = 0.5
    """vllm on a GPU: share of the GPU's memory vLLM may take (the learner may share the GPU)."""
    max_model_len: int | None = None
    """vllm: longest prompt + response in tokens; none: the model's max_position_embeddings."""
    max_num_seqs: int = 256
    """vllm: most sequences decoded at once (its continuous batch)."""
    enforce_eager: bool = True
    """vllm: no torch.compile / CUDA graphs (start-up 11-18 s on a CPU instead of ~48 s; for tiny
    models they gain nothing). Turn off for real models on a GPU."""
    start_timeout_s: float = 900.0
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
    url_api_key_env: str = "VLLM_API_KEY"
    """url: the environment variable holding the server's API key (its --api-key), sent as a bearer
    token when set: the key stays out of the run's settings file."""
    url_lease_s: float = 60.0
    """url: seconds a round's lease on the server's weights lives without renewal (renewed every quarter
    of it while the round runs): how long a collector that died mid-round holds up the others sharing
    the server. A collector stalled longer than this mid-round loses the round (nothing of it stored)."""
    url_check_tolerance: float = 1e-3
    """url: largest log-prob difference between the server and the pipeline's model at the start
    check; raise it for a server in lower precision than the pipeline's model."""
    weight_transfer: Literal["files", "inline", "nccl"] = "files"
    """How new weights reach the server: files (each version's safetensors file, read by the server
    and reloaded in place; CPU and GPU; url: written to url_weights_dir), inline (url: the file's bytes
    in the request, base64, for a server on a machine with no file system in common; a third more than
    the weights travel per update) or nccl (vllm: vLLM's NCCL weight transfer from the collector's GPU
    copy; GPU only, and vllm must import in the collector's own Python; retries=0 spares the disk write
    of each version a restart would reload)."""


def check_generation(settings: GenerationSettings, *, head_size: int | None = None, device: str = "cpu",
                     head_hint: str = "") -> None:
    """The engine's checks that need neither torch nor the engine: raises ValueError naming the setting.

    ``head_size``: the model's attention head size when the pipeline knows it (refused on a CPU when
    vLLM's CPU attention does not take it; ``head_hint`` says which setting changes it).
    """
    # a value no engine takes is refused whichever engine runs now: the run may switch engines later
    if settings.kv_cache_gib < 1:
        raise ValueError(f"setting 'generation.kv_cache_gib' must be >= 1 (GiB), got {settings.kv_cache_gib}")
    if not 0.0 < settings.gpu_memory_utilization <= 1.0:
        raise ValueError(f"setting 'generation.gpu_memory_utilization' must be in (0, 1], got "
                         f"{settings.gpu_memory_utilization}")
    if settings.max_model_len is not None and settings.max_model_len < 2:
        raise ValueError(f"setting 'generation.max_model_len' must be >= 2 or none, got {settings.max_model_len}")
    if settings.max_num_seqs < 1:
        raise ValueError(f"setting 'generation.max_num_seqs' must be >= 1, got {settings.max_num_seqs}")
    if not settings.start_timeout_s >= 0:
        raise ValueError(f"setting 'generation.start_timeout_s' must be >= 0 (seconds), got {settings.start_timeout_s}")
    _check_url_numbers(settings)
    from rlhf_pipeline.generation.restarts import Restarts

    Restarts(settings.retries, settings.backoff_s, settings.timeout_s)  # refuses each by name
    check_finite(settings, "generation.")  # what the range checks above let through (inf, as a rule)
    if settings.url is not None:
        check_url_settings(settings)
        return
    if settings.engine == "loop":
        return
    if settings.weight_transfer == "inline":
        raise ValueError("setting 'generation.weight_transfer=inline' is for a server at generation.url on another "
                         "machine; the collector's own server reads files: use generation.weight_transfer=files")
    if settings.weight_transfer == "nccl" and device == "cpu":
        raise ValueError("setting 'generation.weight_transfer=nccl' needs a GPU (vLLM's NCCL weight transfer is "
                         "CUDA-only); on a CPU use generation.weight_transfer=files")
    if device == "cpu" and head_size is not None and head_size not in CPU_HEAD_SIZES:
        raise ValueError(f"generation.engine=vllm on a CPU: vLLM's CPU attention takes head sizes "
                         f"{list(CPU_HEAD_SIZES)}, this model's is {head_size}{head_hint}; or use generation.engine=loop")
    find_vllm_python(settings.python)


def check_url_settings(settings: GenerationSettings) -> None:
    """``generation.url`` and its settings; ValueError naming the setting."""
    if settings.engine == "vllm":
        raise ValueError(f"generation.url={settings.url} names a server you started and generation.engine=vllm "
                         f"starts one of the collector's own: drop one of them")
    if settings.weight_transfer == "nccl":
        raise ValueError("setting 'generation.weight_transfer=nccl' is for the collector's own server "
                         "(generation.engine=vllm on a GPU); a server at generation.url takes files or inline")
    if not settings.url.startswith(("http://", "https://")):
        raise ValueError(f"setting 'generation.url' must be an http:// or https:// URL (http://host:port), got "
                         f"{settings.url!r}")
    _check_url_numbers(settings)


def _check_url_numbers(settings: GenerationSettings) -> None:
    for name in ("url_check_tolerance", "url_lease_s"):
        if not getattr(settings, name) > 0:
            raise ValueError(f"setting 'generation.{name}' must be > 0, got {getattr(settings, name)}")


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


def make_collector_engine(settings: GenerationSettings, model: Any, tokenizer: Any, *, device: str, seed: int,
                          collector_index: int) -> GenerationEngine:
    """:func:`make_engine` as a pipeline's collector ``collector_index`` asks for it (the tokenizer's
    pad and EOS). Whatever keeps the engine from serving this run is one ValueError naming it, before
    any row: a server that cannot serve this run or does not answer, a missing vLLM environment.
    Several collectors may share one server at ``generation.url``: each round holds a lease on the
    weights it samples with (``generation/vllm_lease.py``). Pipelines turn it into their one-line ``PipelineError``."""
    from rlhf_pipeline.generation.engine import BadAnswer
    from rlhf_pipeline.generation.vllm_http import ServerUnreachable

    try:
        return make_engine(settings, model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=[tokenizer.eos_token_id],
                           device=device, seed=seed, tokenizer=tokenizer)
    except (ServerUnreachable, BadAnswer) as exc:  # the check's own request went unanswered, or answered badly
        raise ValueError(str(exc)) from None


def make_engine(settings: GenerationSettings, model: Any, *, pad_token_id: int, stop_token_ids: Sequence[int],
                device: str = "cpu", policy_version: int = 0, seed: int = 0, tokenizer: Any = None) -> GenerationEngine:
    """The engine ``settings`` name, serving ``model`` (its current weights, as ``policy_version``).

    The loop engine samples with ``model`` itself; the vLLM engine saves it and starts its process
    (tens of seconds); a server at ``generation.url`` is checked against ``model`` and ``tokenizer``
    (the pipeline's, for the server's /tokenize) and given its weights: the caller owns the engine and
    closes it (a collector's ``close``)."""
    if settings.url is not None:
        from rlhf_pipeline.generation.vllm_http import RetryPolicy
        from rlhf_pipeline.generation.vllm_url import VLLMURLEngine

        check_url_settings(settings)
        retry = RetryPolicy(retries=settings.retries, backoff_s=max(settings.backoff_s, 1e-3),
                            max_backoff_s=max(30.0, settings.backoff_s),
                            timeout_s=settings.timeout_s if settings.timeout_s is not None else 10**9)
        return VLLMURLEngine(settings.url, model, stop_token_ids=stop_token_ids, tokenizer=tokenizer,
                             policy_version=policy_version, served_model=settings.url_model,
                             weights_dir=settings.url_weights_dir, inline_weights=settings.weight_transfer == "inline",
                             retry=retry, wait_s=settings.start_timeout_s,
                             check_tolerance=settings.url_check_tolerance,
                             api_key=os.environ.get(settings.url_api_key_env) or None,
                             api_key_env=settings.url_api_key_env, lease_s=settings.url_lease_s)
    if settings.engine == "loop":
        from rlhf_pipeline.generation.loop import LoopEngine

        return LoopEngine(model, pad_token_id=pad_token_id, eos_token_id=list(stop_token_ids),
                          policy_version=policy_version)
    check_generation(settings, device=device)
    from rlhf_pipeline.generation.restarts import Restarts

    options: dict[str, Any] = dict(
        python=find_vllm_python(settings.python), stop_token_ids=stop_token_ids, policy_version=policy_version,
        device=device, seed=seed, kv_cache_gib=settings.kv_cache_gib, max_num_seqs=settings.max_num_seqs,
        enforce_eager=settings.enforce_eager, start_timeout_s=settings.start_timeout_s,
        max_model_len=settings.max_model_len, timeout_s=settings.timeout_s, backoff_s=settings.backoff_s,
        # a server that died is started again and given the version it held, from its file (vllm_url_weights.py)
        restarts=Restarts(settings.retries, settings.backoff_s, settings.timeout_s),
    )
    if device != "cpu":
        options["gpu_memory_utilization"] = settings.gpu_memory_utilization
    if settings.weight_transfer == "nccl":
        from rlhf_pipeline.generation.vllm_nccl import NCCLVLLMEngine

        return NCCLVLLMEngine.from_model(model, **options)
    from rlhf_pipeline.generation.vllm_engine import VLLMEngine

    return VLLMEngine.from_model(model, **options)
