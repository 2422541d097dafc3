"""One episode's failure costs its group, not the round: an environment that raises in ``reset`` or
``step``, or gives a reward that is not finite, drops its group (counted by reason, said on
stderr), the other groups are written, a resumed collector drops the same groups and writes the
same rows, and past a rate the user sets the run stops with one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from agent_setup import open_or_create, tiny_policy

from rlhf_pipeline.agents.environment import StepResult
from rlhf_pipeline.agents.episode import EpisodeLimits
from rlhf_pipeline.collect import Collector, CollectorConfig, Environments, SamplingConfig, TaskSource
from rlhf_pipeline.collect.rewards import EpisodeFailureRateError
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.storage import make_replay_buffer
from rlhf_pipeline.transforms.group_advantage import GroupAdvantage
from helpers import into

REPO = Path(__file__).resolve().parents[2]
GROUP = 2


class Flaky:
    """Two turns; fails as its task says: ``reset`` raises, ``step`` raises at the second turn, a NaN
    reward at the first, (``"odd"``) a NaN reward whenever the sampled text has odd length, or
    (``"huge"``) a finite reward that float32, in which rewards are stored, cannot hold."""

    def reset(self, task):
        self.fail = task["fail"]
        if self.fail == "reset":
            raise ConnectionError("sandbox gone")
        return [{"role": "user", "content": task["question"]}]

    def step(self, turn):
        if self.fail == "step" and turn.index == 1:
            raise KeyError("missing")
        nan = (self.fail == "nan" and turn.index == 0) or (self.fail == "odd" and len(turn.text) % 2)
        reward = float("nan") if nan else 1e300 if self.fail == "huge" else float(len(turn.text) % 3)
        if turn.index == 1:
            return StepResult(reward=reward, done=True)
        return StepResult([{"role": "user", "content": "more"}], reward=reward)


def collector(model, tokenizer, tasks, store=None, *, sink=None, **config):
    if sink is None:
        sink = make_replay_buffer(store, batch_size=4, transforms=[GroupAdvantage(GROUP)]).extend
    settings = dict(tasks_per_round=3, group_size=GROUP, seed=7, max_failed_group_fraction=None,
                    sampling=SamplingConfig(temperature=1.5))
    episodes = Environments(Flaky, limits=EpisodeLimits(max_turns=2, max_new_tokens=5, end_on_cut_turn=False))
    return Collector(model, tokenizer, TaskSource(tasks, seed=2), episodes, sink,
                     CollectorConfig(**{**settings, **config}))


FAILS = ["none", "reset", "none", "step", "nan", "none"]
TASKS = [{"question": f"Q{k}", "fail": fail} for k, fail in enumerate(FAILS)]


def test_a_failed_episode_drops_its_group_and_the_round_writes_the_others(tmp_path, capsys):
    model, tokenizer = tiny_policy()
    store = open_or_create(tmp_path / "buffer")
    seen = []
    agents = collector(model, tokenizer, TASKS, store)
    agents.hooks.append(seen.append)
    batches = [agents.collect() for _ in range(2)]  # the six tasks, one epoch
    rows = store.read(torch.arange(len(store)))
    store.close()

    order = [t["fail"] for t in TaskSource(TASKS, seed=2).next_batch(6)]
    kept_groups = [g for g, fail in enumerate(order) if fail == "none"]
    assert sorted(set(rows["group_id"].tolist())) == kept_groups  # dropped groups' ids stay unused
    assert len(rows) == sum(len(b) for b in batches) == 3 * GROUP * 2  # whole groups of two-turn episodes
    assert sorted(set(rows["trajectory_id"].tolist())) == [g * GROUP + j for g in kept_groups for j in range(GROUP)]
    assert torch.isfinite(rows["advantage"]).all()  # the write path saw whole groups only

    assert sum(m["groups_dropped"] for m in seen) == 3 and seen[-1]["groups_dropped_total"] == 3
    for reason in ("reset_failed", "step_failed", "non_finite_reward"):
        assert sum(m.get(f"dropped/{reason}", 0) for m in seen) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if "dropped group" in line]
    assert len(lines) == 3
    assert any("(reset_failed): Flaky.reset raised ConnectionError: sandbox gone at test_agent_failures.py:" in line
               for line in lines), lines
    assert any("(step_failed): Flaky.step raised KeyError: 'missing' at test_agent_failures.py:" in line
               for line in lines), lines
    assert any("(non_finite_reward): Flaky.step gave reward nan at turn 0" in line for line in lines), lines


def test_a_reward_beyond_float32s_range_drops_its_group_as_a_nan_does(tmp_path, capsys):
    """1e300 passed the check for NaN and infinity, then was stored as float32's infinity."""
    model, tokenizer = tiny_policy()
    store = open_or_create(tmp_path / "buffer")
    tasks = [{"question": "Q0", "fail": "huge"}, {"question": "Q1", "fail": "none"}, {"question": "Q2", "fail": "none"}]
    collector(model, tokenizer, tasks, store).collect()
    rows = store.read(torch.arange(len(store)))
    store.close()
    assert len(rows) == 2 * GROUP * 2 and torch.isfinite(rows["reward"]).all()
    lines = [line for line in capsys.readouterr().err.splitlines() if "dropped group" in line]
    assert len(lines) == 1 and ("(non_finite_reward): Flaky.step gave reward 1e+300, beyond float32's range "
                                "(±3.4e38), in which rewards are stored, at turn 0") in lines[0], lines


