"""LoRA in the learner (learner.lora.*): settings, what trains, what is published and checkpointed,
exact resume, the resumes refused by name, and the recomputed-against-stored log-prob gap per version. A real memmap buffer, a real tiny model, real peft."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers import needs_peft
import torch

from rlhf_pipeline.coordination.weights import (
    load_published,
    load_weights,
    publish_weights,
    published_versions,
    retract_versions_after,
)
from rlhf_pipeline.learn.errors import AdapterRefused, LearnerRefused
from rlhf_pipeline.learn.learner import Learner
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.learn.settings import LearnerSettings, LoraSettings
from rlhf_pipeline.models.lora import PolicyAdapter, canary_log_probs
from rlhf_pipeline.pipeline import PipelineError, RunPaths, load_pipeline_module, make_settings
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_store
from rlhf_pipeline.transforms import ReferenceLogProbs
from tests.learn.test_learner import SETTINGS, make_model, make_run, rows

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_torch_thread")
LORA = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj"))


def learner(paths, steps: int, lora: LoraSettings = LORA, **changes) -> Learner:
    settings = dataclasses.replace(SETTINGS, lora=lora, **changes)
    return Learner(settings, paths, make_model=make_model, steps=steps, seed=1, show_progress=False)


def train(paths, steps: int, max_steps: int | None = None, **changes) -> Learner:
    run = learner(paths, steps, **changes)
    run.setup()
    try:
        run.train(max_steps=max_steps)
    finally:
        run.cleanup()
    return run


# ====================================================================== settings
@pytest.mark.parametrize(("changes", "named"), [
    ({"rank": -1}, "learner.lora.rank"),
    ({"rank": 8, "alpha": 0.0}, "learner.lora.alpha"),
    ({"rank": 8, "dropout": 1.0}, "learner.lora.dropout"),
    ({"rank": 8, "target_modules": ()}, "learner.lora.target_modules"),
    ({"rank": 8, "target_modules": ("q_proj", "lm_head")}, "learner.lora.target_modules"),
])
def test_bad_lora_settings_name_the_field(changes, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        LoraSettings(**changes)


def test_lora_settings_come_from_the_command_line_and_are_refused_where_they_cannot_run():
    module = load_pipeline_module(str(REPO / "pipelines" / "default.py"))
    settings = make_settings(module, ["learner.lora.rank=8", "learner.lora.target_modules=q_proj,v_proj"])
    assert settings.learner.lora == LoraSettings(rank=8, target_modules=("q_proj", "v_proj"))
    assert make_settings(module, []).learner.lora.rank == 0  # full fine-tuning unless asked
    for refused in (["learner.lora.rank=1024", "generation.engine=vllm"],  # past vLLM's largest --max-lora-rank
                    ["generation.engine=vllm", "generation.weight_transfer=nccl"]):  # a directory, not a broadcast
        with pytest.raises(PipelineError, match="learner.lora.rank"):
            make_settings(module, ["learner.lora.rank=8", *refused])
    assert LearnerSettings(world_size=2, lora=LoraSettings(rank=8)).world_size == 2  # DDP ranks train the adapter
    with pytest.raises(ValueError, match=r"learner\.parallelism.*ddp"):
        LearnerSettings(world_size=2, parallelism="fsdp", lora=LoraSettings(rank=8))


# ====================================================================== the learner
@needs_peft
def test_a_lora_learner_trains_and_publishes_only_the_adapter(tmp_path):
    paths = make_run(tmp_path)
    base = load_weights(paths.root, 0)[0]
    run = learner(paths, steps=3, publish_every=1)
    run.setup()
    trainable = {id(p) for p in run.model.parameters() if p.requires_grad}
    optimized = {id(p) for group in run.optimizer.param_groups for p in group["params"]}
    assert optimized == trainable and trainable  # the optimizer holds the adapter alone
    assert all("lora_" in name for name, p in run.model.named_parameters() if p.requires_grad)
    run.train()
    run.cleanup()

    assert published_versions(paths.root) == [0, 1, 2, 3]  # the base stays: every adapter is applied to it
    adapter, _ = load_published(paths.root, 3)
    assert isinstance(adapter, PolicyAdapter) and set(adapter) and all(".lora_" in name for name in adapter)
    assert adapter.config["r"] == 4 and sorted(adapter.config["target_modules"]) == ["q_proj", "up_proj", "v_proj"]
    assert any(float(t.abs().max()) > 0 for name, t in adapter.items() if "lora_B" in name)  # it learned
    # the frozen base is untouched, and version 3 as whole weights is the base with the adapter merged:
    # a plain model holding them scores the canary as the learner did
    for name, value in run.model.base_model.model.state_dict().items():
        if "lora_" not in name and "base_layer" not in name and name in base:
            assert torch.equal(value, base[name]), name
    merged = make_model()
    merged.load_state_dict(load_weights(paths.root, 3)[0])
    served = torch.tensor(canary_log_probs(merged, adapter.canary["tokens"]))
    assert torch.allclose(served, torch.tensor(adapter.canary["log_probs"]), atol=1e-4)
    assert not torch.allclose(served, torch.tensor(canary_log_probs(make_model(), adapter.canary["tokens"])),
                              atol=1e-4)  # and it is not the base's

    state = torch.load(run.checkpoints.latest(), weights_only=True)
    assert set(state["model"]) == set(adapter)  # the adapter, not the base
    assert state["lora"]["rank"] == 4 and len(state["lora"]["base_digest"]) == 64


@needs_peft
def test_lora_targets_the_model_lacks_are_refused_in_one_line_naming_the_layers_it_has(tmp_path):
    """A start whose version 0 is published and that has no checkpoint yet (the run's own start checked
    the targets before publishing: tests/integration/test_lora_resume.py): the learner's setup refuses
    them by name, a LearnerRefused the command line prints in one line, not peft's traceback."""
    run = learner(make_run(tmp_path), steps=2, lora=dataclasses.replace(LORA, target_modules=("q_proj", "qproj")))
    with pytest.raises(AdapterRefused) as refused:
        run.setup()
    assert isinstance(refused.value, LearnerRefused)
    message = str(refused.value)
    assert message.startswith("setting 'learner.lora.target_modules' names ['qproj'], which no linear layer")
    assert all(name in message for name in ("'q_proj'", "'v_proj'", "'up_proj'")), message
    run.cleanup()


