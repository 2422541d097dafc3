"""Per-episode turns (``collect/turns.py``): each episode's next turn sent as soon as its environment
answered, with our loop engine. The rows must not depend on when the environments answer, nor on a
round started while the one before it still ran, and a round cut between two appends resumes to them."""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest
import torch

from rlhf_pipeline.collect.turns import EngineTurns
from rlhf_pipeline.generation.engine import SampleRequest, draw_seed
from rlhf_pipeline.generation.loop import LoopEngine
from rlhf_pipeline.generation.sampling import SamplingConfig
from rlhf_pipeline.storage import make_replay_buffer
from rlhf_pipeline.transforms.group_advantage import GroupAdvantage

from agent_setup import GROUP_SIZE, TurnsEnv, agent_collector, open_or_create, tiny_policy
from helpers import resume
import preloaded

ROUNDS = 2
TASKS_PER_ROUND = 3


class Crash(Exception):
    """Stands for kill -9: nothing after the raise point runs (the restart is a fresh collector)."""


class SlowEnv(TurnsEnv):
    """``TurnsEnv`` whose every step sleeps a random while (``delays``: a seeded ``random.Random``) and
    says which episode stepped when (``log``: its creation ordinal and turn index, in the order steps ran)."""

    def __init__(self, toolbox, ordinal: int, delays: random.Random, log: list, lock: threading.Lock):
        super().__init__(toolbox)
        self.ordinal, self.delays, self.log, self.lock = ordinal, delays, log, lock

    def step(self, turn):
        with self.lock:
            delay = self.delays.uniform(0.0, 0.03)
        time.sleep(delay)
        with self.lock:
            self.log.append((self.ordinal, turn.index))
        return super().step(turn)


@pytest.fixture(scope="module")
def policy():
    return tiny_policy()


def run_rounds(policy, where, rounds, *, delay_seed=0, crash_at_append=None, ahead=False):
    """Collects like ``collect_main`` does, each environment step delayed at random (``delay_seed``);
    ``crash_at_append=k``: stop right after the k-th append; ``ahead``: every round lets the next one
    start once its first group ended. Returns the stored rows, the appends of each round and the order
    environment steps ran in."""
    store = open_or_create(where / "buffer")
    buffer = make_replay_buffer(store, batch_size=4, transforms=[GroupAdvantage(GROUP_SIZE)])
    appends, per_round, log, lock = [], [], [], threading.Lock()
    delays, ordinals = random.Random(delay_seed), itertools.count()

    def sink(batch, writer_state):
        if crash_at_append is not None and len(appends) >= crash_at_append:
            raise Crash  # another episode's group, after the crash: nothing after a kill runs
        buffer.extend(batch, writer_state=writer_state)
        appends.append(0 if batch is None else len(batch))
        if len(appends) == crash_at_append:
            raise Crash

    collector = agent_collector(*policy, None, sink=sink, tasks_per_round=TASKS_PER_ROUND,
                                make_env=lambda toolbox: SlowEnv(toolbox, next(ordinals), delays, log, lock))
    resume(collector, store)
    try:
        for done in range(rounds):
            before = len(appends)
            collector.collect(next_round=lambda _rows, done=done: ahead and done + 1 < rounds)
            per_round.append(appends[before:])
    except Crash:
        pass
    rows = store.read(torch.arange(len(store))) if len(store) else None
    store.close()
    return rows, per_round, log, collector


@pytest.fixture(scope="module")
def reference(policy, tmp_path_factory):
    """Rounds under one seed of environment delays."""
    return run_rounds(policy, tmp_path_factory.mktemp("per-episode"), ROUNDS, delay_seed=1)


def test_rows_do_not_depend_on_when_environments_answer(policy, tmp_path, reference):
    rows, _, log, collector = reference
    again, _, other_log, _ = run_rounds(policy, tmp_path, ROUNDS, delay_seed=2)
    assert log != other_log  # the episodes really stepped in another order
    assert sorted(log) == sorted(other_log)
    assert again.equal(rows)  # ids, log-probs, rewards, masks: bit for bit
    metrics = collector.last_metrics
    assert metrics["generation_batches"] == metrics["turns_per_episode"] * TASKS_PER_ROUND * GROUP_SIZE  # one per turn
    assert 0.0 <= metrics["engine_idle_share"] <= 1.0


@pytest.mark.parametrize("crash_at_append", [1, 2, 3])
def test_a_crash_between_two_appends_resumes_to_the_same_rows_each_trajectory_once(policy, tmp_path, reference,
                                                                                   crash_at_append):
    rows, appends, _, _ = reference
    cut, _, _, _ = run_rounds(policy, tmp_path, ROUNDS, delay_seed=4, crash_at_append=crash_at_append)
    # how a round splits into appends follows the timing; what is stored is a prefix of the rows, whole groups
    assert cut.equal(rows.select(torch.arange(len(cut))))
    assert len(cut) == len(rows) or int(rows["group_id"][len(cut)]) != int(cut["group_id"][-1])
    round_ends = [sum(sum(a) for a in appends[:r]) for r in range(ROUNDS + 1)]
    finished = max(r for r, end in enumerate(round_ends) if end <= len(cut))
    again, _, _, _ = run_rounds(policy, tmp_path, ROUNDS - finished, delay_seed=5)
    assert again.equal(rows)  # each trajectory once, none skipped, the same rows


