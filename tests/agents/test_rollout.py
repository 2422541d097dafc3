"""Rollouts: many episodes, batched generation, concurrent environments, rows in a real store.

One test drives a scripted model that uses the tool; one samples from a real (random) tiny
``transformers`` model and checks the stored trajectories against a teacher-forced forward pass:
the stored log-probs are those of the stored ids in their stored context, token for token; and
the learner, reading those rows back as whole trajectories, scores every sampled token in the
context it was sampled in (ratios 1 before any update).
"""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch
from agent_scripts import scripted_sampler

from rlhf_pipeline.agents.calculator import CalculatorEnv, multiply, product_tasks
from rlhf_pipeline.agents.environment import StepResult
from rlhf_pipeline.agents.episode import EpisodeLimits, rebuild_trajectory
from rlhf_pipeline.agents.rollout import RolloutConfig, rollout
from rlhf_pipeline.agents.tools import ToolBox, parser_for_template
from rlhf_pipeline.collect import SamplingConfig, generate
from rlhf_pipeline.learn.loss import grpo_packed_loss, grpo_step_loss
from rlhf_pipeline.learn.packed_attention import use_packed_attention
from rlhf_pipeline.learn.samplers.exact import ExactUseSampler
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.learn.step import plan_step
from rlhf_pipeline.learn.trajectories import trajectory_draw
from rlhf_pipeline.models import tiny_causal_lm
from rlhf_pipeline.schema import StoreSchema, TerminationReason
from rlhf_pipeline.schema.padding import PaddedCollator
from rlhf_pipeline.storage import create_store
from rlhf_pipeline.transforms.group_advantage import GroupAdvantage

CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'


def write_and_read(path, batch):
    store = create_store(path, "memmap", schema=StoreSchema(optional=("termination_reason",)))
    store.append(batch)
    rows = store.read(torch.arange(len(store)))
    store.close()
    return rows


def test_a_scripted_agent_uses_the_tool_and_its_episodes_reach_a_store(tmp_path, bpe_tokenizer):
    box = ToolBox([multiply])
    tasks = [{"question": "What is 12 * 34?", "answer": "408"}, {"question": "What is 12 * 35?", "answer": "420"}]
    result = rollout(tasks, lambda: CalculatorEnv(box), scripted_sampler(bpe_tokenizer, [CALL, "the answer is 408"]),
                     bpe_tokenizer, RolloutConfig(group_size=3), parser=parser_for_template(bpe_tokenizer.chat_template))
    assert [e.reason for e in result.episodes] == [TerminationReason.ENV_DONE] * 6
    assert [e.rewards for e in result.episodes] == [[0.0, 1.0]] * 3 + [[0.0, 0.0]] * 3
    m = result.metrics
    assert m["tool_calls"] == m["tools/ok"] == 6 and m["turns"] == 12 and m["generation_batches"] == 12  # per turn
    assert m["generated_rows"] == 12 and m["template_mismatch"] == 0 and m["retokenization_drift"] == 6

    rows = write_and_read(tmp_path / "buffer", result.to_batch(first_group_id=10, first_trajectory_id=100, policy_version=2))
    assert rows["group_id"].tolist() == [10] * 6 + [11] * 6 and rows["step"].tolist() == [0, 1] * 6
    for k, episode in enumerate(result.episodes):
        rebuilt = rebuild_trajectory(rows.select(torch.nonzero(rows["trajectory_id"] == 100 + k).flatten()))
        assert rebuilt.token_ids.tolist() == episode.token_ids and rebuilt.loss_mask.tolist() == [bool(x) for x in episode.loss_mask]
    box.close()


def test_async_environments_step_concurrently(bpe_tokenizer):
    """Every episode's step waits at a barrier for all 16: stepped one after another, the first
    would wait past its step timeout (and its episode end with TIMEOUT); stepped together, all pass."""
    barrier = None

    class MeetingAsync(CalculatorEnv):
        async def step(self, turn):
            nonlocal barrier
            barrier = barrier or asyncio.Barrier(16)  # made on the rollout's own event loop
            await barrier.wait()
            return StepResult([{"role": "user", "content": "more"}]) if turn.index == 0 else StepResult(done=True)

    result = rollout([{"question": "q", "answer": "1"}] * 4, MeetingAsync, scripted_sampler(bpe_tokenizer, ["a", "b"]),
                     bpe_tokenizer, RolloutConfig(group_size=4, step_timeout_s=5.0))
    assert len(result.episodes) == 16 and all(len(e.turns) == 2 for e in result.episodes)
    assert all(e.reason is TerminationReason.ENV_DONE for e in result.episodes)
    assert result.metrics["environment_timeouts"] == 0


def test_an_episode_past_its_wall_clock_limit_ends_with_timeout(bpe_tokenizer):
    """The limit is read on a clock each episode's own environment moves: each of its steps takes a
    second of it, so with a limit of 1.5 s every episode is overdue after its second step, however fast
    the machine and whatever the other episode's steps did meanwhile."""
    envs: list[Endless] = []  # in the order the rollout builds them: episode k's is envs[k]

    class Endless(CalculatorEnv):  # answers every turn and never ends the episode
        def __init__(self):
            super().__init__()
            self.seconds = 0.0
            envs.append(self)

        def step(self, turn):
            self.seconds = turn.index + 1.0  # this episode's clock: one second per step
            return StepResult([{"role": "user", "content": "go on"}], reward=0.25)

    limits = EpisodeLimits(max_turns=1000, max_new_tokens=8)
    result = rollout([{"question": "q", "answer": "1"}], Endless, scripted_sampler(bpe_tokenizer, ["a"] * 1000),
                     bpe_tokenizer, RolloutConfig(group_size=2, limits=limits, episode_timeout_s=1.5),
                     clock=lambda k: envs[k].seconds)
    assert len(result.episodes) == 2
    for episode in result.episodes:
        assert episode.reason is TerminationReason.TIMEOUT and episode.reason.truncated
        assert len(episode.turns) == 2 and episode.rewards == [0.25, 0.25]  # the last step's reward is kept
        assert episode.segments[-1].sampled  # the overdue step's messages ("go on") are dropped
    assert result.metrics["episode_timeouts"] == 2 and result.metrics["reason/timeout"] == 2


