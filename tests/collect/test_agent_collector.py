"""The agent collector: whole groups of whole multi-turn trajectories through the write path, one
append per round; the group advantage of each trajectory's return on every turn; per-round
metrics; resume from its state, in process and after kill -9 of a real collector process."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from agent_collect_worker import collect
from agent_setup import GROUP_SIZE, agent_collector, open_or_create, tiny_policy
from tensordict import TensorDict
from torchrl.objectives.llm import MCAdvantage

from rlhf_pipeline.agents.calculator import multiply
from rlhf_pipeline.agents.environment import StepResult, ToolCall
from rlhf_pipeline.agents.episode import EpisodeLimits, rebuild_trajectory
from rlhf_pipeline.agents.tools import ToolBox
from rlhf_pipeline.collect import Collector, CollectorConfig, Environments, TaskSource
from rlhf_pipeline.dataio.trajectory_view import (
    find_trajectory,
    format_trajectory,
    trajectory_html,
)
from rlhf_pipeline.schema import TerminationReason
from rlhf_pipeline.schema.tool_errors import ToolErrorKind
from rlhf_pipeline.storage import make_replay_buffer
from rlhf_pipeline.storage.filtering import select_positions
from rlhf_pipeline.transforms.group_advantage import GroupAdvantage
from helpers import into

WORKER = Path(__file__).with_name("agent_collect_worker.py")


def stored(store):
    return store.read(torch.arange(len(store)))


def trajectories(rows):
    """trajectory id -> the row indices holding it, in stored order."""
    out: dict[int, list[int]] = {}
    for i, t in enumerate(rows["trajectory_id"].tolist()):
        out.setdefault(t, []).append(i)
    return out


def test_rounds_write_whole_groups_of_whole_trajectories_with_one_advantage_each(tmp_path):
    model, tokenizer = tiny_policy()
    store = open_or_create(tmp_path / "buffer")
    appends = []
    collector = agent_collector(model, tokenizer, store)
    sink = collector.sink
    collector.sink = lambda batch, writer_state: appends.append(len(batch)) or sink(batch, writer_state=writer_state)
    for _ in range(3):
        collector.collect()
    rows = stored(store)
    store.close()

    # groups written as they end (2 a round: one append or two), whole; nothing held back
    assert 3 <= len(appends) <= 6 and sum(appends) == len(rows)
    by_trajectory = trajectories(rows)
    assert list(by_trajectory) == list(range(3 * 2 * GROUP_SIZE))
    steps, done = rows["step"].tolist(), rows["done"].tolist()
    for t, idx in by_trajectory.items():
        assert idx == list(range(idx[0], idx[0] + len(idx)))  # contiguous ...
        assert [steps[i] for i in idx] == list(range(len(idx)))  # ... in step order
        assert [done[i] for i in idx] == [False] * (len(idx) - 1) + [True]
        assert int(rows["termination_reason"][idx[-1]]) == TerminationReason.ENV_DONE
        assert len(set(rows["group_id"][idx].tolist())) == 1
        rebuild_trajectory(rows.select(torch.tensor(idx)))  # the learner can rebuild every stored trajectory
    # TurnsEnv runs task['turns'] (1 to 3) turns: several rows per trajectory, as many as its task says
    assert {len(i) for i in by_trajectory.values()} == {1, 2, 3}

    # GroupAdvantage: each trajectory's turn rewards summed, normalized within its group, on every turn,
    # as torchrl's MCAdvantage computes it from the same trajectories in the same order
    mc = MCAdvantage(grpo_size=GROUP_SIZE, prompt_key="group_id", trajectory_return="sum")
    want: dict[int, list[float]] = {}
    for t, idx in by_trajectory.items():
        n = len(idx)
        out = mc.inv(TensorDict(group_id=rows["group_id"][idx],
                                next=TensorDict(reward=rows["reward"][idx].reshape(n, 1).float(),
                                                done=rows["done"][idx].reshape(n, 1), batch_size=[n]),
                                batch_size=[n]))
        if out is not None:  # the group is complete: its trajectories (the last GROUP_SIZE ids), in order
            flat = out["advantage"].reshape(-1).tolist()
            for u in range(t + 1 - GROUP_SIZE, t + 1):
                want[u], flat = flat[:len(by_trajectory[u])], flat[len(by_trajectory[u]):]
    assert sorted(want) == sorted(by_trajectory)
    for t, idx in by_trajectory.items():
        assert rows["advantage"][idx].tolist() == pytest.approx(want[t], abs=1e-6)
        assert len(set(want[t])) == 1  # one advantage per trajectory, copied to every turn
    expected = torch.tensor([want[t][0] for t in by_trajectory])
    assert float(expected.abs().max()) > 0  # the sampled text made returns differ within groups


def test_round_metrics_count_this_round_only(tmp_path):
    model, tokenizer = tiny_policy()
    store = open_or_create(tmp_path / "buffer")
    seen = []
    collector = agent_collector(model, tokenizer, store)
    collector.hooks.append(seen.append)
    batches = [collector.collect() for _ in range(2)]
    store.close()
    for batch, m in zip(batches, seen, strict=True):
        episodes = 2 * GROUP_SIZE
        assert m["rows"] == len(batch) == m["turns_per_episode"] * episodes
        # TurnsEnv makes one real multiply call per step: the shared ToolBox's counts, per round
        assert m["tools/calls"] == m["tools/ok"] == len(batch)
        assert sum(v for k, v in m.items() if k.startswith("reason/")) == episodes
        assert m["template_mismatch"] == 0 and "retokenization_drift" in m and m["tool_call_rate"] >= 0
        ends = batch["done"]
        assert m["reward_mean"] == pytest.approx(float(batch["reward"].sum()) / episodes)
        assert int(ends.sum()) == episodes


def test_a_restored_collector_continues_exactly(tmp_path):
    model, tokenizer = tiny_policy()
    reference = []
    first = agent_collector(model, tokenizer, None, sink=into(reference))
    for _ in range(3):
        first.collect()

    resumed_rows = []
    again = agent_collector(model, tokenizer, None, sink=into(resumed_rows))
    again.collect()
    state = again.state_dict()
    restored = agent_collector(model, tokenizer, None, sink=into(resumed_rows))
    restored.load_state_dict(state)
    restored.collect()
    restored.collect()
    for want, got in zip(reference, resumed_rows, strict=True):
        assert got.equal(want)


def _victim(store, rounds, hang_round, ready):
    return subprocess.Popen([sys.executable, str(WORKER), str(store), str(rounds), str(hang_round), str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_kill_9_mid_episode_resumes_without_duplicate_or_half_trajectories(tmp_path):
    """A collector process killed mid-episode; the uninterrupted reference and the resumed collector run
    in this process (the worker's own function: only the victim needs a process of its own)."""
    ready = tmp_path / "ready"
    victim = _victim(tmp_path / "buffer", 4, 2, ready)
    try:
        # the uninterrupted collector, meanwhile (what it samples does not depend on timing): it runs
        # while the victim starts instead of before
        collect(tmp_path / "reference", 4)
        while not ready.exists():  # the third round (index 2) has an episode at its second turn
            assert victim.poll() is None, victim.communicate()[0][-3000:]
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=60)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    store = open_or_create(tmp_path / "buffer")
    rows = stored(store)
    store.close()
    assert rows["done"].tolist()[-1]  # nothing of the round in flight: the store ends on a whole trajectory
    # two whole rounds of two groups, and of the round in flight at most the groups that had ended
    assert sorted(set(rows["group_id"].tolist())) == list(range(len(set(rows["group_id"].tolist()))))
    assert 2 * 2 <= len(set(rows["group_id"].tolist())) < 3 * 2

    collect(tmp_path / "buffer", 4)  # resumed from what the killed one's store published
    reference, resumed = open_or_create(tmp_path / "reference"), open_or_create(tmp_path / "buffer")
    want, got = stored(reference), stored(resumed)
    reference.close()
    resumed.close()
    assert got["trajectory_id"].tolist() == want["trajectory_id"].tolist()
    assert len(set(got["trajectory_id"].tolist())) == 4 * 2 * GROUP_SIZE  # every trajectory once, none doubled
    assert got.equal(want)  # the rerun round sampled what the uninterrupted collector sampled


