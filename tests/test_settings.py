"""Typed settings, checked where they are declared, and the run's settings apart from the task's.

Every choice is a ``Literal`` that ``--set`` and a dataclass built in Python refuse alike; every
settings class checks itself in ``__post_init__``; the values the run derives (the learner's sampling
temperature, its data timeout under vLLM) are derived once, the same for every pipeline; and a bad value
is refused by the launcher, before any process starts."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from rlhf_pipeline.learn.settings import GRPOLossConfig, LearnerSettings, LoraSettings, SamplerName
from rlhf_pipeline.pipeline import PipelineError, describe_settings, load_pipeline_module, make_settings
from rlhf_pipeline.run_settings import RaySettings, RunSettings
from rlhf_pipeline.storage.retention import RetentionSettings

REPO = Path(__file__).resolve().parent.parent
PIPELINES = ["pipelines/default.py", "pipelines/tool_use.py", "pipelines/qwen_math.py",
             "pipelines/examples/reverse_words.py", "pipelines/examples/binary_tool.py"]


def settings_of(pipeline: str, *overrides: str):
    return make_settings(load_pipeline_module(REPO / pipeline), list(overrides))


# ====================================================================== choices
@pytest.mark.parametrize(("override", "message"), [
    ("learner.sampler=exakt", "setting 'learner.sampler' must be one of ['window', 'exact', 'groups', 'prioritized', "
                              "'epoch'], got 'exakt'; did you mean 'exact'?"),
    ("learner.priority_feedback=los", "setting 'learner.priority_feedback' must be one of ['none', 'loss', "
                                      "'ratio_deviation'], got 'los'; did you mean 'loss'?"),
    ("learner.parallelism=fsdp2", "setting 'learner.parallelism' must be one of ['ddp', 'fsdp'], got 'fsdp2'; "
                                  "did you mean 'fsdp'?"),
    ("learner.loss.aggregation=mean", "setting 'learner.loss.aggregation' must be one of ['token_mean', "
                                      "'sequence_mean', 'constant'], got 'mean'"),
    ("buffer_backend=zar", "setting 'buffer_backend' must be one of ['memmap', 'zarr'], got 'zar'; did you mean "
                           "'zarr'?"),
    ("generation.engine=vlm", "setting 'generation.engine' must be one of ['loop', 'vllm'], got 'vlm'; did you "
                              "mean 'vllm'?"),
])
def test_a_bad_choice_is_refused_naming_the_key_the_value_the_choices_and_the_closest(override, message):
    with pytest.raises(PipelineError) as raised:
        settings_of("pipelines/default.py", override)
    assert str(raised.value) == message


def test_settings_given_where_they_apply_are_taken():
    learner = LearnerSettings(sampler="prioritized", priority="group_reward_std", priority_alpha=1.0, priority_beta=1.0,
                              lr_schedule="cosine", min_lr_ratio=0.5, turn_advantage="mixed",
                              turn_advantage_weight=0.3, lora=LoraSettings(rank=4, alpha=8.0, dropout=0.1))
    assert (learner.priority_alpha, learner.min_lr_ratio, learner.turn_advantage_weight, learner.lora.alpha) == \
        (1.0, 0.5, 0.3, 8.0)
    grouped = LearnerSettings(sampler="groups", replace_zero_variance=True, replay_pool_groups=8)
    assert grouped.replay_pool_groups == 8 and LearnerSettings(sampler="exact", uses_per_row=2).uses_per_row == 2


@pytest.mark.parametrize(("build", "message"), [
    (lambda: LearnerSettings(sampler="exakt"), "setting 'learner.sampler' must be one of"),
    (lambda: LearnerSettings(lr=float("inf")), "setting 'learner.lr' must be a finite number, got inf"),
    (lambda: GRPOLossConfig(ratio_level="seq"), "setting 'learner.loss.ratio_level' must be one of"),
    (lambda: RetentionSettings(max_age_s=float("nan")), "setting 'retention.max_age_s' must be a finite number"),
    (lambda: RaySettings(collector_num_cpus=-1.0), "setting 'ray.collector_num_cpus' must be >= 0"),
    (lambda: RunSettings(device="tpu"), "setting 'device' must be one of ['cpu', 'cuda'], got 'tpu'"),
    (lambda: RunSettings(group_size=1), "setting 'group_size' must be >= 2: GRPO compares completions"),
    (lambda: RunSettings(buffer_url="s3://bucket/run"), "setting 'buffer_url' (s3://bucket/run) needs "
                                                        "buffer_backend=zarr"),
    (lambda: RunSettings(retention=RetentionSettings(max_rows=10)), "setting 'retention.max_rows' (10) must be >= "
                                                                    "segment_rows (1024)"),
    (lambda: RunSettings(buffer_lock_lease_s=1.0), "setting 'buffer_lock_lease_s' must be >= 3 seconds"),
    (lambda: LearnerSettings(adam_betas=(0.9,)), "setting 'learner.adam_betas' takes 2 values, got (0.9,)"),
    # a setting nothing would read where another has the value it was given with: refused, as an engine's
    # setting is for a run of another engine
    (lambda: LearnerSettings(sampler="window", priority_alpha=1.0), "setting 'learner.priority_alpha' is for "
                                                                    "learner.sampler=prioritized; this run's "
                                                                    "learner.sampler is window: drop it, or set "
                                                                    "learner.sampler=prioritized"),
    (lambda: LearnerSettings(sampler="window", uses_per_row=2), "setting 'learner.uses_per_row' is for "
                                                                "learner.sampler=exact"),
    # read by the epoch sampler alone: a run of another sampler took them without a word
    (lambda: LearnerSettings(epoch_order="sequential"), "setting 'learner.epoch_order' is for learner.sampler=epoch; "
                                                        "this run's learner.sampler is window"),
    (lambda: LearnerSettings(sampler="exact", epoch_rows=100), "setting 'learner.epoch_rows' is for "
                                                               "learner.sampler=epoch"),
    (lambda: LearnerSettings(min_lr_ratio=0.5), "setting 'learner.min_lr_ratio' is for learner.lr_schedule=cosine; "
                                                "this run's learner.lr_schedule is constant"),
    (lambda: LearnerSettings(sampler="groups", replay_pool_groups=8), "setting 'learner.replay_pool_groups' is for "
                                                                      "learner.replace_zero_variance=true; this "
                                                                      "run's learner.replace_zero_variance is false"),
    (lambda: LearnerSettings(turn_advantage_weight=0.3), "setting 'learner.turn_advantage_weight' is for "
                                                         "learner.turn_advantage=mixed"),
    (lambda: GRPOLossConfig(max_tokens=64), "setting 'learner.loss.max_tokens' is for learner.loss.aggregation="
                                            "constant; this run's learner.loss.aggregation is token_mean"),
    (lambda: LoraSettings(alpha=32.0), "setting 'learner.lora.alpha' is for a LoRA run (learner.lora.rank > 0); this "
                                       "run trains every weight (learner.lora.rank=0): drop it"),
    (lambda: LearnerSettings(adam_betas=(0.9, 1.0)), "setting 'learner.adam_betas' must be in [0, 1) (each of the "
                                                     "two), got (0.9, 1.0)"),
])
def test_a_dataclass_built_in_python_is_checked_as_one_built_from_set(build, message):
    with pytest.raises(ValueError) as raised:
        build()
    assert message in str(raised.value) and "\n" not in str(raised.value)


# ====================================================================== bounds
@pytest.mark.parametrize(("pipeline", "override", "message"), [
    ("pipelines/default.py", "num_heads=0", "setting 'num_heads' must be >= 1, got 0"),
    ("pipelines/default.py", "warm_start_steps=-1", "setting 'warm_start_steps' must be >= 0 (0 skips the warm "
                                                    "start), got -1"),
    ("pipelines/default.py", "num_heads=3", "settings 'hidden_size' (64) and 'num_heads' (3) must give heads of one "
                                            "even size, got 21.3333"),
    ("pipelines/default.py", "hidden_size=60", "settings 'hidden_size' (60) and 'num_heads' (4) must give heads of "
                                               "one even size, got 15"),
    ("pipelines/tool_use.py", "max_failed_group_fraction=1.5", "setting 'max_failed_group_fraction' must be in "
                                                               "[0, 1] or none, got 1.5"),
    ("pipelines/tool_use.py", "max_turns=0", "setting 'max_turns' must be >= 1, got 0"),
    ("pipelines/qwen_math.py", "steps=0", "setting 'steps' must be >= 1, got 0"),  # declared again, bounds kept
    ("pipelines/examples/reverse_words.py", "length=9", "setting 'length' must be in [1, 8], got 9"),
    ("pipelines/default.py", "learner.min_lr_ratio=2", "setting 'learner.min_lr_ratio' must be in [0, 1], got 2.0"),
    ("pipelines/default.py", "learner.loss.kl_coef=-0.1", "setting 'learner.loss.kl_coef' must be >= 0, got -0.1"),
    ("pipelines/default.py", "generation.gpu_memory_utilization=0", "setting 'generation.gpu_memory_utilization' "
                                                                    "must be in (0, 1], got 0.0"),
    ("pipelines/default.py", "eval.max_prompts=0", "setting 'eval.max_prompts' must be >= 1 or none (all), got 0"),
    # torch's generators take 64 bits and the run derives seeds from this one: a seed past them made the
    # collector's process die with "Overflow when unpacking long long", after the learner had started
    ("pipelines/default.py", "seed=4294967296", "setting 'seed' must be in [0, 4294967296), got 4294967296"),
    ("pipelines/tool_use.py", "seed=-1", "setting 'seed' must be in [0, 4294967296), got -1"),
    # each value of a tuple is held to the field's bounds, and a tuple of fixed length to its length: torch's
    # AdamW refused these in the learner's process, after the collector had started
    ("pipelines/default.py", "learner.adam_betas=1,2", "setting 'learner.adam_betas' must be in [0, 1) (each of the "
                                                       "two), got (1.0, 2.0)"),
    ("pipelines/default.py", "learner.adam_betas=-0.1,0.9", "setting 'learner.adam_betas' must be in [0, 1) (each"),
    ("pipelines/default.py", "learner.adam_betas=0.9", "setting 'learner.adam_betas' takes 2 comma-separated values, "
                                                       "got 1: '0.9'"),
    ("pipelines/default.py", "learner.adam_betas=0.9,0.99,0.5", "setting 'learner.adam_betas' takes 2 comma-separated "
                                                                "values, got 3"),
    # an integer past 64 bits passed every ">= 1", then failed in a child process as torch took it: the
    # learner's with "Overflow when unpacking long long" (threads), "cannot fit 'int' into an index-sized
    # integer" (group_size), "can't convert negative int to unsigned" (max_lag, learner.uses_per_row)
    *[("pipelines/default.py", f"{key}={2**63}", f"setting {key!r} must fit in 64 bits (from -2**63 to 2**63 - 1), "
                                                 f"got {2**63}: give a number within them, e.g. its default {default}")
      for key, default in (("threads", 1), ("group_size", 8), ("max_lag", 1), ("segment_rows", 1024),
                           ("learner.uses_per_row", 1), ("num_prompts", 4096), ("generation.max_num_seqs", 256))],
    ("pipelines/tool_use.py", f"max_turns={-2**70}", f"setting 'max_turns' must fit in 64 bits"),
])
def test_a_number_outside_the_bounds_declared_on_its_field_is_refused_naming_them(pipeline, override, message):
    """The task's fields as the run's: ``Annotated[int, Bounds(ge=1)]`` on the field is the whole check;
    a pipeline that declares a run setting again, for another default, keeps its bounds."""
    with pytest.raises(PipelineError) as raised:
        settings_of(pipeline, override)
    assert str(raised.value).startswith(message), str(raised.value)


def test_the_settings_list_shows_each_fields_bounds():
    listed = describe_settings(settings_of("pipelines/default.py"))
    for line in ("  num_heads (int, >= 1) = 4", "  group_size (int, >= 2) = 8", "  temperature (float, > 0) = 1.0",
                 "  threads (int | None, >= 1) = 1", "  learner.loss.clip_eps_low (float, in [0, 1)) = 0.2"):
        assert line in listed.splitlines(), line
    assert "  seed (int, in [0, 4294967296)) = 0" in listed.splitlines()
    assert "  learner.lora.dropout (float, in [0, 1)) = 0.0" in listed.splitlines()
    assert "  buffer_url (str | None) = None" in listed.splitlines()  # no bounds, none shown


def test_bounds_refuse_nan_and_pass_none_where_the_field_takes_it():
    from rlhf_pipeline.setting_checks import Bounds

    assert not Bounds(ge=0, le=1).allows(float("nan")) and not Bounds(gt=0).allows(float("nan"))
    assert RunSettings(max_lag=None).max_lag is None and LearnerSettings(epoch_rows=None).epoch_rows is None
    assert [str(b) for b in (Bounds(ge=1), Bounds(gt=0), Bounds(ge=0, lt=1), Bounds(gt=0, le=1), Bounds(le=4))] == [
        ">= 1", "> 0", "in [0, 1)", "in (0, 1]", "<= 4"]


def test_the_sampler_choices_are_the_registry_and_the_priorities_the_stores():
    from rlhf_pipeline.learn.samplers.registry import SAMPLERS
    from rlhf_pipeline.learn.settings import Priority
    from rlhf_pipeline.storage.prioritized import PRIORITIES

    assert sorted(typing.get_args(SamplerName)) == sorted(SAMPLERS)
    assert sorted(typing.get_args(Priority)) == sorted(PRIORITIES)


def test_settings_given_together_are_checked_together_in_any_order():
    """sample_window >= batch_size: raising both at once was refused when --set applied them one at a time."""
    for order in (["learner.batch_size=256", "learner.sample_window=512"],
                  ["learner.sample_window=512", "learner.batch_size=256"]):
        learner = settings_of("pipelines/default.py", *order).learner
        assert (learner.batch_size, learner.sample_window) == (256, 512)
    with pytest.raises(PipelineError, match=r"'learner.sample_window' \(128\) must be >= batch_size \(256\)"):
        settings_of("pipelines/default.py", "learner.batch_size=256")
    prioritized = settings_of("pipelines/default.py", "learner.priority_feedback=loss", "learner.sampler=prioritized")
    assert prioritized.learner.priority_feedback == "loss"


# ====================================================================== the run apart from the task
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_every_pipeline_declares_its_task_on_the_run_settings(pipeline):
    settings = settings_of(pipeline)
    assert isinstance(settings, RunSettings)
    for key in ("buffer_url", "retention.max_rows", "ray.collector_num_cpus", "generation.engine", "threads"):
        assert f"  {key} (" in describe_settings(settings), key  # every pipeline takes every run setting


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_the_run_derives_the_learners_temperature_and_its_wait_for_a_vllm_engine_once_for_every_pipeline(
        pipeline):
    """tool_use.py did not add the engine's start-up allowance (600 s learner timeout against 900 s for the
    engine to start); each pipeline's check() overwrote learner.temperature."""
    timeouts = ["learner.data_timeout_s=100", "temperature=0.7"]
    on_the_loop = settings_of(pipeline, *timeouts).learner_settings()
    assert (on_the_loop.data_timeout_s, on_the_loop.temperature) == (100, 0.7)
    with_vllm = settings_of(pipeline, "generation.engine=vllm", "generation.start_timeout_s=50", *timeouts).learner_settings()
    assert (with_vllm.data_timeout_s, with_vllm.temperature) == (150, 0.7)


