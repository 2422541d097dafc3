"""LoRA adapter versions on a real vLLM server (generation/vllm_adapters.py, docs/lora.md "On vLLM"): each
version loaded under its own name, rows sampled under the adapter of the version they name, and the
served-policy canary through the sampling path refusing, before any row, each way the field has seen
an engine sample the wrong policy. Faults go in through subclasses of what loads the adapters.

One engine serves the module (a start is tens of seconds); versions only move forward, so each test
loads versions above the last one loaded and assumes nothing of what the tests before it loaded (CI runs
them in the order of their ids). Skipped, saying how to get them, without the vLLM environment
or peft.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal

import pytest
import torch
from helpers import needs_peft, process_running

from rlhf_pipeline.generation import SampleRequest, SamplingConfig
from rlhf_pipeline.generation.loop import ServedPolicyMismatch, teacher_forced_log_probs
from rlhf_pipeline.generation.vllm_http import Retries
from rlhf_pipeline.generation.vllm_adapters import AdapterServing, ServedAdapters
from rlhf_pipeline.generation.vllm_engine import VLLMEngine
from rlhf_pipeline.generation.vllm_url import VLLMURLEngine
from rlhf_pipeline.generation.vllm_url_weights import ServerMismatch
from rlhf_pipeline.learn.settings import LoraSettings
from rlhf_pipeline.models import tiny_model_and_tokenizer
from rlhf_pipeline.models.lora import (
    PolicyAdapter,
    adapter_config_of,
    adapter_tensors,
    canary_of,
    canary_tolerance,
    with_lora,
)
from rlhf_pipeline.schema.ragged import RaggedTensor

pytestmark = needs_peft
SHAPE = dict(hidden_size=64, num_heads=2, num_layers=2)  # head size 32: vLLM's CPU attention takes it
LORA = LoraSettings(rank=8, alpha=16.0)
SERVING = AdapterServing.of(LORA, max_staleness=1)  # two versions loaded
SERVED_TOLERANCE = 1e-5
"""vLLM's log-probs under an adapter against peft's forward of the same version: 4.8e-7 measured (float32,
CPU, the Punica kernels' PyTorch fallbacks), as without an adapter; 20x that for other CPUs' kernels."""


def adapter(base, version: int, *, rank: int = 8, targets=LORA.target_modules, scale: float = 0.05,
            modules_to_save=None) -> tuple[PolicyAdapter, torch.nn.Module]:
    """A version the learner could have published (its B drawn, not trained; the learner's canary of
    it through peft), and the peft model that is that version."""
    torch.manual_seed(1000 + version)
    policy = with_lora(copy.deepcopy(base), rank, 16.0, 0.0, list(targets))
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, scale)
    config = adapter_config_of(policy)
    if modules_to_save is not None:
        config["modules_to_save"] = modules_to_save
    published = PolicyAdapter(adapter_tensors(policy), config=config, base_digest="",
                              canary=canary_of(policy, base.config.vocab_size, version))
    return published, policy


@pytest.fixture(scope="module")
def served(vllm_python, tmp_path_factory):
    """(engine, base, tokenizer): a vLLM engine serving a tiny Qwen2's adapters, at version 0."""
    base, tok = tiny_model_and_tokenizer(seed=0, **SHAPE)
    engine = VLLMEngine.from_model(copy.deepcopy(base), python=vllm_python, stop_token_ids=[tok.eos_token_id],
                                   work_dir=tmp_path_factory.mktemp("vllm-lora"), adapters=SERVING)
    yield engine, base, tok
    engine.close()


def next_version(engine) -> int:
    return engine.policy_version + 1 + len(engine.adapters.files.held)


@contextlib.contextmanager
def adapters_as(engine, kind: type[ServedAdapters]):
    """The engine's adapters loaded by ``kind`` (a subclass that puts a fault in) for the block."""
    adapters = engine.adapters
    adapters.__class__ = kind
    try:
        yield adapters
    finally:
        adapters.__class__ = ServedAdapters


def sampled_against(engine, policy, tok, version: int) -> float:
    """Largest difference between the engine's stored log-probs of a round and ``policy``'s forward."""
    prompt = tok("12+34=", add_special_tokens=False)["input_ids"]
    (group,) = engine.sample([SampleRequest(prompt, n=4)], [7], SamplingConfig(max_new_tokens=12))
    assert group.policy_version == version
    responses = [c.token_ids for c in group.completions]
    with torch.no_grad():
        again = teacher_forced_log_probs(policy, RaggedTensor.from_sequences([prompt] * 4, dtype=torch.int64),
                                         RaggedTensor.from_sequences(responses, dtype=torch.int64),
                                         SamplingConfig(max_new_tokens=12))
    stored = torch.tensor([p for c in group.completions for p in c.log_probs])
    return float((again.values.float() - stored).abs().max())


def test_each_version_is_served_under_its_own_name_and_rows_sample_its_adapter(served):
    engine, base, tok = served
    whole = next_version(engine)  # whole weights (version 0's kind): the base, served under its own name
    engine.load_weights(base.state_dict(), whole)
    assert engine.adapters.name(whole) == "policy"
    assert sampled_against(engine, base, tok, whole) < SERVED_TOLERANCE
    first = next_version(engine)
    for version in (first, first + 1, first + 2):
        published, policy = adapter(base, version)
        engine.load_weights(published, version)
        assert engine.adapters.name(version) == f"v{version}"
        assert engine.adapters.last_difference < SERVED_TOLERANCE
        assert sampled_against(engine, policy, tok, version) < SERVED_TOLERANCE
    # the newest max_loras stay loaded; the older one is unloaded and its directory removed
    assert list(engine.adapters.files.held) == [first + 1, first + 2]
    assert {p.name for p in engine.adapters.files.dir.iterdir()} == {
        engine.adapters.files.path(f"v{v}").name for v in (first + 1, first + 2)}
    listed = {entry["id"] for entry in engine.client.get("/v1/models")["data"]}
    assert listed == {"policy", f"v{first + 1}", f"v{first + 2}"}


def test_a_collector_started_past_version_0_gives_the_server_the_base_with_its_first_adapter(served):
    # the server holds other whole weights (as a server at a URL may); the adapter brings its base
    engine, base, tok = served
    other, _ = tiny_model_and_tokenizer(seed=5, **SHAPE)
    engine.load_weights(other.state_dict(), next_version(engine))
    assert sampled_against(engine, other, tok, engine.policy_version) < SERVED_TOLERANCE
    version = next_version(engine)
    published, policy = adapter(base, version)
    published.base = base.state_dict()
    engine.load_weights(published, version)
    assert sampled_against(engine, policy, tok, version) < SERVED_TOLERANCE


class SkipsTheLoad(ServedAdapters):
    """The stale adapter of the field (ms-swift #9855, verl #3516): the new version's load is skipped and
    its rows go to the adapter the server still holds."""

    def _put(self, name, path, version):
        if version is None:
            super()._put(name, path, version)

    def name(self, version):
        held = [v for v in self.files.held if v != version]
        return self.loaded_name(held[-1]) if held else self.served_model


class SamplesTheBase(ServedAdapters):
    """The adapter loaded, and every request naming the base (verl #5211, SkyRL #1776)."""

    def name(self, version):
        return self.served_model


@pytest.mark.parametrize("kind", [SkipsTheLoad, SamplesTheBase], ids=["stale-adapter", "base-sampled"])
def test_an_engine_that_samples_another_policy_than_the_version_fails_the_canary(served, kind):
    engine, base, tok = served
    held = engine.policy_version
    if held == 0 or held not in engine.adapters.files.held:  # the stale case needs an adapter held
        published, _ = adapter(base, next_version(engine))
        engine.load_weights(published, next_version(engine))
        held = engine.policy_version
    version = held + 5
    published, _ = adapter(base, version)
    with adapters_as(engine, kind), pytest.raises(ServedPolicyMismatch) as refused:
        engine.load_weights(published, version)
    assert str(refused.value).startswith(f"served-policy check failed for weights version {version}: ")
    assert "no row of it is stored" in str(refused.value)
    assert engine.policy_version == held and version not in engine.adapters.files.held


class SameNameInPlace(ServedAdapters):
    """The lifecycle not chosen: every version written over one directory and loaded under one name in
    place (``load_inplace``), the prefix cache left warm."""

    def _put(self, name, path, version):
        if version is None:
            return super()._put(name, path, version)
        one = self.files.dir / "in-place"
        shutil.rmtree(one, ignore_errors=True)
        shutil.copytree(path, one)
        self.client.post("/v1/load_lora_adapter", {"lora_name": "in-place", "lora_path": str(one),
                                                   "load_inplace": True}, text=True)

    def name(self, version):
        return "in-place" if version in self.files.held else self.served_model


def test_a_same_name_reload_in_place_serves_the_old_versions_cached_blocks_and_fails_the_canary(served):
    # vLLM keys its cached blocks by the adapter's name and path: one name and one directory reuse the
    # previous version's keys and values for the canary prompt's first block (vLLM #42125)
    engine, base, tok = served
    first = next_version(engine)
    with adapters_as(engine, SameNameInPlace):
        engine.load_weights(adapter(base, first)[0], first)  # nothing cached under the name yet: served right
        assert engine.adapters.last_difference < SERVED_TOLERANCE
        with pytest.raises(ServedPolicyMismatch) as refused:
            engine.load_weights(adapter(base, first + 1)[0], first + 1)
    assert f"weights version {first + 1}: the server's log-probs of the canary tokens it sampled under " \
           f"'in-place' differ" in str(refused.value)
    engine.adapters.files.remove(engine.adapters.files.held.pop(first))
    engine.client.post("/v1/unload_lora_adapter", {"lora_name": "in-place"}, text=True)
    shutil.rmtree(engine.adapters.files.dir / "in-place")  # the module's engine is shared: leave its directory as found


SERVED_LAYERS = "down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj"
"""The layers vLLM 0.32 takes adapters for on a Qwen2: its linear layers (the packed qkv_proj and
gate_up_proj by their parts), not lm_head (a ParallelLMHead) nor the embeddings."""


def test_an_adapter_with_an_lm_head_target_is_refused_naming_the_version(served):
    # settings refuse lm_head (vLLM #51594 drops its delta from prompt_logprobs); one built by hand is
    # refused against the layers the server takes adapters for, before the server is asked to load it
    engine, base, tok = served
    assert ",".join(engine.adapters.served_layers) == SERVED_LAYERS
    version = next_version(engine)
    published, _ = adapter(base, version, targets=[*LORA.target_modules, "lm_head"])
    with pytest.raises(ServedPolicyMismatch, match=rf"setting 'learner.lora.target_modules' .*takes adapters on "
                                                   rf"{SERVED_LAYERS} of this model, not on lm_head, so it cannot "
                                                   rf"serve weights version {version}'s adapter"):
        engine.load_weights(published, version)
    assert version not in engine.adapters.files.held
    assert f"v{version}" not in {entry["id"] for entry in engine.client.get("/v1/models")["data"]}


def test_targets_the_server_takes_no_adapter_for_are_refused_before_any_row(served, tmp_path):
    # checked at the engine's start against the layers the server serves, not read from vLLM's error text
    engine, base, tok = served
    serving = AdapterServing(rank=8, alpha=16.0, target_modules=("q_proj", "lm_head"), max_loras=2)
    with pytest.raises(ServerMismatch, match=rf"^setting 'learner.lora.target_modules' \(q_proj,lm_head\): the vLLM "
                                             rf"server at .* takes adapters on {SERVED_LAYERS} of this model, not on "
                                             rf"lm_head, so it cannot serve this run's adapters"):
        VLLMURLEngine(engine.server.base_url, copy.deepcopy(base), stop_token_ids=[tok.eos_token_id],
                      served_model="policy", weights_dir=tmp_path, adapters=serving)
    assert not any(entry["id"].startswith("zero-adapter-check") for entry in engine.client.get("/v1/models")["data"])


def test_an_adapter_the_server_cannot_serve_is_refused_naming_the_setting(served):
    engine, base, tok = served
    version = next_version(engine)
    too_wide, _ = adapter(base, version, rank=16)  # the server was started with --max-lora-rank 8
    with pytest.raises(ServedPolicyMismatch, match=r"setting 'learner.lora.rank' is 8.*rank 16 is greater than "
                                                   r"max_lora_rank 8"):
        engine.load_weights(too_wide, version)
    saves, _ = adapter(base, version, modules_to_save=["lm_head"])
    with pytest.raises(ServedPolicyMismatch, match=r"modules_to_save"):
        engine.load_weights(saves, version)


def test_an_adapter_trained_on_another_base_is_refused_before_the_server_samples_it(served):
    # the reference (the engine's model with the version merged) must score the learner's canary first
    engine, base, tok = served
    other, _ = tiny_model_and_tokenizer(seed=9, **SHAPE)
    version = next_version(engine)
    published, _ = adapter(other, version)
    with pytest.raises(ServedPolicyMismatch, match=rf"weights version {version}: the log-probs of the canary tokens "
                                                   r"under the base this engine holds with the adapter merged differ"):
        engine.load_weights(published, version)
    assert version not in engine.adapters.files.held


@pytest.mark.slow
def test_a_restarted_server_is_given_the_adapter_of_the_version_it_held(served):
    engine, base, tok = served
    version = next_version(engine)
    published, policy = adapter(base, version)
    engine.load_weights(published, version)
    kept, engine.retries = engine.retries, Retries(retries=2, backoff_s=0.1)
    try:
        pid = engine.pid
        os.kill(pid, signal.SIGKILL)
        engine.server.process.process.wait(timeout=60)
        difference = sampled_against(engine, policy, tok, version)  # unanswered: a new server answers it
        assert engine.pid != pid and not process_running(pid)
        assert difference < SERVED_TOLERANCE
        assert engine.adapters.name(version) == f"v{version}"
    finally:
        engine.retries = kept


def test_a_zero_adapter_version_samples_as_the_base(served):
    # the engine's start loaded a zero adapter of the run's rank and targets and checked it likewise
    engine, base, tok = served
    version = next_version(engine)
    engine.load_weights(adapter(base, version, scale=0.0)[0], version)
    assert engine.adapters.name(version) == f"v{version}"
    assert sampled_against(engine, base, tok, version) < SERVED_TOLERANCE
    assert canary_tolerance(torch.float32) == 1e-3  # the loop's tolerance: one canary for both engines


def test_a_server_at_a_url_given_adapters_inline_writes_and_serves_them_itself(served, tmp_path):
    # generation.weight_transfer=inline: a server on a machine with no file system in common writes each
    # adapter's directory where it reads it (our worker extension), names tagged as on any shared server
    engine, base, tok = served
    url = VLLMURLEngine(engine.server.base_url, copy.deepcopy(base), stop_token_ids=[tok.eos_token_id],
                        served_model="policy", inline_weights=True, weights_dir=tmp_path, adapters=SERVING)
    try:
        version = 1
        published, policy = adapter(base, 500)
        published.canary["version"] = version
        url.load_weights(published, version)
        name = url.adapters.name(version)
        assert name.startswith(f"v{version}-") and url.adapters.last_difference < SERVED_TOLERANCE
        assert sampled_against(url, policy, tok, version) < SERVED_TOLERANCE
    finally:
        url.close()
    assert not (tmp_path / "adapters").exists() or not any((tmp_path / "adapters").iterdir())
    assert name not in {entry["id"] for entry in engine.client.get("/v1/models")["data"]}  # unloaded by close
