"""Tools that misbehave: results that cannot become text, calls that hang. Each is an error answer
counted in ``ToolBox.metrics``; none crashes a rollout, starves the calls after it, keeps a
process alive at exit, or is counted in a round it did not belong to."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from agent_scripts import scripted_sampler

from rlhf_pipeline.agents.environment import StepResult, ToolCall
from rlhf_pipeline.agents.rollout import RolloutConfig, rollout
from rlhf_pipeline.agents.tools import ToolBox
from rlhf_pipeline.agents.workers import PoolExhausted, WorkerPool

REPO = Path(__file__).resolve().parents[2]


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for you")

    __repr__ = __str__


class LoudError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("cannot say")


def awkward(kind: str):
    """Returns or raises something awkward.

    Args:
        kind: which awkward thing
    """
    if kind == "error with a surrogate":
        raise ValueError("bad \ud800 news")
    if kind == "error that cannot be printed":
        raise LoudError()
    return {"object": Unprintable(), "huge int": 10 ** 5000, "huge int in a dict": {"n": 10 ** 5000},
            "surrogate": "tool says \udc80 here", "non-str str": Unprintable}[kind]


@pytest.mark.parametrize("kind, metric, says", [
    ("object", "bad_output", "awkward returned a Unprintable that cannot be made into text (RuntimeError: no text"),
    ("huge int", "bad_output", "awkward returned a int that cannot be made into text (ValueError: Exceeds the limit"),
    ("huge int in a dict", "bad_output", "awkward returned a dict that cannot be made into text"),
    ("surrogate", "bad_output", "awkward returned text that is not valid Unicode: character 10 is a lone surrogate"),
    ("error with a surrogate", "raised", "awkward raised ValueError: bad \\ud800 news"),
    ("error that cannot be printed", "raised", "awkward raised LoudError: (its message cannot be printed)"),
])
def test_a_result_that_cannot_be_text_is_an_error_answer(kind, metric, says):
    box = ToolBox([awkward], max_output_chars=400)
    answers, errors = box.run_counted([ToolCall("awkward", {"kind": kind}, "")])
    box.close()
    (answer,) = answers
    assert errors == 1 and box.metrics[metric] == 1 and box.metrics["ok"] == 0
    assert answer["content"].startswith(f"Error: {says}"), answer["content"]
    answer["content"].encode("utf-8")  # what a tokenizer and a store can take


def test_a_rollout_whose_tool_returns_what_cannot_be_text_goes_on(bpe_tokenizer):
    """The issue's case: one such result used to raise out of the round (the tokenizer's TypeError,
    or ValueError past Python's 4,300-digit limit)."""
    box = ToolBox([awkward])

    class Awkward:
        toolbox = box

        def reset(self, task):
            self.kind = task["kind"]
            return [{"role": "user", "content": "Go."}]

        def step(self, turn):
            if turn.index == 0:
                return StepResult(self.toolbox.run([ToolCall("awkward", {"kind": self.kind}, "")]))
            return StepResult(reward=1.0, done=True)

    result = rollout([{"kind": k} for k in ("surrogate", "huge int", "object")], Awkward,
                     scripted_sampler(bpe_tokenizer, ["call", "done"]), bpe_tokenizer, RolloutConfig(group_size=1))
    box.close()
    assert not result.failures and len(result.episodes) == 3
    assert result.metrics["tools/bad_output"] == 3 and result.metrics["tools/calls"] == 3
    assert all(e.tool_errors[0] == 1 and len(e.turns) == 2 for e in result.episodes)


# ====================================================================== hung calls
def test_hung_calls_free_their_slots_for_the_calls_after_them():
    """As many hung calls as the pool has threads used to leave every later call of every tool
    waiting behind them, to time out for as long as they hung."""
    release = threading.Event()

    def hang() -> str:
        """Waits until the test ends."""
        release.wait(60)
        return "late"

    def quick(x: int) -> int:
        """Answers at once.

        Args:
            x: echoed
        """
        return x

    box = ToolBox([hang, quick], timeout_s=0.2, max_workers=2)
    try:
        for _ in range(3):  # more hung calls than threads
            (answer,) = box.run([ToolCall("hang", {}, "")])
            assert answer["content"] == "Error: hang took longer than 0.2s"
        box.timeout_s = 60.0  # the quick calls: a limit no loaded machine reaches, so only a free thread is tested
        answers, errors = box.run_counted([ToolCall("quick", {"x": k}, "") for k in range(2)])
        assert errors == 0 and [a["content"] for a in answers] == ["0", "1"]
        assert box.metrics["timeout"] == 3 and box.metrics["ok"] == 2
    finally:
        release.set()
        box.close()


def test_past_max_hung_calls_new_calls_are_answered_at_once_not_started():
    release = threading.Event()
    started = threading.Semaphore(0)

    def hang() -> str:
        """Waits until the test ends."""
        started.release()
        release.wait(60)
        return "late"

    box = ToolBox([hang], timeout_s=0.05, max_workers=1, max_hung_calls=2)
    try:
        answers = [box.run([ToolCall("hang", {}, "")])[0]["content"] for _ in range(4)]
        assert answers[:3] == ["Error: hang took longer than 0.05s"] * 3
        assert answers[3].startswith("Error: hang was not run: 3 calls that timed out are still running (more than 2)")
        # the three given up on started (their threads may start after their timeout, on a loaded machine)
        assert all(started.acquire(timeout=60) for _ in range(3)) and not started.acquire(timeout=0)
        assert box.metrics["timeout"] == 4
    finally:
        release.set()
        box.close()