def test_an_agent_round_started_ahead_gives_the_rows_of_rounds_run_one_after_the_other(policy, tmp_path, reference):
    rows, _, _, collector = reference
    ahead, _, _, ahead_collector = run_rounds(policy, tmp_path, ROUNDS, delay_seed=3, ahead=True)
    assert ahead.equal(rows)  # bit for bit: the two rounds never shared a batch of our loop
    assert ahead_collector.last_metrics["submitted_ahead"] == 1.0 and collector.last_metrics["submitted_ahead"] == 0.0


@pytest.mark.parametrize("crash_at_append", [2, 4])
def test_a_crash_with_two_agent_rounds_in_flight_resumes_to_the_same_rows(policy, tmp_path, reference, crash_at_append):
    rows, appends, _, _ = reference
    cut, _, _, _ = run_rounds(policy, tmp_path, ROUNDS, delay_seed=6, crash_at_append=crash_at_append, ahead=True)
    assert cut.equal(rows.select(torch.arange(len(cut))))
    round_ends = [sum(sum(a) for a in appends[:r]) for r in range(ROUNDS + 1)]
    finished = max(r for r, end in enumerate(round_ends) if end <= len(cut))
    again, _, _, _ = run_rounds(policy, tmp_path, ROUNDS - finished, delay_seed=7, ahead=True)
    assert again.equal(rows)  # each trajectory once, none skipped, the same rows


def test_each_episode_draws_from_its_own_seed(policy):
    model, tokenizer = policy
    engine = LoopEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    generator = torch.Generator().manual_seed(0)
    seeds = [draw_seed(generator) for _ in range(3)]
    turns = EngineTurns(engine, SamplingConfig(temperature=1.5))
    prompt = tokenizer("Say something.", add_special_tokens=False)["input_ids"]

    def ask(order):
        round_ = turns.round(3)
        futures = {k: round_.ask(SampleRequest(prompt, n=1, max_new_tokens=8), seeds[k]) for k in order}
        return {k: tuple(future.result().completions[0].token_ids) for k, future in futures.items()}

    forward, backward = ask([0, 1, 2]), ask([2, 1, 0])
    engine.close()
    assert forward == backward  # each episode's turn is its seed's, whatever came before it
    assert len(set(forward.values())) > 1


def test_two_rounds_in_flight_never_share_a_batch_of_our_loop(policy):
    """A round asked for while another has requests queued in our loop waits in the collector until the
    engine took them, so the loop decodes the two apart (the first's answers all come before any of the
    second's, though the second's are one token long), and each round's answers are the ones it gets
    alone, log-probs bit for bit."""
    model, tokenizer = policy
    engine = LoopEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    turns = EngineTurns(engine, SamplingConfig(temperature=1.5))
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("Say something.", "Hi", "Why?")]
    first_request = [SampleRequest(prompts[k], n=2, max_new_tokens=8) for k in (0, 1)]
    second_request = [SampleRequest(prompts[k], n=2, max_new_tokens=1) for k in (2, 1)]

    def answers(futures):
        return [(c.token_ids, c.log_probs) for f in futures for c in f.result().completions]

    def alone(requests):
        round_ = turns.round(2)
        return answers([round_.ask(request, 10 + k) for k, request in enumerate(requests)])

    first_alone, second_alone = alone(first_request), alone(second_request)
    first, second, order = turns.round(2), turns.round(2), []

    def ask(round_, name, request, seed):
        future = round_.ask(request, seed)
        future.add_done_callback(lambda _f: order.append(name))  # before it can be answered: flushed later
        return future

    asked = [ask(first, "first", first_request[0], 10)]  # queued in the loop until the other unit asks
    later = [ask(second, "second", request, 10 + k) for k, request in enumerate(second_request)]  # held
    asked.append(ask(first, "first", first_request[1], 11))  # every unit of the first round waits: it flushes
    assert answers(asked) == first_alone and answers(later) == second_alone
    engine.close()
    assert order == ["first", "first", "second", "second"]


def test_the_settings_of_the_round_shapes_are_refused_naming_why(tmp_path):
    """``generation.stream_groups``, ``overlap_rounds`` and ``agent_turns`` went with the one collector: a
    run given one is refused in one line saying what it does now, before anything starts."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    for setting, says in (("stream_groups=true", "each group as soon as it and every group before it ended"),
                          ("overlap_rounds=true", "while this round's tail decodes"),
                          ("agent_turns=per_episode", "as soon as its environment answered")):
        result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run",
                                 str(repo / "pipelines" / "default.py"), "--steps", "1", "--home", str(tmp_path),
                                 "--set", f"generation.{setting}"], cwd=repo, capture_output=True, text=True,
                               timeout=300)
        assert result.returncode != 0
        lines = result.stderr.strip().splitlines()
        name = setting.split("=")[0]
        assert len(lines) == 1 and f"setting 'generation.{name}' was removed: " in lines[0] and says in lines[0], \
            result.stderr
    assert not any(tmp_path.iterdir())  # no run directory: refused before anything started
