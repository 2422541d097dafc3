"""The served-policy canary (models/lora.py): after each adapter version it loads, the loop engine scores
fixed tokens with the model it samples with and compares them with the learner's own log-probs for
that version. The faults the field keeps hitting are injected through real code paths (an engine whose
adapter loads skip a version, one that never applies them, one holding another base) and each must be
refused naming the version, before the engine samples anything with it."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import needs_peft
import torch

from rlhf_pipeline.coordination.weights import WeightsPoller, load_published, load_weights
from rlhf_pipeline.generation.engine import SampleRequest
from rlhf_pipeline.generation.loop import LoopEngine, ServedPolicyMismatch
from rlhf_pipeline.generation.sampling import SamplingConfig
from rlhf_pipeline.learn.learner import Learner
from rlhf_pipeline.learn.lora import LoraPolicy
from rlhf_pipeline.learn.settings import LoraSettings
from rlhf_pipeline.models.lora import AdapterMerger, canary_log_probs, canary_tolerance
from tests.learn.test_learner import SETTINGS, TOKENIZER, make_model, make_run

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              needs_peft]
LORA = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj"))
VERSIONS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A LoRA run of VERSIONS steps, each published; a learning rate high enough that every version's
    canary moves far past the tolerance (the test would prove nothing otherwise)."""
    paths = make_run(tmp_path_factory.mktemp("lora"))
    settings = dataclasses.replace(SETTINGS, lora=LORA, lr=0.05, warmup_steps=0, publish_every=1)
    learner = Learner(settings, paths, make_model=make_model, steps=VERSIONS, seed=1, show_progress=False)
    learner.setup()
    learner.train()
    learner.cleanup()
    canaries = [torch.tensor(load_published(paths.root, v)[0].canary["log_probs"]) for v in range(1, VERSIONS + 1)]
    base = torch.tensor(canary_log_probs(make_model(), load_published(paths.root, 1)[0].canary["tokens"]))
    for before, after in zip([base, *canaries], canaries):
        assert float((after - before).abs().max()) > 10 * canary_tolerance(torch.float32)
    return paths


def engine(merger: AdapterMerger | None = None) -> LoopEngine:
    loop = LoopEngine(make_model(), pad_token_id=TOKENIZER.pad_token_id, eos_token_id=TOKENIZER.eos_token_id)
    if merger is not None:
        loop.policy._merger = merger  # the fault goes in where the engine applies adapters
    return loop


def load_in_turn(loop: LoopEngine, paths) -> None:
    for version in range(VERSIONS + 1):
        loop.load_weights(load_published(paths.root, version)[0], version)


def test_every_adapter_version_passes_the_canary_and_is_sampled_under_its_own_number(run):
    loop = engine()
    try:
        load_in_turn(loop, run)
        assert loop.policy_version == VERSIONS and loop.policy.last_canary_difference < 1e-4
        groups = loop.sample([SampleRequest([1, 2, 3], n=2)], [0], SamplingConfig(max_new_tokens=3))
        assert groups[0].policy_version == VERSIONS
        # the merged engine is the whole weights of that version, as load_weights gives them to others
        whole = make_model()
        whole.load_state_dict(load_weights(run.root, VERSIONS)[0])
        for name, value in whole.state_dict().items():
            torch.testing.assert_close(loop.model.state_dict()[name], value, rtol=0, atol=1e-6)
    finally:
        loop.close()


def test_a_collector_started_past_version_0_gets_the_base_with_its_first_adapter(run):
    loop = engine()
    try:
        state, version = WeightsPoller(run.root).poll()  # the newest: an adapter, its base attached
        assert version == VERSIONS and state.base is not None
        loop.load_weights(state, version)
        assert loop.policy_version == VERSIONS
    finally:
        loop.close()


class SkipsALoad(AdapterMerger):
    """Version 2's load is skipped: the engine goes on with version 1's adapter (a stale adapter)."""

    def apply(self, model, adapter, version):
        if version != 2:
            super().apply(model, adapter, version)


class NeverApplies(AdapterMerger):
    """Adapters arrive and are never applied: the engine samples the base."""

    def apply(self, model, adapter, version):
        pass


@pytest.mark.parametrize(("merger", "refused"), [(SkipsALoad(), 2), (NeverApplies(), 1)],
                         ids=["stale-adapter", "base-sampled"])
def test_an_engine_that_does_not_serve_the_version_is_refused_before_it_samples(run, merger, refused):
    loop = engine(merger)
    try:
        with pytest.raises(ServedPolicyMismatch, match=rf"served-policy check failed for weights version {refused}: "
                                                       r".*differ from the learner's by up to"):
            load_in_turn(loop, run)
        assert loop.policy_version == refused - 1  # what it holds was never counted as the refused version
    finally:
        loop.close()


def test_an_adapter_applied_to_another_base_is_refused(run):
    loop = engine()
    try:
        other = make_model()
        torch.nn.init.normal_(other.model.embed_tokens.weight)
        loop.load_weights(other.state_dict(), 0)  # whole weights that are not this run's version 0
        with pytest.raises(ServedPolicyMismatch, match="version 1"):
            loop.load_weights(load_published(run.root, 1)[0], 1)
    finally:
        loop.close()


def test_a_zero_adapter_scores_as_the_base(run):
    base_state = load_published(run.root, 0)[0]
    policy = LoraPolicy(LORA, base_state)
    model = make_model()
    model.load_state_dict(base_state)
    fresh = policy.publication(policy.wrap(model), 1)  # B = 0: the base's function
    assert all(float(t.abs().max()) == 0 for name, t in fresh.items() if "lora_B" in name)
    loop = engine()
    try:
        loop.load_weights(base_state, 0)
        loop.load_weights(fresh, 1)
        assert loop.policy.last_canary_difference < 1e-5
    finally:
        loop.close()
