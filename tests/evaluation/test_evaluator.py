"""One (version, set) evaluation into its eval store: rows, summary, resume, failures (in process,
with the default pipeline's held-out set and the tool-use pipeline's agent set on tiny models)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import different_weights

from rlhf_pipeline.evaluation.evaluator import (
    ID_STRIDE,
    MAX_ATTEMPTS,
    EvalProgress,
    Evaluation,
    eval_engine,
    open_set_store,
    set_store_location,
)
from rlhf_pipeline.coordination.eval_pins import wanted_version
from rlhf_pipeline.evaluation.settings import EvalSettings
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.generation import teacher_forced_log_probs
from rlhf_pipeline.pipeline import load_pipeline_module, make_settings

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def built(pipeline: str, tmp_path: Path, *overrides: str):
    module = load_pipeline_module(REPO / pipeline)
    return module.build(make_settings(module, ["warm_start_steps=0", *overrides]), RunPaths(tmp_path))


@pytest.fixture()
def default_pipeline(tmp_path):
    return built("pipelines/default.py", tmp_path)


def evaluator(pipeline, settings: EvalSettings, logged: list | None = None) -> Evaluation:
    log = (lambda step, metrics: logged.append((step, metrics))) if logged is not None else (lambda *_: None)
    return Evaluation(pipeline.tokenizer, settings, run_seed=0, log=log, step_of=lambda v: 10 * v)


def engine_of(pipeline, version: int = 0, seed: int = 0):
    torch.manual_seed(seed)
    return eval_engine(pipeline.settings.generation, pipeline.make_model, pipeline.tokenizer,
                       pipeline.make_model().state_dict(), version)


def policy_log_probs(pipeline, rows):
    """The rows' tokens teacher-forced by the policy ``engine_of`` holds, at temperature 1, nothing cut."""
    torch.manual_seed(0)
    model = pipeline.make_model().eval()
    with torch.no_grad():
        return teacher_forced_log_probs(model, rows["prompt_tokens"], rows["response_tokens"], None,
                                        pad_token_id=pipeline.tokenizer.pad_token_id)


def rows_of(store):
    return store.read(list(range(len(store))))


def test_every_held_out_prompt_is_one_row_scored_and_named_by_its_version(default_pipeline, tmp_path):
    (held_out,) = default_pipeline.eval_sets()
    logged: list = []
    store = open_set_store(tmp_path, held_out, EvalSettings())
    summary = evaluator(default_pipeline, EvalSettings(), logged).evaluate(engine_of(default_pipeline, 3), held_out,
                                                                          3, store)
    rows = rows_of(store)
    assert len(rows) == 40 and rows["policy_version"].eq(3).all()
    assert rows["group_id"].tolist() == [3 * ID_STRIDE + p for p in range(40)] == rows["trajectory_id"].tolist()
    # greedy: the policy's own log-probs of its tokens (the sampling distribution's would be 0 each)
    log_probs = rows["response_log_probs"].values
    assert log_probs.lt(0).any() and torch.allclose(log_probs, policy_log_probs(default_pipeline, rows).values,
                                                    atol=1e-5)
    expected = held_out.score(rows["prompt_text"], rows["response_text"], answer=[p.fields["answer"]
                                                                                  for p in held_out.prompts])
    assert rows["reward"].tolist() == pytest.approx(expected)
    assert summary["eval/held_out/pass@1"] == pytest.approx(sum(s >= 1.0 for s in expected) / 40)
    assert summary["eval/held_out/mean_score"] == pytest.approx(sum(expected) / 40)
    assert logged == [(30, {**summary, "eval/policy_version": 3.0})]  # once, at the step that published it
    # asked again: nothing sampled, stored or logged twice
    assert evaluator(default_pipeline, EvalSettings(), logged).evaluate(None, held_out, 3, store) == summary
    assert len(store) == 40 and len(logged) == 1
    assert set_store_location(tmp_path, "held_out") == Path(store.location)


def test_k_samples_give_pass_at_k_and_a_row_each(default_pipeline, tmp_path):
    (held_out,) = default_pipeline.eval_sets()
    settings = EvalSettings(samples=3, temperature=1.0, max_prompts=5)
    store = open_set_store(tmp_path, held_out, settings)
    assert Path(store.location) == set_store_location(tmp_path, "held_out-k3-t1-n5")  # not the greedy evaluation's
    summary = evaluator(default_pipeline, settings).evaluate(engine_of(default_pipeline), held_out, 0, store)
    rows = rows_of(store)
    assert len(rows) == 15 and rows["trajectory_id"].tolist() == list(range(15))
    assert rows["group_id"].tolist() == [p for p in range(5) for _ in range(3)]
    name = "eval/held_out-k3-t1-n5"
    assert set(summary) == {f"{name}/pass@1", f"{name}/pass@3", f"{name}/mean_score", f"{name}/prompts"}
    assert summary[f"{name}/pass@3"] >= summary[f"{name}/pass@1"]


