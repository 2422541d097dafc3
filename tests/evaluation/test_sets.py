"""Eval settings, held-out sets and the scores of an evaluation (rlhf_pipeline/evaluation)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_pipeline.evaluation.evaluator import evaluation_name
from rlhf_pipeline.evaluation.sampling import eval_sampling, eval_seed
from rlhf_pipeline.evaluation.scores import pass_at_k, summarize
from rlhf_pipeline.evaluation.sets import EvalSet, check_sets
from rlhf_pipeline.evaluation.settings import EvalSettings
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.pipeline import PipelineError, load_pipeline_module, make_settings

REPO = Path(__file__).resolve().parents[2]


# ====================================================================== settings
def test_eval_is_off_by_default_and_on_with_every_steps():
    module = load_pipeline_module(REPO / "pipelines/default.py")
    assert make_settings(module).eval == EvalSettings()
    assert not make_settings(module).eval.enabled
    on = make_settings(module, ["eval.every_steps=50", "eval.samples=4", "eval.temperature=1.0",
                                "eval.max_prompts=10", "eval.before_training=false"]).eval
    assert on == EvalSettings(every_steps=50, before_training=False, samples=4, temperature=1.0, max_prompts=10)
    assert on.enabled


@pytest.mark.parametrize(("override", "message"), [
    ("eval.every_steps=-1", "setting 'eval.every_steps' must be >= 0 (0: off), got -1"),
    ("eval.samples=0", "setting 'eval.samples' must be >= 1, got 0"),
    ("eval.temperature=-0.5", "setting 'eval.temperature' must be >= 0 (0: greedy), got -0.5"),
    ("eval.samples=4", "setting 'eval.samples' is 4, but greedy decoding (eval.temperature=0) gives one completion "
                       "per prompt: add --set eval.temperature=1.0, or set eval.samples=1"),
    ("eval.max_prompts=0", "setting 'eval.max_prompts' must be >= 1 or none (all), got 0"),
    ("eval.temperature=nan", "setting 'eval.temperature' must be a finite number, got nan: give one, e.g. its "
                             "default 0.0"),
])
def test_a_bad_eval_setting_is_one_line_naming_it(override, message):
    module = load_pipeline_module(REPO / "pipelines/default.py")
    with pytest.raises(PipelineError) as caught:
        make_settings(module, [override])
    assert str(caught.value) == message


def test_eval_settings_built_in_python_check_themselves():
    with pytest.raises(ValueError, match="eval.samples"):
        EvalSettings(samples=2)
    assert EvalSettings(samples=2, temperature=0.7).samples == 2


# ====================================================================== the pipelines' held-out sets
def test_default_pipeline_holds_its_eval_prompts_out_of_training(tmp_path):
    module = load_pipeline_module(REPO / "pipelines/default.py")
    for seed in (0, 1):
        settings = make_settings(module, [f"seed={seed}"])
        pipeline = module.build(settings, RunPaths(tmp_path))
        (held_out,) = pipeline.eval_sets()
        training = module.training_prompts(settings, module.held_out_prompts(settings))
        held = [p.prompt_id for p in held_out.prompts]
        assert held_out.name == "held_out" and len(held) == 40 == len(set(held))  # a tenth of the 20 * 20 sums
        assert len(training) == settings.num_prompts
        assert not {p.prompt_id for p in training} & set(held)  # never the same prompt
        assert {p.messages[0]["content"] for p in training}.isdisjoint(p.messages[0]["content"] for p in held_out.prompts)
    # one set for every seed: runs of different seeds are compared on the same prompts
    first, second = (module.held_out_prompts(make_settings(module, [f"seed={s}"])) for s in (0, 1))
    assert first == second


def test_a_tiny_operand_range_holds_nothing_out(tmp_path):
    module = load_pipeline_module(REPO / "pipelines/default.py")
    settings = make_settings(module, ["max_operand=3"])
    assert module.build(settings, RunPaths(tmp_path)).eval_sets() == []


def test_tool_use_pipeline_holds_its_eval_tasks_out_of_training(tmp_path):
    module = load_pipeline_module(REPO / "pipelines/tool_use.py")
    settings = make_settings(module)
    (held_out,) = module.build(settings, RunPaths(tmp_path)).eval_sets()
    questions = [t["question"] for t in held_out.tasks]
    assert held_out.agents and len(questions) == 64 == len(set(questions))
    training = module.training_tasks(settings, module.held_out_tasks(settings))
    assert len(training) == settings.num_tasks
    assert not {t["question"] for t in training} & set(questions)
    env = held_out.make_env()
    assert env.partial_credit is False  # the held-out verifier pays the exact product only
    # sampled as training samples (greedy answers were right already: docs/evaluation.md#what-it-shows),
    # with samples enough for pass@k, in a store of its own; --set eval.temperature=0 eval.samples=1 is greedy
    assert settings.eval.temperature == settings.temperature and settings.eval.samples == 4
    greedy = make_settings(module, ["eval.temperature=0", "eval.samples=1"]).eval
    assert evaluation_name(held_out, greedy) == "held_out"
    # a cap the set does not exceed scores every task: the same evaluation, under the same name
    every_task = make_settings(module, ["eval.temperature=0", "eval.samples=1", "eval.max_prompts=1000"]).eval
    assert evaluation_name(held_out, every_task) == "held_out"
    fewer = make_settings(module, ["eval.temperature=0", "eval.samples=1", "eval.max_prompts=63"]).eval
    assert evaluation_name(held_out, fewer) == "held_out-k1-t0-n63"


def test_an_eval_set_is_refused_naming_what_it_lacks():
    with pytest.raises(ValueError, match="eval set 'x' has prompts but no score"):
        EvalSet("x", prompts=["1+1="])
    with pytest.raises(ValueError, match="needs either prompts .* not neither"):
        EvalSet("x")
    with pytest.raises(ValueError, match="must be letters, digits"):
        EvalSet("held out/1", prompts=["a"], score=lambda p, c, **_: [1.0] * len(c))
    with pytest.raises(ValueError, match="give make_env="):
        EvalSet("x", tasks=[{"question": "q"}])
    one = EvalSet("x", prompts=["a"], score=lambda p, c, **_: [1.0] * len(c))
    with pytest.raises(ValueError, match="two eval sets are named 'x'"):
        check_sets([one, one])
    # declared, but none for these settings: not told to declare what it declares
    with pytest.raises(ValueError, match=r"eval_sets\(\) returned no held-out set with these settings"):
        check_sets([])
    with pytest.raises(ValueError, match="the pipeline declares no held-out sets"):
        check_sets(None)


# ====================================================================== scores and seeds
def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2) / C(5,2)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # fewer than k failures: some draw of k passes
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_summary_names_the_set_and_averages_over_prompts():
    summary = summarize("held_out", [[1.0, 0.0], [0.5, 0.0]], pass_score=1.0)
    assert summary == {"eval/held_out/pass@1": 0.25, "eval/held_out/pass@2": 0.5,
                       "eval/held_out/mean_score": 0.375, "eval/held_out/prompts": 2.0}
    greedy = summarize("s", [[1.0], [0.0]], pass_score=1.0, episode_counts={"turns": 3.0})
    assert "eval/s/pass@1" in greedy and not any("pass@2" in k for k in greedy)
    assert greedy["eval/s/turns_per_episode"] == 1.5


def test_each_sample_has_its_own_stable_seed():
    seeds = {eval_seed(0, "s", v, p, j) for v in range(3) for p in range(10) for j in range(4)}
    assert len(seeds) == 3 * 10 * 4
    assert eval_seed(0, "s", 2, 3, 1) == eval_seed(0, "s", 2, 3, 1)
    assert eval_seed(0, "s", 2, 3, 1) != eval_seed(1, "s", 2, 3, 1) != eval_seed(0, "t", 2, 3, 1)


def test_temperature_zero_is_greedy():
    greedy = eval_sampling(0.0, 6)
    assert greedy.top_k == 1 and greedy.max_new_tokens == 6
    assert eval_sampling(0.7, 6).temperature == 0.7