@pytest.fixture(scope="module")
def tiny_lm(bpe_tokenizer):
    return tiny_causal_lm(len(bpe_tokenizer), hidden_size=32, num_layers=1, num_heads=2,
                          max_position_embeddings=1024, pad_token_id=bpe_tokenizer.pad_token_id,
                          eos_token_id=bpe_tokenizer.eos_token_id, seed=3)


def real_model_rollout(bpe_tokenizer, tiny_lm):
    """Three tasks, two episodes each, sampled from the tiny model (several turns, one nudge), each
    turn from its episode's own seed."""
    eos = bpe_tokenizer.eos_token_id
    turns_taken: dict[int, int] = {}

    async def sample_turn(episode, prompt, limit):
        turn = turns_taken[episode] = turns_taken.get(episode, -1) + 1
        gen = generate(tiny_lm, [prompt], SamplingConfig(max_new_tokens=limit), pad_token_id=bpe_tokenizer.pad_token_id,
                       eos_token_id=eos, generator=torch.Generator().manual_seed(1000 * episode + turn))
        return gen.response_tokens.row(0).tolist(), gen.response_log_probs.row(0).tolist()

    box = ToolBox([multiply])
    limits = EpisodeLimits(max_turns=3, max_new_tokens=12, context_length=400, end_on_cut_turn=False)
    result = rollout(product_tasks(3, seed=1), lambda: CalculatorEnv(box, nudges=1), sample_turn,
                     bpe_tokenizer, RolloutConfig(group_size=2, limits=limits), parser=parser_for_template(bpe_tokenizer.chat_template))
    box.close()
    return result


def test_a_real_model_rollout_stores_exactly_what_it_sampled(tmp_path, bpe_tokenizer, tiny_lm):
    torch.set_num_threads(1)
    result = real_model_rollout(bpe_tokenizer, tiny_lm)
    episodes = result.episodes
    assert len(episodes) == 6 and all(e.done for e in episodes)
    assert result.metrics["generated_rows"] == sum(len(e.turns) for e in episodes) > 6  # multi-turn
    assert result.metrics["generation_batches"] == result.metrics["generated_rows"]  # one request per turn
    # the random model's samples are not what its tokenizer would encode: re-tokenizing drifts
    assert result.metrics["retokenization_drift"] > 0

    rows = write_and_read(tmp_path / "buffer", result.to_batch(first_group_id=0, first_trajectory_id=0, policy_version=0))
    for k, episode in enumerate(episodes):
        rebuilt = rebuild_trajectory(rows.select(torch.nonzero(rows["trajectory_id"] == k).flatten()))
        assert rebuilt.token_ids.tolist() == episode.token_ids
        # teacher-forced over the stored sequence, the model gives back the stored log-probs
        ids = rebuilt.token_ids.long()[None]
        with torch.no_grad():
            logp = torch.log_softmax(tiny_lm(input_ids=ids).logits.float()[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = rebuilt.loss_mask[1:]
        assert mask.sum() == sum(len(t) for t in (s.ids for s in episode.segments if s.sampled))
        torch.testing.assert_close(logp[mask], rebuilt.log_probs[1:][mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("packing", [False, True])
def test_the_learner_trains_a_stored_rollout_on_the_context_it_was_sampled_in(tmp_path, bpe_tokenizer, tiny_lm,
                                                                             packing):
    """Rollout -> group advantage -> a real store -> whole trajectories -> the learner's forward:
    before any update, the learner's log-probs of every sampled token, in the one sequence it
    trains per trajectory, are the sampler's (ratios 1), and nothing but sampled tokens counts."""
    torch.set_num_threads(1)
    result = real_model_rollout(bpe_tokenizer, tiny_lm)
    rows = GroupAdvantage(group_size=2).write(result.to_batch(first_group_id=0, first_trajectory_id=0,
                                                              policy_version=0))
    store = create_store(tmp_path / "buffer", "memmap",
                         schema=StoreSchema(optional=("advantage", "termination_reason")))
    store.append(rows)
    sampler = ExactUseSampler(store, batch_size=len(store))
    sampled = sampler.draw(0)
    drawn = PaddedCollator(pad_token_id=bpe_tokenizer.pad_token_id).read(store, sampled.positions)
    sampled, batch = trajectory_draw(store, sampled, drawn, pad_token_id=bpe_tokenizer.pad_token_id,
                                     turn_advantage="trajectory")
    assert sorted(batch["trajectory_id"].tolist()) == list(range(6))
    sampled_tokens = sum(len(s.ids) for e in result.episodes for s in e.segments if s.sampled)
    assert int(batch["masks", "all_assistant_mask"].sum()) == sampled_tokens
    model = copy.deepcopy(tiny_lm)
    settings = LearnerSettings(packing=packing, micro_batch_tokens=256)
    if packing:
        use_packed_attention(model)
    with torch.no_grad():
        for part in plan_step(batch, settings).micro_batches:
            step_loss = grpo_packed_loss if packing else grpo_step_loss
            _, stats = step_loss(model, part.batch)
            assert abs(float(stats["ratio_min"]) - 1) < 1e-3 and abs(float(stats["ratio_max"]) - 1) < 1e-3
            assert float(stats["clip_frac_low"]) == float(stats["clip_frac_high"]) == 0.0
    store.close()
