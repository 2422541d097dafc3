"""A learner step whose loss, gradients or new weights are not finite is refused: the learner stops
with one line naming the step and what was not finite, publishes and checkpoints nothing of it,
and the same command resumes from the last good checkpoint (docs/learner.md)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from test_learner import SETTINGS, TOKENIZER, learner, make_model, make_run, rows
import preloaded

from rlhf_pipeline.coordination.weights import load_weights, published_versions
from rlhf_pipeline.learn.errors import NonFiniteStep
from rlhf_pipeline.learn.step import make_optimizer
from rlhf_pipeline.learn.step import plan_step, train_step
from rlhf_pipeline.schema.padding import pad_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[2]


def all_finite(state: dict[str, torch.Tensor]) -> bool:
    return all(bool(value.isfinite().all()) for value in state.values())


def test_a_step_whose_weights_overflow_is_refused_and_the_run_resumes_from_its_last_checkpoint(tmp_path):
    paths = make_run(tmp_path)
    good = learner(paths, steps=2, checkpoint_every=2)
    good.setup()
    assert good.train() is True
    good.cleanup()

    # finite gradients, but a step of 1e30 leaves weights no forward survives (their squares overflow)
    blown = learner(paths, steps=4, lr=1e30)
    blown.setup()
    with pytest.raises(NonFiniteStep, match=r"^learner step 3 refused: the weights after the optimizer step are "
                                            r"not finite \('[\w.]+' has norm inf; learning rate [\d.e+]+\); nothing "
                                            r"of it was published or checkpointed\..* resumes from the checkpoint "
                                            r"of step 2$"):
        blown.train()
    blown.cleanup()
    assert blown.checkpoints.steps() == [2]
    assert max(published_versions(paths.root)) == 2
    assert all(all_finite(load_weights(paths.root, version)[0]) for version in published_versions(paths.root))

    resumed = learner(paths, steps=4)  # the cause fixed: the learning rate the run started with
    resumed.setup()
    assert resumed.progress.step == 2
    assert resumed.train() is True
    resumed.cleanup()
    assert max(published_versions(paths.root)) == 4 and all_finite(load_weights(paths.root, 4)[0])


def test_a_row_that_makes_the_loss_nan_is_refused_before_the_optimizer_step(tmp_path):
    paths = make_run(tmp_path)

    def one_bad_advantage(positions, batch):  # what a broken re-scoring would hand the step
        batch["sequence_advantage"][0] = batch["advantage"][0] = float("nan")
        return batch

    run = learner(paths, steps=2)
    run.batch_transform = one_bad_advantage
    run.setup()
    initial = {name: value.clone() for name, value in run.model.state_dict().items()}
    with pytest.raises(NonFiniteStep, match=r"^learner step 1 refused: its loss is nan; .* resumes from the initial "
                                            r"policy \(no checkpoint yet\)$"):
        run.train()
    run.cleanup()
    assert run.checkpoints.steps() == [] and published_versions(paths.root) == [0]
    for name, value in run.model.state_dict().items():  # the optimizer never stepped
        assert torch.equal(value, initial[name]), name


def test_a_gradient_that_is_not_finite_names_its_parameter_and_the_weights_stay():
    settings = dataclasses.replace(SETTINGS, warmup_steps=0)
    model = make_model().train()
    optimizer, scheduler = make_optimizer(model, settings, total_steps=2)
    name, broken = list(model.named_parameters())[3]
    broken.register_hook(lambda grad: torch.full_like(grad, float("inf")))  # an overflow in that layer's backward
    before = {key: value.clone() for key, value in model.state_dict().items()}
    plan = plan_step(pad_batch(rows(8), pad_token_id=TOKENIZER.pad_token_id), settings)
    with pytest.raises(NonFiniteStep, match=rf"^a learner step was refused: the gradient of '{name}' is not finite "
                                            rf"\(norm (inf|nan)\)$"):
        train_step(model, optimizer, scheduler, plan, settings)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.slow
def test_run_with_a_learning_rate_that_blows_up_the_weights_stops_in_one_line(tmp_path):
    """`run` as a user starts it: the learner refuses step 1, the collector stops after its round,
    no traceback, nothing but version 0 published, no checkpoint."""
    home = tmp_path / "home"
    # weight decay at lr 1e30 multiplies every weight by about -1e29, whatever the rows' rewards
    done = preloaded.run(
        [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(REPO / "pipelines" / "default.py"), "--steps", "2",
         "--home", str(home), "--run-name", "blown", "--set", "warm_start_steps=5", "--set", "prompts_per_round=4",
         "--set", "group_size=4", "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.lr=1e30", "--set", "learner.weight_decay=0.1"],
        cwd=REPO, capture_output=True, text=True, timeout=400)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    refusals = [line for line in done.stderr.splitlines() if "refused" in line]
    assert len(refusals) == 1 and refusals[0].startswith(
        "rlhf-pipeline learn: error: learner step 1 refused: the weights after the optimizer step are not finite"), \
        done.stderr[-3000:]
    assert "rlhf-pipeline run: error: the learner failed (exit code 2; see its error above)" in done.stderr
    run = home / "blown"
    assert published_versions(run) == [0] and not (run / "checkpoints").exists()


def test_settings_built_in_python_refuse_numbers_that_are_not_finite():
    """What `--set` refuses (tests/test_cli_fail_fast.py) is refused by the settings' own checks too."""
    from rlhf_pipeline.generation.settings import GenerationSettings, check_generation
    from rlhf_pipeline.learn.settings import GRPOLossConfig

    with pytest.raises(ValueError, match=r"^setting 'learner.lr' must be a finite number, got inf: give one, e.g. "
                                         r"its default 0.0001$"):
        dataclasses.replace(SETTINGS, lr=float("inf"))
    with pytest.raises(ValueError, match=r"^setting 'learner.loss.entropy_coef' must be a finite number, got nan"):
        dataclasses.replace(SETTINGS, loss=GRPOLossConfig(entropy_coef=float("nan")))
    with pytest.raises(ValueError, match=r"^setting 'generation.url_check_tolerance' must be a finite number, got inf"):
        check_generation(GenerationSettings(url="http://h:1", url_check_tolerance=float("inf")))
