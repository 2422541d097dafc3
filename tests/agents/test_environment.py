"""The environment protocol and runner: sync and async environments, timeouts, reasons."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch

from rlhf_pipeline.agents.environment import (
    Environment,
    EnvironmentRunner,
    ModelTurn,
    StepResult,
    StepTimeout,
)
from rlhf_pipeline.schema import TerminationReason


class Echo:
    def reset(self, task):
        self.thread = threading.current_thread().name
        return [{"role": "user", "content": task["question"]}]

    def step(self, turn):
        return StepResult([{"role": "user", "content": turn.text.upper()}], reward=0.5,
                          done=turn.index >= 1)


class AsyncEcho:
    async def reset(self, task):
        await asyncio.sleep(0)
        return [{"role": "user", "content": task["question"]}]

    async def step(self, turn):
        await asyncio.sleep(0.01)
        return StepResult(reward=1.0, done=True, reason=TerminationReason.TOOL_ERROR)


class Slow:
    def __init__(self, seconds):
        self.seconds = seconds

    def reset(self, task):
        return []

    def step(self, turn):
        time.sleep(self.seconds)
        return StepResult()


def test_sync_environment_runs_in_the_thread_pool():
    env = Echo()
    assert isinstance(env, Environment)

    async def main():
        with EnvironmentRunner(max_workers=2) as runner:
            messages = await runner.reset(env, {"question": "hi"})
            first = await runner.step(env, ModelTurn(0, "abc"))
            second = await runner.step(env, ModelTurn(1, "x"))
        return messages, first, second

    messages, first, second = asyncio.run(main())
    assert messages == [{"role": "user", "content": "hi"}]
    assert env.thread.startswith("environment")
    assert first.messages == [{"role": "user", "content": "ABC"}] and not first.done and first.reason is None
    assert second.done and second.reason is TerminationReason.ENV_DONE  # done without a reason: env done


def test_async_environment_is_awaited_and_many_step_at_once():
    """20 async steps meet at a barrier of 20 on one worker thread: awaited one after another, the
    first would wait past its step timeout; awaited together, all pass."""
    class MeetingEcho(AsyncEcho):
        barrier: asyncio.Barrier

        async def step(self, turn):
            await self.barrier.wait()
            return await super().step(turn)

    envs = [MeetingEcho() for _ in range(20)]

    async def main():
        MeetingEcho.barrier = asyncio.Barrier(20)  # made on the event loop that runs the steps
        with EnvironmentRunner(max_workers=1, step_timeout_s=5.0) as runner:
            return await asyncio.gather(*(runner.step(e, ModelTurn(0, "")) for e in envs)), runner.timeouts

    results, timeouts = asyncio.run(main())
    assert timeouts == 0
    assert all(r.reason is TerminationReason.TOOL_ERROR and r.reward == 1.0 for r in results)


def test_sync_steps_overlap_in_the_pool():
    """4 synchronous steps meet at a thread barrier: only steps running on 4 threads at once pass it."""
    barrier = threading.Barrier(4, timeout=5.0)

    class Meeting(Slow):
        def step(self, turn):
            barrier.wait()  # BrokenBarrierError (a raised step) if the pool ran them one at a time
            return super().step(turn)

    async def main():
        with EnvironmentRunner(max_workers=4, step_timeout_s=10.0) as runner:
            return await asyncio.gather(*(runner.step(Meeting(0.0), ModelTurn(0, "")) for _ in range(4)))

    results = asyncio.run(main())
    assert len(results) == 4 and not any(r.done for r in results)


class Blocked:
    """A step that returns only once the test is over: past any timeout, however slow the machine."""

    def __init__(self, released: threading.Event):
        self.released = released

    def reset(self, task):
        self.released.wait(60)
        return []

    def step(self, turn):
        self.released.wait(60)
        return StepResult()


class AsyncBlocked(Blocked):
    async def step(self, turn):
        await asyncio.Event().wait()  # cancelled by the timeout
        return StepResult()


@pytest.mark.parametrize("env_class", [Blocked, AsyncBlocked])
def test_a_step_past_its_timeout_ends_the_episode_as_truncated(env_class):
    released = threading.Event()

    async def main():
        with EnvironmentRunner(step_timeout_s=0.05) as runner:
            result = await runner.step(env_class(released), ModelTurn(0, ""))
            return result, runner.timeouts

    try:
        result, timeouts = asyncio.run(main())
    finally:
        released.set()
    assert result.done and result.reason is TerminationReason.TIMEOUT and timeouts == 1
    assert result.reason.truncated and not result.reason.terminated


def test_reset_past_its_timeout_raises():
    released = threading.Event()

    async def main():
        with EnvironmentRunner(step_timeout_s=0.05) as runner:
            await runner.reset(Blocked(released), {})

    try:
        with pytest.raises(StepTimeout):
            asyncio.run(main())
    finally:
        released.set()


def test_an_environment_bug_propagates_and_a_wrong_return_type_is_named():
    class Buggy:
        def reset(self, task):
            return []

        def step(self, turn):
            raise KeyError("oops")

    class Wrong(Buggy):
        def step(self, turn):
            return {"reward": 1}

    async def step(env):
        with EnvironmentRunner() as runner:
            return await runner.step(env, ModelTurn(0, ""))

    with pytest.raises(KeyError):
        asyncio.run(step(Buggy()))
    with pytest.raises(TypeError, match="not a StepResult"):
        asyncio.run(step(Wrong()))


def test_reasons_split_into_terminated_and_truncated():
    terminated = {r for r in TerminationReason if r.terminated}
    truncated = {r for r in TerminationReason if r.truncated}
    assert terminated == {TerminationReason.ENV_DONE, TerminationReason.TOOL_ERROR}
    assert truncated == {TerminationReason.MAX_TURNS, TerminationReason.TOKEN_BUDGET,
                         TerminationReason.CONTEXT_FULL, TerminationReason.GENERATION_LENGTH,
                         TerminationReason.TIMEOUT}
    assert not TerminationReason.NOT_ENDED.terminated and not TerminationReason.NOT_ENDED.truncated
    with pytest.raises(ValueError):
        StepResult(reason=TerminationReason.MAX_TURNS)  # a reason without done


def test_a_reward_is_a_real_number_as_at_the_buffers_door():
    """``StepResult(reward="1.0")`` was stored as 1.0 while the door refuses text rewards."""
    import numpy as np

    with pytest.raises(TypeError, match=r"StepResult.reward: expected a real number, got '1.0' \(str\); "
                                        r"numbers are not parsed from text"):
        StepResult(reward="1.0")
    for refused in (True, None, b"1", [1.0], torch.tensor([1.0, 2.0])):
        with pytest.raises(TypeError, match="StepResult.reward: expected a real number"):
            StepResult(reward=refused)
    for given, stored in ((1, 1.0), (np.float32(0.5), 0.5), (np.int64(2), 2.0), (torch.tensor(0.25), 0.25)):
        reward = StepResult(reward=given).reward
        assert type(reward) is float and reward == stored
    assert math.isnan(StepResult(reward=float("nan")).reward)  # a rollout drops its group (tests/collect)

    from rlhf_pipeline.agents.episode import Episode
    from rlhf_pipeline.models import char_tool_tokenizer

    result = StepResult()
    result.reward = "1.0"  # set after construction: refused where the episode records it
    tokenizer = char_tool_tokenizer()
    episode = Episode(tokenizer, [{"role": "user", "content": "hi"}])
    episode.add_turn([tokenizer.eos_token_id], [0.0])
    with pytest.raises(TypeError, match="numbers are not parsed from text"):
        episode.add_environment(result)
    assert episode.rewards == []