def test_a_failed_evaluation_is_recorded_then_resumed_where_it_failed_and_matches_an_unbroken_one(
        default_pipeline, tmp_path):
    (held_out,) = default_pipeline.eval_sets()
    settings = EvalSettings(samples=2, temperature=1.0, max_prompts=20)
    unbroken = open_set_store(tmp_path / "a", held_out, settings)
    evaluator(default_pipeline, settings).evaluate(engine_of(default_pipeline), held_out, 1, unbroken)

    calls = []

    def fails_on_the_second_chunk(prompts, completions, **fields):
        calls.append(len(completions))
        if len(calls) == 2:
            raise ZeroDivisionError("the scorer's own bug")
        return held_out.score(prompts, completions, **fields)

    broken = open_set_store(tmp_path / "b", held_out, settings)
    flaky = held_out.__class__(**{**held_out.__dict__, "score": fails_on_the_second_chunk})
    assert evaluator(default_pipeline, settings).evaluate(engine_of(default_pipeline), flaky, 1, broken) is None
    progress = EvalProgress.of(broken)
    assert progress.failed == {1: "ZeroDivisionError: the scorer's own bug"} and progress.attempts == {1: 1}
    assert len(broken) == 16 and len(progress.scores) == 8  # the first chunk of 8 prompts is kept
    summary = evaluator(default_pipeline, settings).evaluate(engine_of(default_pipeline), held_out, 1, broken)
    assert summary is not None and EvalProgress.of(broken).failed == {}
    a, b = rows_of(unbroken), rows_of(broken)
    assert b.equal(a)  # each sample's own seed: resumed rows are the unbroken run's rows
    assert summary == EvalProgress.of(unbroken).done[1]
    assert set(summary) == {f"eval/held_out-k2-t1-n20/{m}" for m in ("pass@1", "pass@2", "mean_score", "prompts")}


def test_an_evaluation_that_keeps_failing_is_given_up_and_training_is_never_stopped(default_pipeline, tmp_path):
    (held_out,) = default_pipeline.eval_sets()

    def raises(prompts, completions, **fields):
        raise RuntimeError("verifier down")

    broken = held_out.__class__(**{**held_out.__dict__, "score": raises})
    evaluation = evaluator(default_pipeline, EvalSettings(max_prompts=4))
    store = open_set_store(tmp_path, broken, evaluation.settings)
    for _ in range(MAX_ATTEMPTS + 1):
        assert evaluation.evaluate(engine_of(default_pipeline), broken, 2, store) is None
    progress = EvalProgress.of(store)
    assert progress.attempts == {2: MAX_ATTEMPTS} and progress.gave_up(2) and len(store) == 0


def test_a_score_that_is_not_a_number_fails_the_evaluation_naming_the_set(default_pipeline, tmp_path):
    (held_out,) = default_pipeline.eval_sets()
    texty = held_out.__class__(**{**held_out.__dict__, "score": lambda p, c, **_: ["1.0"] * len(c)})
    store = open_set_store(tmp_path, texty, EvalSettings(max_prompts=2))
    assert evaluator(default_pipeline, EvalSettings(max_prompts=2)).evaluate(engine_of(default_pipeline), texty, 0,
                                                                              store) is None
    assert "the score of completion 0 of eval set 'held_out'" in EvalProgress.of(store).failed[0]


def test_an_agent_set_runs_whole_episodes_a_row_per_turn(tmp_path):
    pipeline = built("pipelines/tool_use.py", tmp_path, "max_new_tokens=16", "max_turns=2")
    (held_out,) = pipeline.eval_sets()
    store = open_set_store(tmp_path, held_out, EvalSettings(max_prompts=3))
    summary = evaluator(pipeline, EvalSettings(max_prompts=3)).evaluate(engine_of(pipeline), held_out, 0, store)
    rows = rows_of(store)
    assert set(rows["group_id"].tolist()) == {0, 1, 2} and rows["policy_version"].eq(0).all()
    assert rows["done"].sum() == 3  # one episode per task, each ending once
    name = "eval/held_out-k1-t0-n3"
    assert summary[f"{name}/turns_per_episode"] == pytest.approx(len(rows) / 3)
    assert {f"{name}/tool_calls_per_episode", f"{name}/failed_calls_per_episode"} <= set(summary)
    # greedy: each turn's log-probs are the policy's own, in the context the turn was sampled in
    log_probs = rows["response_log_probs"].values
    assert log_probs.lt(0).any() and torch.allclose(log_probs, policy_log_probs(pipeline, rows).values, atol=1e-5)


