"""An agent round whose episodes take their turns on their own: each episode's next turn goes to
the engine as soon as its environment answered, so a fast environment's episode does not wait for
the round's slowest one, and vLLM's batch keeps its slots full.

Rows that do not depend on timing. Which turns share an engine's batch, and in what order they come,
changes with the environments' timing. So randomness is per episode: at the round's start the
collector's generator (the one it checkpoints) gives one seed per episode, in episode order, and
episode ``k``'s turns are seeded from a generator seeded with the ``k``-th (one request seed per turn,
``engine.draw_seed``). Our loop decodes what is queued when the caller flushes: :class:`EpisodeTurns`
flushes once every live episode of the round waits for a turn that has not begun, so the loop's
batches are the round's live episodes' turns together, whatever the timing, and the same bits; a
server starts each turn when it is submitted. A round's rows then depend on the tasks, the collector's saved state, the model and
the environments' answers, not on when those answers came.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from rlhf_pipeline.agents.rollout import Sample
from rlhf_pipeline.generation.engine import GenerationEngine, SampleRequest, draw_seed
from rlhf_pipeline.generation.sampling import SamplingConfig

def episode_seeds(generator: torch.Generator, episodes: int) -> list[int]:
    """One seed per episode of the round, in episode order (``episodes`` draws of ``generator``)."""
    return [draw_seed(generator) for _ in range(episodes)]


class EpisodeTurns:
    """One round's turns, each episode's seeded from its own generator: ``sample_turn`` and
    ``episode_ended`` are the rollout's. Use as a context manager around the rollout."""

    def __init__(self, engine: GenerationEngine, sampling: SamplingConfig, seeds: Sequence[int]) -> None:
        engine.check_sampling(sampling)
        self.engine, self.sampling = engine, sampling
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self._lock = threading.Lock()  # answers are counted on the engine's threads
        self._live = len(seeds)  # episodes that may still ask for a turn
        self._unanswered: set[Future] = set()  # turns submitted and not answered
        self._busy_since: float | None = None
        self.busy_s = 0.0
        """Seconds at least one turn was in the engine (the round's ``generate_s``)."""

    async def sample_turn(self, episode: int, token_ids: list[int], max_new_tokens: int) -> Sample:
        """Episode ``episode``'s next turn: submitted now, awaited until the engine sampled it."""
        future = self.engine.submit(SampleRequest(token_ids, n=1, max_new_tokens=max_new_tokens),
                                    draw_seed(self.generators[episode]), self.sampling)
        with self._lock:
            self._unanswered.add(future)
            if self._busy_since is None:
                self._busy_since = time.perf_counter()
        future.add_done_callback(self._answered)
        self._flush_when_all_wait()
        completion = (await asyncio.wrap_future(future)).completions[0]
        return completion.token_ids, completion.log_probs

    def episode_ended(self, episode: int) -> None:
        """Episode ``episode`` asks for no more turns (it ended, failed, or never started)."""
        with self._lock:
            self._live -= 1
        self._flush_when_all_wait()

    def _answered(self, future: Future) -> None:
        with self._lock:
            self._unanswered.discard(future)
            if not self._unanswered and self._busy_since is not None:
                self.busy_s += time.perf_counter() - self._busy_since
                self._busy_since = None

    def _flush_when_all_wait(self) -> None:
        """Every live episode waits for a turn none of whose has begun (the loop answers a batch's turns
        as they stop, and may still be decoding the rest): what they submitted may start, as one batch."""
        with self._lock:
            all_wait = (self._unanswered and len(self._unanswered) == self._live
                        and not any(future.running() or future.done() for future in self._unanswered))
        if all_wait:
            self.engine.flush()

    def __enter__(self) -> EpisodeTurns:
        return self

    def __exit__(self, *exc: object) -> None:
        pass