class FailingCallsEnv:
    """Turn ``i`` of a task with ``fail = f`` runs one good ``multiply`` call and ``(f + i) % 3``
    failing ones, through a ToolBox every episode shares: a call to a tool that does not exist,
    then one with arguments ``multiply`` does not take."""

    def __init__(self, toolbox):
        self.toolbox = toolbox

    def reset(self, task):
        self.turns, self.fail = int(task["turns"]), int(task["fail"])
        return [{"role": "user", "content": task["question"]}]

    def answer(self, turn):
        calls = [ToolCall("multiply", {"a": turn.index, "b": 7}, "")]
        calls += [ToolCall("no_such_tool", {}, ""), ToolCall("multiply", {"c": 1}, "")][:(self.fail + turn.index) % 3]
        answers = self.toolbox.run(calls)
        return StepResult(reward=1.0, done=True) if turn.index + 1 >= self.turns else StepResult(answers)

    def step(self, turn):
        return self.answer(turn)


class AsyncFailingCallsEnv(FailingCallsEnv):
    async def step(self, turn):  # awaited on the event loop, not in the thread pool
        return self.answer(turn)


def test_each_turn_row_holds_its_own_tool_calls_and_failures(tmp_path):
    model, tokenizer = tiny_policy()
    store = open_or_create(tmp_path / "buffer")
    toolbox = ToolBox([multiply])
    made = []

    def make_env():  # sync and async environments in every round, stepping at the same time
        made.append(1)
        return (FailingCallsEnv if len(made) % 2 else AsyncFailingCallsEnv)(toolbox)

    tasks = [{"question": f"Q{k}", "turns": 1 + k % 3, "fail": k} for k in range(6)]
    sink = make_replay_buffer(store, batch_size=4, transforms=[GroupAdvantage(GROUP_SIZE)]).extend
    config = CollectorConfig(tasks_per_round=3, group_size=GROUP_SIZE, seed=3)
    # no parser: the turn's calls are then exactly the ones its environment ran
    episodes = Environments(make_env, limits=EpisodeLimits(max_turns=3, max_new_tokens=4, end_on_cut_turn=False))
    collector = Collector(model, tokenizer, TaskSource(tasks, seed=1), episodes, sink, config)
    seen = []
    collector.hooks.append(seen.append)
    for _ in range(2):
        collector.collect()
    rows = stored(store)

    fail_of = {}  # each trajectory's task, from its number of turns and its group's place in the rounds
    order = [t["fail"] for t in TaskSource(tasks, seed=1).next_batch(6)]
    for t, idx in trajectories(rows).items():
        group = (t // GROUP_SIZE)
        fail_of[t] = order[group]
        assert len(idx) == 1 + fail_of[t] % 3  # the premise: rows match the task they were taken for
    steps = rows["step"].tolist()
    want_errors = [(fail_of[t] + s) % 3 for t, s in zip(rows["trajectory_id"].tolist(), steps, strict=True)]
    assert rows["tool_errors"].tolist() == want_errors
    assert rows["tool_calls"].tolist() == [1 + e for e in want_errors]
    assert sum(m["tools/calls"] for m in seen) == int(rows["tool_calls"].sum())
    failures = sum(m["tools/unknown_tool"] + m["tools/bad_arguments"] for m in seen)
    assert failures == int(rows["tool_errors"].sum()) > 0
    kinds = {0: 0, 1: int(ToolErrorKind.UNKNOWN_TOOL), 2: int(ToolErrorKind.UNKNOWN_TOOL | ToolErrorKind.BAD_ARGUMENTS)}
    assert rows["tool_error_kinds"].tolist() == [kinds[e] for e in want_errors]

    # filter and show read them back
    clean = select_positions(store, "trajectory_tool_errors == 0").positions
    kept = {t for t in rows["trajectory_id"][torch.as_tensor(clean)].tolist()}
    assert kept == {t for t in fail_of if sum((fail_of[t] + s) % 3 for s in range(1 + fail_of[t] % 3)) == 0}
    failing = max(fail_of, key=lambda t: (fail_of[t] % 3, t))  # one of three turns: 2, then 0, then 1 failed
    view = find_trajectory(store, failing)
    store.close()
    text = format_trajectory(view)
    page = trajectory_html(view)  # its table: a column of calls and one of failed calls, per turn
    assert "<th>tool calls</th><th>failed</th>" in page
    assert [f"<td>{calls}</td><td>{failed}</td>" in page for calls, failed in ((3, 2), (1, 0), (2, 1))] == [True] * 3
    toolbox.close()
    turn_lines = [line for line in text.splitlines() if line.startswith("── turn ")]
    assert [" · 3 tool calls, 2 failed (unknown_tool, bad_arguments)" in turn_lines[0],
            " · 1 tool call, 0 failed ·" in turn_lines[1],
            " · 2 tool calls, 1 failed (unknown_tool)" in turn_lines[2]] == [True] * 3, turn_lines
    assert "6 tool calls, 3 failed" in text.splitlines()[1]