@needs_peft
def test_a_resumed_lora_learner_continues_exactly_like_an_uninterrupted_one(tmp_path):
    straight = make_run(tmp_path / "a")
    train(straight, steps=6)
    resumed = make_run(tmp_path / "b")
    first = train(resumed, steps=6, max_steps=3)
    assert first.checkpoints.latest().name == "step_00000003.pt"
    second = train(resumed, steps=6)
    assert second.progress.step == 6

    a, b = read_metrics(straight.metrics), read_metrics(resumed.metrics)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for key in ("losses/loss", "losses/grad_norm", "charts/learning_rate", "charts/reward_mean"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    wa, wb = (load_published(p.root, 6)[0] for p in (straight, resumed))
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert wa.canary == wb.canary


@needs_peft
def test_a_checkpoint_is_resumed_only_as_the_kind_of_training_that_made_it(tmp_path):
    full = make_run(tmp_path / "full")
    train(full, steps=4, max_steps=2, lora=LoraSettings())
    with pytest.raises(ValueError, match=r"trained every weight.*learner\.lora\.rank=0"):
        learner(full, steps=4).setup()

    adapter = make_run(tmp_path / "adapter")
    train(adapter, steps=4, max_steps=2)
    with pytest.raises(ValueError, match=r"trained a LoRA adapter.*learner\.lora\.rank=4"):
        learner(adapter, steps=4, lora=LoraSettings()).setup()
    with pytest.raises(ValueError, match=r"learner\.lora\.rank=4, and this run sets 8"):
        learner(adapter, steps=4, lora=dataclasses.replace(LORA, rank=8)).setup()
    with pytest.raises(ValueError, match=r"learner\.lora\.target_modules=q_proj,v_proj,up_proj"):
        learner(adapter, steps=4, lora=dataclasses.replace(LORA, target_modules=("q_proj",))).setup()

    # the base replaced under the adapter: version 0 is another model's
    retract_versions_after(adapter.root, -1)
    other = make_model()
    torch.nn.init.normal_(other.lm_head.weight)
    publish_weights(adapter.root, other.state_dict(), 0)
    with pytest.raises(ValueError, match="another base"):
        learner(adapter, steps=4).setup()


@needs_peft
def test_a_target_that_names_no_layer_is_refused_by_name(tmp_path):
    paths = make_run(tmp_path)
    with pytest.raises(ValueError, match=r"learner\.lora\.target_modules.*c_attn"):
        learner(paths, steps=2, lora=LoraSettings(rank=4, target_modules=("c_attn",))).setup()


# ====================================================================== recomputed against stored, per version
def sampled_by(weights: dict[str, torch.Tensor], batch, version: int):
    """``batch`` as rows of ``version`` whose stored log-probs are ``weights``' own (what an engine
    holding those weights stores), scored by the reference transform of the write path."""
    model = make_model()
    model.load_state_dict(weights)
    scored = ReferenceLogProbs(model, tokens_per_microbatch=256).write(batch)["ref_log_probs"]
    return batch.with_columns(response_log_probs=scored,
                              policy_version=torch.full((len(batch),), version, dtype=torch.int64))


@pytest.mark.parametrize("lora", [pytest.param(LORA, marks=needs_peft), LoraSettings()], ids=["lora", "full"])
def test_a_row_stored_by_the_wrong_weights_shows_in_the_log_prob_gap_of_its_staleness(tmp_path, lora):
    """Step 2 trains with version 1 on rows of version 0 (stale by one: the policy's drift) and rows
    of version 1, stored once by version 1's weights (the gap is the engine's mismatch alone: within
    the 1e-4 of a full fine-tuning run's first step) and once by version 0's (the adapter never
    loaded: its gap is the drift of a version, and stands out in the line of rows 0 versions behind)."""
    gaps = {}
    for case in ("right", "stale"):
        paths = RunPaths(tmp_path / case / "run")
        base = make_model().state_dict()
        publish_weights(paths.root, base, 0)
        store = create_store(paths.buffer, "memmap", schema=StoreSchema(optional=("advantage",)), segment_rows=32)
        store.append(sampled_by(base, rows(64), 0))  # the first step's rows, as version 0 stores them
        store.close()
        changes = dict(lora=lora, publish_every=1, checkpoint_every=1, lr=2e-2, warmup_steps=0)
        train(paths, steps=2, max_steps=1, **changes)
        store = open_store(paths.buffer, mode="a")  # the window (64 rows) is now 32 of each version
        store.append(sampled_by(base, rows(32, seed=1), 0))
        store.append(sampled_by(load_weights(paths.root, 1 if case == "right" else 0)[0], rows(32, seed=2), 1))
        store.close()
        train(paths, steps=2, **changes)
        gaps[case] = read_metrics(paths.metrics)[-1]

    right, stale = gaps["right"], gaps["stale"]
    assert right["step"] == stale["step"] == 2 and right["charts/row_version_spread"] == 1
    # the learner trains with version 1: its rows are 0 versions behind it, version 0's 1
    assert right["losses/sampler_logprob_diff_max/staleness_0"] < 1e-4  # the learner's own version: no drift
    drift = right["losses/sampler_logprob_diff_mean/staleness_1"]
    assert drift > 1e-3 and stale["losses/sampler_logprob_diff_mean/staleness_1"] == pytest.approx(drift)
    # version 1's rows stored by version 0's weights: a version's drift where the engine's mismatch belongs
    assert stale["losses/sampler_logprob_diff_mean/staleness_0"] > max(
        1e-3, 10 * right["losses/sampler_logprob_diff_max/staleness_0"])
