"""An agent round whose episodes take their turns on their own (``AgentCollectorConfig.turns =
"per_episode"``, ``--set generation.agent_turns=per_episode``): each episode's next turn goes to the
engine as soon as its environment answered, so a fast environment's episode does not wait for the
round's slowest one, and vLLM's batch keeps its slots full (``generation/turns.py``).

Rows that do not depend on timing. With lockstep turns the engine's random draws follow the order
of one batch per turn; here which turns share a batch, and in what order they come, changes with the
environments' timing. So randomness is per episode: at the round's start the collector's generator
(the one it checkpoints) gives one seed per episode, in episode order, and episode ``k``'s turns draw
only from a generator seeded with the ``k``-th (vLLM and a server: one request seed per turn; our loop:
every token, the turn decoded alone). A round's rows then depend on the tasks, the collector's saved
state, the model and the environments' answers, not on when those answers came; a collector resumed
from its saved state gives every episode the same seeds. The rows differ from lockstep turns' (other
draws), so the setting changes what a seed gives, and lockstep stays the default.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from rlhf_pipeline.agents.rollout import Sample
from rlhf_pipeline.generation.engine import CompletionGroup, GenerationEngine, SampleRequest, draw_seed
from rlhf_pipeline.generation.sampling import SamplingConfig
from rlhf_pipeline.generation.turns import ThreadedTurns, TurnSubmitter
from rlhf_pipeline.generation.vllm_url import VLLMURLEngine

TURN_MODES = ("lockstep", "per_episode")


def open_turns(engine: GenerationEngine, sampling: SamplingConfig) -> TurnSubmitter:
    """How ``engine`` takes turns one at a time (``generation/turns.py``): a vLLM server (the collector's
    own or one at a URL) gets one HTTP request per turn, many in flight; our loop (or another engine)
    samples one turn at a time, alone."""
    engine.check_sampling(sampling)
    if isinstance(engine, VLLMURLEngine):
        return ThreadedTurns(engine, sampling, workers=engine.max_concurrency)
    return ThreadedTurns(engine, sampling, workers=1)  # one model, one decode at a time


def episode_seeds(generator: torch.Generator, episodes: int) -> list[int]:
    """One seed per episode of the round, in episode order (``episodes`` draws of ``generator``)."""
    return [draw_seed(generator) for _ in range(episodes)]


class EpisodeTurns:
    """One round's turns, each episode's from its own generator; use as a context manager around the
    rollout (``sample_turn`` is its ``sample_turn``)."""

    def __init__(self, engine: GenerationEngine, sampling: SamplingConfig, seeds: Sequence[int]) -> None:
        self.generators = [torch.Generator(device=engine.generator_device).manual_seed(seed) for seed in seeds]
        self.submitter = open_turns(engine, sampling)

    async def sample_turn(self, episode: int, token_ids: list[int], max_new_tokens: int) -> Sample:
        """Episode ``episode``'s next turn: sent now, awaited until the engine sampled it."""
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[CompletionGroup] = loop.create_future()

        def done(group: CompletionGroup | None, error: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(_settle, answered, group, error)
            except RuntimeError:  # the round ended (it failed) before this turn came back: nobody waits
                pass

        self.submitter.submit(SampleRequest(token_ids, n=1, max_new_tokens=max_new_tokens),
                              self.generators[episode], done)
        completion = (await answered).completions[0]
        return completion.token_ids, completion.log_probs

    @property
    def busy_s(self) -> float:
        """Seconds at least one turn was in the engine (the round's ``generate_s``)."""
        return self.submitter.busy_s

    def __enter__(self) -> EpisodeTurns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.submitter.close()


def _settle(future: asyncio.Future, group: CompletionGroup | None, error: BaseException | None) -> None:
    if future.done():  # its episode was cancelled (another failed the round)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(group)
