"""Which rows each learner step trains on: the contract (:mod:`.contract`), the samplers (one
module each: ``window``, ``exact``, ``groups``, ``prioritized``, ``epoch``) and the registry that
``learner.sampler`` picks from (:mod:`.registry`). Design: docs/learner.md#which-rows-a-step-trains-on.
"""

from rlhf_pipeline.learn.errors import DataTimeoutError
from rlhf_pipeline.learn.samplers.contract import BatchSampler, SampledRows
from rlhf_pipeline.learn.samplers.registry import SAMPLERS, make_sampler

__all__ = ["SAMPLERS", "BatchSampler", "DataTimeoutError", "SampledRows", "make_sampler"]
