"""Generation engines: token ids in, sampled ids and their sampling log-probs out, the policy version
that produced them beside (docs/collector.md#generation-engines, docs/generation.md).

``engine.py`` is the contract, ``sampling.py`` the one sampling distribution, ``loop.py`` our sampling
loop, ``vllm_url.py`` the one vLLM client (a server at ``generation.url``, or one the collector starts:
``vllm_engine.py``), ``settings.py`` which one a run uses. The vLLM server's own process imports this
package with only the standard library, torch, safetensors and vllm: nothing is imported here until
a name is used (PEP 562).
"""

import importlib

_DEFINED_IN = {
    **{name: "engine" for name in (
        "BadAnswer", "Completion", "CompletionGroup", "EngineDied", "EngineFailed", "EngineStats", "EngineStopped",
        "GenerationEngine", "SampleRequest", "UnsupportedCapability", "UnsupportedSetting", "checked_completions",
        "draw_seed")},
    "SamplingConfig": "sampling", "process_logits": "sampling",
    **{name: "loop" for name in ("Generation", "LoopEngine", "generate", "left_pad", "teacher_forced_log_probs")},
    "GenerationSettings": "settings", "make_engine": "settings",
    "VLLMEngine": "vllm_engine",
    "VLLMURLEngine": "vllm_url",
}
__all__ = sorted(_DEFINED_IN)


def __getattr__(name: str):
    module = _DEFINED_IN.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
