"""Generation engines: token ids in, sampled ids and their sampling log-probs out, the policy version
that produced them beside (``engine.py`` is the contract).

* :mod:`.engine` -- ``GenerationEngine`` (an ABC with capability properties), ``SampleRequest``,
  ``Completion``, ``CompletionGroup``, ``draw_seed``, the errors;
* :mod:`.sampling` -- ``SamplingConfig`` and ``process_logits``, the one definition of the sampling
  distribution every engine's log-probs follow;
* :mod:`.loop` -- our sampling loop (``generate``, ``teacher_forced_log_probs``) and ``LoopEngine``;
* :mod:`.settings` -- ``GenerationSettings`` (``--set generation.engine=vllm``), ``make_engine`` and
  ``make_collector_engine`` (what a pipeline's collector calls);
* :mod:`.vllm_url` -- ``VLLMURLEngine``: the one vLLM client, a server reached through its
  OpenAI-compatible API over :mod:`.vllm_http` (checked against the pipeline's model first), its
  weights in :mod:`.vllm_url_weights`;
* :mod:`.vllm_engine` -- ``VLLMEngine``: that client on a server the collector starts
  (:mod:`.vllm_process` starts and stops it, under the vLLM environment's Python) and starts again
  when it dies (:mod:`.restarts`, given the weights it held); :mod:`.vllm_worker` is the worker
  extension that loads new weights in the server;
* :mod:`.vllm_nccl` -- the GPU route for weights (vLLM's NCCL weight transfer);
* :mod:`.vllm_setup` -- making the vLLM environment (``rlhf-pipeline setup-vllm``).

This package is imported by the engine's own process, which runs under another Python with only
the standard library, torch, safetensors and vllm: it imports nothing at import time, and names are
resolved on first use (PEP 562).
"""

import importlib

_DEFINED_IN = {
    **{name: "engine" for name in (
        "BadAnswer", "Completion", "CompletionGroup", "EngineDied", "EngineFailed", "EngineStats", "GenerationEngine",
        "SampleRequest", "UnsupportedCapability", "UnsupportedSetting", "checked_completions", "draw_seed")},
    "SamplingConfig": "sampling", "process_logits": "sampling",
    **{name: "loop" for name in ("Generation", "LoopEngine", "generate", "left_pad", "teacher_forced_log_probs")},
    "GenerationSettings": "settings", "make_collector_engine": "settings", "make_engine": "settings",
    "VLLMEngine": "vllm_engine",
    "VLLMURLEngine": "vllm_url",
}
__all__ = sorted(_DEFINED_IN)


def __getattr__(name: str):
    module = _DEFINED_IN.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