def test_a_resumed_collector_drops_the_same_groups_and_writes_the_same_rows(tmp_path):
    """Failures here depend on the sampled text too ("odd"); a collector restored from the state
    saved before a round replays it from the same RNG state: the same drops, the same rows."""
    model, tokenizer = tiny_policy()
    tasks = [{"question": f"Q{k}", "fail": "odd" if k % 2 else "none"} for k in range(9)]
    reference, resumed = [], []
    uninterrupted = collector(model, tokenizer, tasks, sink=into(reference))
    dropped = []
    for _ in range(3):
        uninterrupted.collect()
        dropped.append(uninterrupted.last_metrics["groups_dropped"])
    assert sum(dropped) > 0  # the premise: some groups failed on what was sampled
    first = collector(model, tokenizer, tasks, sink=into(resumed))
    first.collect()
    again = collector(model, tokenizer, tasks, sink=into(resumed))
    again.load_state_dict(first.state_dict())
    again.collect()
    again.collect()
    assert again.groups_dropped == uninterrupted.groups_dropped == sum(dropped)
    # the same rows; how a round splits into appends follows the environments' timing
    assert TrajectoryBatch.cat(resumed).equal(TrajectoryBatch.cat(reference))


def test_a_round_with_every_group_dropped_writes_nothing_and_moves_on():
    model, tokenizer = tiny_policy()
    calls = []
    agents = collector(model, tokenizer, [{"question": "Q", "fail": "reset"}], sink=into(calls), tasks_per_round=2)
    assert agents.collect() is None and calls == []
    state = agents.state_dict()
    assert (state["groups_emitted"], state["trajectories_emitted"], state["groups_dropped"]) == (2, 2 * GROUP, 2)
    assert agents.last_metrics["rows"] == 0 and agents.last_metrics["dropped/reset_failed"] == 2


def test_past_the_failure_rate_collect_raises_one_line_after_writing_the_round(tmp_path):
    model, tokenizer = tiny_policy()
    written = []
    tasks = [{"question": "a", "fail": "step"}, {"question": "b", "fail": "none"}, {"question": "c", "fail": "nan"}]
    agents = collector(model, tokenizer, tasks, sink=into(written), max_failed_group_fraction=0.25,
                       failure_rate_min_groups=4)
    with pytest.raises(EpisodeFailureRateError) as raised:
        agents.collect()  # 2 of 3 groups dropped: more than 0.25 of at least 4
    message = str(raised.value)
    assert "\n" not in message and message.startswith("2 of 3 groups were dropped over failed episodes")
    assert "max_failed_group_fraction=0.25" in message
    assert "(counted over at least 4 groups: 2 of 4 is past it already)" in message  # not 2 of 3: why it stops now
    good = [t["fail"] for t in TaskSource(tasks, seed=2).next_batch(3)].index("none")
    assert len(written) == 1 and set(written[0]["group_id"].tolist()) == {good}  # the good group was written
    below = collector(model, tokenizer, tasks, sink=into(written), max_failed_group_fraction=0.7,
                      failure_rate_min_groups=1)
    below.collect()  # 2 of 3 is below 0.7: the run goes on
    with pytest.raises(ValueError, match="'CollectorConfig.max_failed_group_fraction' must be in \\[0, 1\\] or none"):
        CollectorConfig(max_failed_group_fraction=1.5)


def test_collect_stops_the_run_with_one_line_when_failures_pass_the_rate(tmp_path, capsys):
    """Through the collector process's own loop (``collect_main``, in this process): the line, exit
    code 1, the round logged; ``run`` then stops the learner and says the collector exited early."""
    from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
    from rlhf_pipeline.runs.processes import build_pipeline, collect_main
    from rlhf_pipeline.runs.run_directory import prepare_run

    module = load_pipeline_module(str(REPO / "pipelines" / "tool_use.py"))
    settings = make_settings(module, ["warm_start_steps=0", "tasks_per_round=2", "group_size=2",
                                      "max_new_tokens=8", "max_failed_group_fraction=0.0", "log_rounds_every=0"])
    paths = RunPaths(tmp_path / "run")
    pipeline = build_pipeline(module, settings, paths)
    make = pipeline.collector

    def failing_collector(**parts):
        made = make(**parts)
        made.episodes.make_env = lambda: Flaky()  # every task lacks "fail": each reset raises KeyError
        return made

    pipeline = dataclasses.replace(pipeline, collector=failing_collector)
    prepare_run(pipeline, paths)
    capsys.readouterr()
    assert collect_main(pipeline, paths, rounds=5) == 1
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "stopped: " in line]
    assert line.startswith("[collector] stopped: 2 of 2 groups were dropped over failed episodes, more than "
                           "max_failed_group_fraction=0 allows"), line
    assert "reset_failed: Flaky.reset raised KeyError: 'fail'" in line
    (logged,) = read_metrics(paths.collector_metrics(0))
    assert logged["groups_dropped"] == 2 and logged["rows_written"] == 0