def test_an_agent_set_on_a_shared_server_takes_one_weights_lease_per_chunk_not_one_per_turn(tmp_path):
    """A server at ``generation.url`` is shared with the collectors, which lease it on their own weights
    round by round. An agent's turns come one after another, so a lease per request in flight was one
    per turn, each a chance for other weights to go in between and for the version evaluated to be
    loaded again. The chunk now holds one (here a stand-in server that samples with our loop and keeps
    the lease table: ``misbehaving_vllm_server.py``)."""
    from misbehaving_vllm_server import MisbehavingVLLMServer

    pipeline = built("pipelines/tool_use.py", tmp_path, "max_new_tokens=16", "max_turns=2")
    tokenizer = pipeline.tokenizer
    server = MisbehavingVLLMServer(pipeline.make_model(), stop_token_ids=[tokenizer.eos_token_id],
                                   pad_token_id=tokenizer.pad_token_id)
    try:
        at_url = built("pipelines/tool_use.py", tmp_path, "max_new_tokens=16", "max_turns=2",
                       f"generation.url={server.url}")
        (held_out,) = at_url.eval_sets()
        settings = EvalSettings(max_prompts=3)  # one chunk
        store = open_set_store(tmp_path, held_out, settings)
        with engine_of(at_url) as engine:
            before = server.lease_ops.copy()
            evaluator(at_url, settings).evaluate(engine, held_out, 0, store)
            calls = server.lease_ops - before
        turns = len(rows_of(store))
    finally:
        server.stop()
    assert turns >= 3 and calls["acquire"] == 1, (turns, calls)
    assert calls["release"] == 1  # let go at the chunk's end: the collectors' rounds go on


@pytest.mark.parametrize(("every", "publish_every", "expected"), [
    (5, 1, [0, 5, 10, 15]), (4, 2, [0, 2, 4, 6, 8]), (5, 2, [0, 3, 5, 8]),
])
def test_the_versions_evaluated_are_the_first_published_at_each_multiple_of_every_steps(every, publish_every,
                                                                                      expected):
    assert [v for v in range(max(expected) + 1) if wanted_version(v, every_steps=every, publish_every=publish_every,
                                                                   before_training=True)] == expected
    assert not wanted_version(0, every_steps=every, publish_every=publish_every, before_training=False)


def test_one_engine_is_given_each_version_in_turn_and_evaluates_as_a_fresh_one_would(default_pipeline, tmp_path):
    from rlhf_pipeline.evaluation.follow import VersionEngine, evaluate_version

    (held_out,) = default_pipeline.eval_sets()
    settings = EvalSettings(samples=2, temperature=1.0, max_prompts=4)
    states = {v: different_weights(default_pipeline.make_model(), v) for v in (1, 3)}
    made = []

    def make(state, version):
        made.append(version)
        return eval_engine(default_pipeline.settings.generation, default_pipeline.make_model,
                           default_pipeline.tokenizer, state, version)

    engines = VersionEngine(make)
    kept = {held_out.name: open_set_store(tmp_path / "kept", held_out, settings)}
    for version in (1, 3):
        assert evaluate_version(evaluator(default_pipeline, settings), [held_out], kept, version, engines,
                                lambda v=version: states[v])
    assert made == [1] and engines.engine.policy_version == 3  # made once, then given version 3
    engines.close()
    for version in (1, 3):  # a fresh engine per version stores the same rows
        fresh = open_set_store(tmp_path / f"fresh-{version}", held_out, settings)
        with eval_engine(default_pipeline.settings.generation, default_pipeline.make_model, default_pipeline.tokenizer,
                         states[version], version) as engine:
            evaluator(default_pipeline, settings).evaluate(engine, held_out, version, fresh)
        versions = rows_of(kept[held_out.name])["policy_version"]
        assert kept[held_out.name].read(versions.eq(version).nonzero().flatten()).equal(rows_of(fresh))
    first_of_version_1 = rows_of(kept[held_out.name])["response_log_probs"].values[:8]
    assert not torch.equal(first_of_version_1, rows_of(fresh)["response_log_probs"].values[:8])  # fresh: version 3


def test_a_failed_evaluation_drops_the_engine_so_its_retry_gets_a_fresh_one(default_pipeline, tmp_path):
    from rlhf_pipeline.evaluation.follow import VersionEngine, evaluate_version

    (held_out,) = default_pipeline.eval_sets()
    broken = held_out.__class__(**{**held_out.__dict__, "score": lambda p, c, **_: [float("nan")] * len(c)})
    settings = EvalSettings(max_prompts=2)
    engines = VersionEngine(lambda state, version: engine_of(default_pipeline, version))
    stores = {broken.name: open_set_store(tmp_path, broken, settings)}
    assert not evaluate_version(evaluator(default_pipeline, settings), [broken], stores, 0, engines, lambda: None)
    assert engines.engine is None and EvalProgress.of(stores[broken.name]).attempts == {0: 1}


def test_an_engine_the_evaluator_cannot_obtain_is_one_error_naming_the_setting(default_pipeline):
    import socket

    from rlhf_pipeline.evaluation.evaluator import EvalEngineUnavailable
    from rlhf_pipeline.generation.settings import GenerationSettings

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nowhere = GenerationSettings(url=f"http://127.0.0.1:{port}", start_timeout_s=0.2, retries=0)
    with pytest.raises(EvalEngineUnavailable) as raised:
        eval_engine(nowhere, default_pipeline.make_model, default_pipeline.tokenizer,
                    default_pipeline.make_model().state_dict(), 0)
    message = str(raised.value)
    assert message.startswith(f"the evaluator's engine (generation.url): generation.url: no vLLM server answered at "
                              f"http://127.0.0.1:{port} within 0.2 s") and "\n" not in message
