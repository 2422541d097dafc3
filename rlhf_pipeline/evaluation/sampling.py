"""The one call an evaluation makes into a generation engine, and the seed of each sample.

Every (prompt, sample) of an evaluation has its own seed, derived from the run's seed, the set, the
policy version, the prompt and the sample index (:func:`eval_seed`): what an evaluation samples does
not depend on which prompts were evaluated before it, so one killed midway and resumed samples the
rest as the uninterrupted one would, and evaluating a version again gives the same completions.
Design: docs/evaluation.md#scores.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlhf_pipeline.generation.engine import SEED_RANGE, Completion, SampleRequest
from rlhf_pipeline.generation.sampling import SamplingConfig

if TYPE_CHECKING:
    from rlhf_pipeline.generation.engine import GenerationEngine


def eval_seed(run_seed: int, set_name: str, version: int, prompt: int, sample: int, turn: int = 0) -> int:
    """The seed of sample ``sample`` of prompt ``prompt`` of ``set_name`` at ``version`` (an agent's
    turn ``turn``): a hash, so seeds of neighbouring prompts or versions are unrelated."""
    key = f"{run_seed}/{set_name}/{version}/{prompt}/{sample}/{turn}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") % SEED_RANGE


def eval_sampling(temperature: float, max_new_tokens: int) -> SamplingConfig:
    """Temperature 0 is greedy: the most likely token, as ``top_k=1`` keeps it (its log-prob 0)."""
    if temperature == 0:
        return SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0, top_k=1)
    return SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature)


def sample_eval(engine: GenerationEngine, requests: Sequence[SampleRequest], seeds: Sequence[int],
                sampling: SamplingConfig) -> list[Completion]:
    """One completion per request (each ``n=1``), request ``i`` sampled with ``seeds[i]``.

    Our loop gets one request per call: its tokens do not depend on what shares its batch, but its
    log-probs move by ~1e-7 with it, and a resumed evaluation must store exactly the rows of one never
    interrupted, whichever prompts it has left. A server gets them all at once: it batches them with
    whatever else it serves (the collectors' requests too), so its last bits are never the caller's to
    fix, and one call is one weights lease on a shared server (``generation/vllm_url_lease.py``): the
    version evaluated is loaded once for the whole chunk, not once per request."""
    from rlhf_pipeline.generation.loop import LoopEngine

    if len(requests) != len(seeds):
        raise ValueError(f"sample_eval: {len(requests)} requests but {len(seeds)} seeds; one seed per request")
    if any(request.n != 1 for request in requests):
        raise ValueError(f"sample_eval takes requests of n=1 (a seed per sample), got n={[r.n for r in requests]}")
    calls = [[k] for k in range(len(requests))] if isinstance(engine, LoopEngine) else [list(range(len(requests)))]
    out = []
    for call in calls:
        groups = engine.sample([requests[k] for k in call], [int(seeds[k]) for k in call], sampling)
        out += [group.completions[0] for group in groups]
    return out