def test_a_derived_setting_is_refused_naming_what_sets_it():
    with pytest.raises(PipelineError) as raised:
        settings_of("pipelines/default.py", "learner.temperature=0.5")
    assert str(raised.value) == ("setting 'learner.temperature' is set from 'temperature' by the run; set that "
                                 "instead (--set temperature=...)")
    assert "learner.temperature" not in describe_settings(settings_of("pipelines/default.py"))


def test_a_pipelines_own_rules_run_with_every_construction():
    module = load_pipeline_module(REPO / "pipelines" / "tool_use.py")
    with pytest.raises(ValueError, match="settings 'low' and 'high' must satisfy 1 <= low <= high"):
        module.Settings(low=50, high=20)
    with pytest.raises(PipelineError, match="setting 'generation.overlap_rounds' was removed: the next round goes"):
        make_settings(module, ["generation.overlap_rounds=true"])
    assert dataclasses.replace(module.Settings(), low=20).low == 20


# ====================================================================== refused before any process starts
@pytest.mark.parametrize(("argv", "message"), [
    (["--set", "learner.sampler=exakt"], "setting 'learner.sampler' must be one of ['window', 'exact', 'groups', "
                                         "'prioritized', 'epoch'], got 'exakt'; did you mean 'exact'?"),
    (["--set", "learner.temperature=0.5"], "setting 'learner.temperature' is set from 'temperature'"),
    (["--set", "seed=100000000000000"], "setting 'seed' must be in [0, 4294967296), got 100000000000000"),
])
def test_the_real_cli_refuses_a_bad_setting_in_one_line_before_anything_starts(tmp_path, argv, message):
    command = Path(sys.executable).with_name("rlhf-pipeline")
    done = subprocess.run([str(command), "run", str(REPO / "pipelines" / "default.py"), "--home", str(tmp_path),
                           *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert not any(tmp_path.iterdir())  # no run directory, no process started
