"""Our sampling loop, which moved to ``rlhf_pipeline/generation/`` (``sampling.py``: the config and the
sampling distribution; ``loop.py``: the loop and its engine). Its public names stay importable from
here for the pipelines, tests and notebooks that use them."""

from rlhf_pipeline.generation.loop import Generation, generate, left_pad, teacher_forced_log_probs
from rlhf_pipeline.generation.sampling import SamplingConfig, process_logits

__all__ = ["Generation", "SamplingConfig", "generate", "left_pad", "process_logits", "teacher_forced_log_probs"]
