"""Per-episode turns through the vLLM engine (``collect/turns.py``: each
episode's next turn added to vLLM's running batch as soon as its environment answered, through the
server's ``turns`` operation), over the BPE tokenizer trained here: the rows do not depend on when
the environments answer, every stored log-prob is the teacher-forced one over its whole trajectory,
greedy episodes are our loop's token for token, and a kill -9 of the engine mid-round gives the same
rows; the same through a vLLM server at a URL (one HTTP request per turn). One engine serves the
module; skipped where the vLLM environment is absent."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from rlhf_pipeline.agents.calculator import CalculatorEnv, multiply, product_tasks
from rlhf_pipeline.agents.tools import ToolBox, parser_for_template
from rlhf_pipeline.bench.vllm_server_process import VLLMServerProcess, save_model_dir
from rlhf_pipeline.collect import Collector, CollectorConfig, Environments, TaskSource
from rlhf_pipeline.generation import SamplingConfig
from rlhf_pipeline.generation.restarts import Restarts
from rlhf_pipeline.generation.settings import find_vllm_python
from rlhf_pipeline.generation.vllm_engine import VLLMEngine
from rlhf_pipeline.generation.vllm_url import VLLMURLEngine
from rlhf_pipeline.models import tiny_causal_lm

from helpers import killed_with_next_request, process_running
from test_vllm_rollout import LIMITS, LOG_PROB_TOLERANCE, recompute_difference, sent_prompt_tokens, sharp_model, trajectories

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy(bpe_tokenizer):
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
                                   work_dir=tmp_path_factory.mktemp("vllm-turns"))
    yield served
    served.close()


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
    """3 tasks x 2 episodes a round, each environment step delayed at random in ``delay_s``
    (``delay_seed``); the rows come back from ``collect()``."""
    config = CollectorConfig(tasks_per_round=3, group_size=2, sampling=sampling, seed=seed)
    tasks = TaskSource(product_tasks(12, seed=1), seed=0, required_fields=("question", "answer"))
    delays, lock = random.Random(delay_seed), threading.Lock()
    episodes = Environments(lambda: SlowCalculator(box, delays, lock, delay_s), limits=LIMITS,
                            parser=parser_for_template(tokenizer.chat_template))
    return Collector(sampler, tokenizer, tasks, episodes, sink=None, config=config)


@pytest.fixture(scope="module")
def box():
    toolbox = ToolBox([multiply])
    yield toolbox
    toolbox.close()


def assert_same_rows(a, b) -> None:
    for name in ("prompt_tokens", "response_tokens"):
        assert [r.tolist() for r in a[name].to_list()] == [r.tolist() for r in b[name].to_list()], name
    for name in ("trajectory_id", "group_id", "step", "done", "termination_reason", "policy_version"):
        assert a[name].tolist() == b[name].tolist(), name
    assert float((a["response_log_probs"].values - b["response_log_probs"].values).abs().max()) < LOG_PROB_TOLERANCE


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


def test_greedy_turns_through_vllm_are_the_loop_engines_ones(engine, policy, bpe_tokenizer, box):
    """top_k=1: seeds do not matter, so turns through vLLM must give our loop's episodes token for
    token, with the same masks: nothing re-tokenized, dropped or added."""
    sampling = SamplingConfig(top_k=1)
    sharp = sharp_model(bpe_tokenizer)
    engine.load_weights(sharp.state_dict(), engine.policy_version + 1)
    try:
        through_vllm = collector(engine, bpe_tokenizer, box, sampling, delay_seed=3).collect()
    finally:
        engine.load_weights(policy.state_dict(), engine.policy_version + 1)
    through_loop = collector(sharp, bpe_tokenizer, box, sampling).collect()
    for name in ("prompt_tokens", "response_tokens"):
        assert [r.tolist() for r in through_vllm[name].to_list()] == [r.tolist() for r in through_loop[name].to_list()]
    for name in ("trajectory_id", "step", "done", "terminated", "truncated", "termination_reason"):
        assert through_vllm[name].tolist() == through_loop[name].tolist(), name
    loop_rebuilt = trajectories(through_loop)
    for t, rebuilt in trajectories(through_vllm).items():
        assert rebuilt.token_ids.tolist() == loop_rebuilt[t].token_ids.tolist()
        assert rebuilt.loss_mask.tolist() == loop_rebuilt[t].loss_mask.tolist()


def test_an_engine_killed_mid_round_is_restarted_and_the_turns_in_flight_sent_again(engine, bpe_tokenizer, box):
    sampling = SamplingConfig()
    said: list[str] = []
    kept, engine.restarts = engine.restarts, Restarts(max_restarts=2, backoff_s=0.1, announce=said.append)
    try:
        plain = collector(engine, bpe_tokenizer, box, sampling, delay_seed=4, seed=7).collect()
        pid = engine.pid
        with killed_with_next_request(engine) as kill_sent:
            killed = collector(engine, bpe_tokenizer, box, sampling, delay_seed=5, seed=7).collect()
        assert kill_sent.is_set()
        assert engine.pid != pid and not process_running(pid)
        assert len(said) == 1 and "died" in said[0], said
        assert_same_rows(plain, killed)
    finally:
        engine.restarts = kept


def test_environments_slower_than_hung_after_s_are_not_a_hung_engine(engine, bpe_tokenizer, box):
    """While every environment works the engine has no turn to decode; it says it is alive meanwhile, so
    a wait longer than ``generation.hung_after_s`` is not taken for a hang (no kill, no restart)."""
    said: list[str] = []
    kept, engine.restarts = engine.restarts, Restarts(max_restarts=0, hung_after_s=1.0, announce=said.append)
    pid = engine.pid
    try:
        rows = collector(engine, bpe_tokenizer, box, SamplingConfig(), delay_s=(1.5, 1.6), seed=3).collect()
    finally:
        engine.restarts = kept
    assert int(rows["step"].max()) >= 1  # episodes waited 1.5 s for their environment more than once
    assert engine.pid == pid and not said


def test_per_episode_turns_through_a_server_at_a_url(policy, bpe_tokenizer, box, tmp_path_factory):
    """One HTTP request per turn, each seeded from its episode's generator: the rows do not depend on
    environment timing either, and every log-prob is the teacher-forced one over its whole trajectory."""
    try:
        python = find_vllm_python(None)
    except ValueError as exc:
        pytest.skip(f"needs the vLLM environment: {exc}")
    work = tmp_path_factory.mktemp("vllm-url-turns")
    server = VLLMServerProcess(python, save_model_dir(policy, bpe_tokenizer, work / "model"), work)
    try:
        # no tokenizer check: the vLLM environment's transformers reads the BPE tokenizer trained here with
        # other merges, and token in, token out the server tokenizes nothing of ours
        engine = VLLMURLEngine(server.url, policy, stop_token_ids=[bpe_tokenizer.eos_token_id])
        try:
            sampling = SamplingConfig()
            first = collector(engine, bpe_tokenizer, box, sampling, delay_seed=1, seed=5)
            rows = first.collect()
            again = collector(engine, bpe_tokenizer, box, sampling, delay_seed=2, seed=5).collect()
            assert_same_rows(rows, again)
            assert int(rows["step"].max()) >= 1
            assert first.last_metrics["generation_batches"] == len(rows)  # one request per turn
            assert recompute_difference(policy, rows, sampling) < LOG_PROB_TOLERANCE
            assert recompute_difference(policy, rows, sampling, later_turns_only=True) < LOG_PROB_TOLERANCE
        finally:
            engine.close()
    finally:
        server.stop()