def test_a_pool_replaces_a_worker_given_up_on_and_joins_only_live_ones():
    release, pool = threading.Event(), WorkerPool(1, max_abandoned=1)
    started = threading.Semaphore(0)

    def stuck_call():
        started.release()
        return release.wait(60)

    stuck = [pool.submit(stuck_call)]
    assert started.acquire(timeout=10)
    pool.abandon(stuck[0])
    assert pool.submit(lambda: 7).result(timeout=10) == 7 and pool.abandoned_running == 1
    stuck.append(pool.submit(stuck_call))
    assert started.acquire(timeout=10)
    pool.abandon(stuck[1])  # a second one, past max_abandoned=1 ...
    with pytest.raises(PoolExhausted):  # ... and the pool takes no more until they return
        pool.submit(lambda: 8)
    release.set()
    assert [f.result(timeout=10) for f in stuck] == [True, True]
    pool.shutdown(wait=True)  # returns: nothing live is running


@pytest.mark.slow
def test_a_process_whose_tool_hangs_for_ever_still_exits():
    """The interpreter joins a ThreadPoolExecutor's threads at exit: a tool that never returned kept a
    plain Python process (a Collector in a script) alive for ever."""
    script = textwrap.dedent("""
        import threading
        from rlhf_pipeline.agents.environment import ToolCall
        from rlhf_pipeline.agents.tools import ToolBox

        def hang() -> str:
            '''Never returns.'''
            threading.Event().wait()

        box = ToolBox([hang], timeout_s=0.1)
        print(box.run([ToolCall("hang", {}, "")])[0]["content"], flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "Error: hang took longer than 0.1s"


def test_calls_that_end_after_their_round_count_in_no_round(bpe_tokenizer):
    """A step past its timeout runs on in its thread; its tool call, finishing during the next round,
    was counted in that round's tools/* (a shared ToolBox's counts were differenced per rollout)."""
    release, late_call_done = threading.Event(), threading.Event()

    def slow() -> str:
        """Waits to be released."""
        release.wait(60)
        return "slow"

    def quick() -> str:
        """Answers at once."""
        return "quick"

    box = ToolBox([slow, quick], timeout_s=None)

    class Env:
        toolbox = box

        def reset(self, task):
            self.round = task["round"]
            return [{"role": "user", "content": "Go."}]

        def step(self, turn):
            if self.round == 1:  # outlives the step's timeout: the round ends without it
                self.toolbox.run([ToolCall("slow", {}, "")])
                late_call_done.set()
                return StepResult(done=True)
            release.set()  # round 2: the late call finishes while this step runs
            assert late_call_done.wait(30)
            self.toolbox.run([ToolCall("quick", {}, "")])
            return StepResult(reward=1.0, done=True)

    sample = scripted_sampler(bpe_tokenizer, ["hi"])
    # 3 s: the step's thread must start its call in time on a loaded machine (the call itself never ends in it)
    first = rollout([{"round": 1}], Env, sample, bpe_tokenizer, RolloutConfig(group_size=1, step_timeout_s=3.0))
    # the second round's step must end in time: a limit no loaded machine reaches
    second = rollout([{"round": 2}], Env, sample, bpe_tokenizer, RolloutConfig(group_size=1, step_timeout_s=60.0))
    box.close()
    assert first.metrics["environment_timeouts"] == 1
    assert (first.metrics["tools/calls"], first.metrics["tools/ok"]) == (1, 0)  # started, not answered in time
    assert (second.metrics["tools/calls"], second.metrics["tools/ok"]) == (1, 1)  # its own call only
    assert box.metrics["calls"] == box.metrics["ok"] == 2  # the toolbox's lifetime counts keep both


def test_a_hung_environment_step_frees_its_thread_for_the_next_step():
    from rlhf_pipeline.agents.environment import EnvironmentRunner, ModelTurn
    from rlhf_pipeline.schema import TerminationReason

    release = threading.Event()

    class Hangs:
        def reset(self, task):
            return []

        def step(self, turn):
            release.wait(300)
            return StepResult()

    class Quick(Hangs):
        def step(self, turn):
            return StepResult(reward=1.0, done=True)

    async def two_steps():
        with EnvironmentRunner(max_workers=1, step_timeout_s=0.1) as runner:
            hung = await runner.step(Hangs(), ModelTurn(0, ""))
            # queued behind the hung step, the quick one would time out too; on its own thread it
            # answers well within a limit no loaded machine reaches
            runner.step_timeout_s = 60.0
            return hung, await runner.step(Quick(), ModelTurn(0, ""))

    try:
        hung, quick = asyncio.run(two_steps())
    finally:
        release.set()
    assert hung.reason is TerminationReason.TIMEOUT
    assert quick.reason is TerminationReason.ENV_DONE and quick.reward == 1.0  # not queued behind the hung one
