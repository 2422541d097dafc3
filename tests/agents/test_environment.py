"""The environment protocol and runner: sync and async environments, timeouts, reasons."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

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


class AsyncSlow(Slow):
    async def step(self, turn):
        await asyncio.sleep(self.seconds)
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
    envs = [AsyncEcho() for _ in range(20)]

    async def main():
        with EnvironmentRunner(max_workers=1) as runner:
            start = time.perf_counter()
            results = await asyncio.gather(*(runner.step(e, ModelTurn(0, "")) for e in envs))
            return results, time.perf_counter() - start

    results, seconds = asyncio.run(main())
    assert all(r.reason is TerminationReason.TOOL_ERROR and r.reward == 1.0 for r in results)
    assert seconds < 0.15  # 20 x 10 ms concurrently, not one after another


def test_sync_steps_overlap_in_the_pool():
    envs = [Slow(0.1) for _ in range(4)]

    async def main():
        with EnvironmentRunner(max_workers=4) as runner:
            start = time.perf_counter()
            await asyncio.gather(*(runner.step(e, ModelTurn(0, "")) for e in envs))
            return time.perf_counter() - start

    assert asyncio.run(main()) < 0.35


@pytest.mark.parametrize("env_class", [Slow, AsyncSlow])
def test_a_step_past_its_timeout_ends_the_episode_as_truncated(env_class):
    async def main():
        with EnvironmentRunner(step_timeout_s=0.05) as runner:
            result = await runner.step(env_class(0.5), ModelTurn(0, ""))
            return result, runner.timeouts

    result, timeouts = asyncio.run(main())
    assert result.done and result.reason is TerminationReason.TIMEOUT and timeouts == 1
    assert result.reason.truncated and not result.reason.terminated


def test_reset_past_its_timeout_raises():
    class SlowReset:
        def reset(self, task):
            time.sleep(0.5)

        def step(self, turn):
            return StepResult()

    async def main():
        with EnvironmentRunner(step_timeout_s=0.05) as runner:
            await runner.reset(SlowReset(), {})

    with pytest.raises(StepTimeout):
        asyncio.run(main())


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
