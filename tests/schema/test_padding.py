"""The padded learner batch: exact layout, alignment, and what torchrl's GRPOLoss reads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_pipeline.schema.padding import PaddedCollator, pad_batch
from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.schema import OPTIONAL_FIELDS, TrajectoryBatch
from rlhf_pipeline.schema.synthetic import synthetic_batch

ALL_OPTIONAL = tuple(OPTIONAL_FIELDS)
RESPONSE_FLOATS = {
    "response_log_probs": (("log_probs", "full"), ("log_probs", "response")),
    "ref_log_probs": (("next", "ref_log_probs", "full"), ("ref_log_probs", "response")),
    "kl": (("kl", "full"), ("kl", "response")),
    "token_rewards": (("next", "token_reward", "full"), ("next", "token_reward", "response")),
}


def reference_pad(batch: TrajectoryBatch, pad_token_id: int) -> dict:
    """A deliberately plain per-row implementation of the documented layout."""
    n = len(batch)
    prompts = batch["prompt_tokens"].to_list()
    responses = batch["response_tokens"].to_list()
    P = max(len(p) for p in prompts)
    R = max(len(r) for r in responses)
    T = P + R
    tokens = torch.full((n, T), pad_token_id, dtype=torch.int64)
    attention = torch.zeros((n, T), dtype=torch.bool)
    assistant = torch.zeros((n, T), dtype=torch.bool)
    positions = torch.zeros((n, T), dtype=torch.int64)
    floats = {name: torch.zeros((n, T)) for name in RESPONSE_FLOATS if name in batch}
    for i in range(n):
        p, r = prompts[i], responses[i]
        for j, tok in enumerate(p):
            col = P - len(p) + j
            tokens[i, col] = int(tok)
            attention[i, col] = True
            positions[i, col] = j
        for j, tok in enumerate(r):
            col = P + j
            tokens[i, col] = int(tok)
            attention[i, col] = True
            assistant[i, col] = True
            positions[i, col] = len(p) + j
            for name in floats:
                floats[name][i, col] = float(batch[name].row(i)[j])
        positions[i, P + len(r):] = len(p) + len(r) - 1  # cumsum stays flat on right padding
    out = {
        ("tokens", "full"): tokens,
        ("tokens", "prompt"): tokens[:, :P],
        ("tokens", "response"): tokens[:, P:],
        ("masks", "all_attention_mask"): attention,
        ("masks", "all_assistant_mask"): assistant,
        ("masks", "prompt"): attention[:, :P],
        ("masks", "response"): assistant[:, P:],
        "position_ids": positions,
        "prompt_lengths": torch.tensor([len(p) for p in prompts]),
        "response_lengths": torch.tensor([len(r) for r in responses]),
    }
    for name, (full_key, response_key) in RESPONSE_FLOATS.items():
        if name in floats:
            out[full_key] = floats[name]
            out[response_key] = floats[name][:, P:]
    if "advantage" in batch:
        adv = batch["advantage"].float()
        out["sequence_advantage"] = adv
        out["advantage"] = (assistant.float() * adv[:, None]).unsqueeze(-1)
    for name in ("reward", "done", "terminated", "truncated"):
        out[("next", name)] = batch[name].reshape(n, 1)
    for name in ("group_id", "trajectory_id", "step", "policy_version"):
        out[name] = batch[name]
    return out


def assert_matches_reference(td, batch, pad_token_id):
    expected = reference_pad(batch, pad_token_id)
    got_keys = set(td.keys(include_nested=True, leaves_only=True))
    assert got_keys == set(expected), f"keys differ: {got_keys ^ set(expected)}"
    for key, want in expected.items():
        got = td.get(key)
        assert got.dtype == want.dtype, f"{key}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{key}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got, want), f"{key} differs from the per-row reference"


FLAGS = dict(step=0, done=True, terminated=True, truncated=False)


def test_exact_layout_on_a_hand_built_batch():
    batch = TrajectoryBatch.from_rows([
        dict(prompt_tokens=[5, 6, 7], response_tokens=[8], response_log_probs=[-0.5], group_id=0,
             trajectory_id=0, reward=1.0, policy_version=3, prompt_text="a", response_text="b", advantage=0.5, **FLAGS),
        dict(prompt_tokens=[9], response_tokens=[10, 11, 12], response_log_probs=[-1.0, -2.0, -3.0],
             group_id=0, trajectory_id=1, reward=0.0, policy_version=3, prompt_text="c", response_text="d",
             advantage=-0.5, **FLAGS),
    ])
    td = pad_batch(batch, pad_token_id=99)
    assert td.batch_size == torch.Size([2])
    assert td["tokens", "full"].tolist() == [[5, 6, 7, 8, 99, 99], [99, 99, 9, 10, 11, 12]]
    assert td["masks", "all_assistant_mask"].tolist() == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 1]]
    assert td["position_ids"].tolist() == [[0, 1, 2, 3, 3, 3], [0, 0, 0, 1, 2, 3]]
    assert td["log_probs", "full"].tolist() == [[0, 0, 0, -0.5, 0, 0], [0, 0, 0, -1.0, -2.0, -3.0]]
    assert td["log_probs", "response"].tolist() == [[-0.5, 0, 0], [-1.0, -2.0, -3.0]]
    assert td["advantage"].squeeze(-1).tolist() == [[0, 0, 0, 0.5, 0, 0], [0, 0, 0, -0.5, -0.5, -0.5]]
    assert td["next", "reward"].tolist() == [[1.0], [0.0]]
    assert_matches_reference(td, batch, 99)


@pytest.mark.parametrize("optional", [(), ALL_OPTIONAL])
def test_matches_reference_on_synthetic_batches(optional):
    batch = synthetic_batch(24, group_size=4, prompt_len=(1, 9), response_len=(1, 12), vocab_size=50,
                            optional_fields=optional, seed=3)
    assert_matches_reference(pad_batch(batch, pad_token_id=7), batch, 7)


@settings(max_examples=40, deadline=None)
@given(
    prompt_lengths=st.lists(st.integers(1, 8), min_size=1, max_size=6),
    data=st.data(),
    pad_token_id=st.integers(0, 1000),
    optional=st.lists(st.sampled_from(ALL_OPTIONAL), unique=True),
)
def test_matches_reference_for_random_lengths(prompt_lengths, data, pad_token_id, optional):
    n = len(prompt_lengths)
    response_lengths = data.draw(st.lists(st.integers(1, 8), min_size=n, max_size=n))
    generator = torch.Generator().manual_seed(len(optional) * 31 + n)
    pl, rl = torch.tensor(prompt_lengths), torch.tensor(response_lengths)
    columns = {
        "prompt_tokens": RaggedTensor.from_lengths(torch.randint(0, 2000, (int(pl.sum()),), generator=generator,
                                                                 dtype=torch.int32), pl),
        "response_tokens": RaggedTensor.from_lengths(torch.randint(0, 2000, (int(rl.sum()),), generator=generator,
                                                                   dtype=torch.int32), rl),
        "response_log_probs": RaggedTensor.from_lengths(-torch.rand(int(rl.sum()), generator=generator), rl),
        "group_id": torch.arange(n), "trajectory_id": torch.arange(n), "step": torch.zeros(n, dtype=torch.int32),
        "reward": torch.rand(n, generator=generator), "done": torch.ones(n, dtype=torch.bool),
        "terminated": torch.ones(n, dtype=torch.bool), "truncated": torch.zeros(n, dtype=torch.bool),
        "policy_version": torch.zeros(n, dtype=torch.int64),
        "prompt_text": ["p"] * n, "response_text": ["r"] * n,
    }
    for name in optional:
        if name == "advantage":
            columns[name] = torch.randn(n, generator=generator)
        else:
            columns[name] = RaggedTensor.from_lengths(-torch.rand(int(rl.sum()), generator=generator), rl)
    batch = TrajectoryBatch(columns)
    assert_matches_reference(pad_batch(batch, pad_token_id=pad_token_id), batch, pad_token_id)


def test_same_layout_as_ragged_to_padded():
    batch = synthetic_batch(16, prompt_len=(3, 20), response_len=(2, 30), vocab_size=100, seed=5)
    td = pad_batch(batch, pad_token_id=1)
    prompt, _ = batch["prompt_tokens"].to_padded(1, side="left")
    response, response_mask = batch["response_tokens"].to_padded(1, side="right")
    log_probs, _ = batch["response_log_probs"].to_padded(0.0, side="right")
    assert torch.equal(td["tokens", "prompt"], prompt.long())
    assert torch.equal(td["tokens", "response"], response.long())
    assert torch.equal(td["masks", "response"], response_mask)
    assert torch.equal(td["log_probs", "response"], log_probs)


def test_log_probs_sit_on_the_columns_of_the_tokens_they_score():
    batch = synthetic_batch(32, optional_fields=ALL_OPTIONAL, prompt_len=(4, 40), response_len=(4, 60), seed=9)
    td = pad_batch(batch)
    mask = td["masks", "all_assistant_mask"]
    # reading the response columns row-major gives back the stored ragged values, in order
    assert torch.equal(td["tokens", "full"][mask], batch["response_tokens"].values.long())
    assert torch.equal(td["log_probs", "full"][mask], batch["response_log_probs"].values)
    assert torch.equal(td["next", "ref_log_probs", "full"][mask], batch["ref_log_probs"].values)
    assert torch.equal(td["kl", "full"][mask], batch["kl"].values)
    assert torch.equal(td["next", "token_reward", "full"][mask], batch["token_rewards"].values)
    for key in (("log_probs", "full"), ("kl", "full"), ("next", "ref_log_probs", "full")):
        assert not td[key][~mask].any(), f"{key} must be 0 outside the response"
    attention = td["masks", "all_attention_mask"]
    assert torch.equal(td["position_ids"], (attention.cumsum(1) - 1).clamp_min(0))
    assert torch.equal(td["masks", "prompt"].sum(1), batch["prompt_tokens"].lengths())
    assert torch.equal(td["response_lengths"], batch["response_tokens"].lengths())


def test_bad_input_gets_a_clear_error():
    with pytest.raises(TypeError, match="TrajectoryBatch"):
        pad_batch({"prompt_tokens": 1})
    batch = synthetic_batch(4).without("response_log_probs")
    with pytest.raises(KeyError, match="response_log_probs"):
        pad_batch(batch)
    batch = synthetic_batch(4, response_len=(3, 6), optional_fields=("kl",))
    kl = batch["kl"]
    short = RaggedTensor.from_lengths(kl.values[:-1], torch.cat([kl.lengths()[:-1], kl.lengths()[-1:] - 1]))
    with pytest.raises(ValueError, match="'kl' must hold one value per response token"):
        pad_batch(batch.with_columns(kl=short))


def test_pin_memory_and_device():
    batch = synthetic_batch(8, seed=1)
    td = pad_batch(batch, pin_memory=True, device="cpu")
    # pinning is a documented no-op without CUDA (it would raise on CPU-only torch)
    assert td["tokens", "full"].is_pinned() == torch.cuda.is_available()
    assert td.device == torch.device("cpu")
    assert torch.equal(td["tokens", "full"], pad_batch(batch)["tokens", "full"])


def test_collator_in_a_torchrl_replay_buffer():
    from torchrl.data import LazyStackStorage, ReplayBuffer

    batch = synthetic_batch(16, prompt_len=(2, 10), response_len=(2, 10), optional_fields=("advantage",), seed=2)
    buffer = ReplayBuffer(storage=LazyStackStorage(max_size=16), collate_fn=PaddedCollator(pad_token_id=3),
                          batch_size=4)
    buffer.extend(batch.to_tensordict())
    sample = buffer.sample()
    assert sample.batch_size == torch.Size([4])
    rows = batch.select(sample["trajectory_id"])
    assert_matches_reference(sample, rows, 3)
    with pytest.raises(TypeError, match="PaddedCollator"):
        PaddedCollator()([1, 2])


# ------------------------------------------------------------------------ torchrl GRPOLoss
def _tiny_policy(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from torchrl.modules.llm import TransformersWrapper
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = Qwen2ForCausalLM(config).eval()
    word_level = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="t0", eos_token="t2", unk_token="t1")
    wrapper = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=False,
                                  return_log_probs=True, pad_output=True)
    return model, wrapper


def _own_log_probs(model, td) -> torch.Tensor:
    """log p(token t | tokens < t) under ``model`` on response columns, 0 elsewhere: (B, T)."""
    tokens = td["tokens", "full"]
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=td["masks", "all_attention_mask"].long(),
                       position_ids=td["position_ids"]).logits
    log_probs = torch.zeros(tokens.shape)
    log_probs[:, 1:] = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return log_probs * td["masks", "all_assistant_mask"]


def test_torchrl_grpo_loss_reads_the_padded_batch():
    from torchrl.objectives.llm.grpo import GRPOLoss

    vocab_size = 64
    batch = synthetic_batch(6, group_size=3, prompt_len=(2, 6), response_len=(1, 5), vocab_size=vocab_size,
                            optional_fields=("advantage", "ref_log_probs"), seed=4)
    batch = batch.with_columns(advantage=torch.tensor([1.0, -0.5, 0.25, 2.0, -1.0, 0.5]))
    td = pad_batch(batch)
    model, policy = _tiny_policy(vocab_size)
    own = _own_log_probs(model, td)
    td.set(("log_probs", "full"), own)  # as if the batch had been sampled by this very policy

    loss = GRPOLoss(policy, masking_strategy="sft", entropy_bonus=False, kl_to_ref_coeff=0.1)
    out = loss(td)
    # ratio 1 everywhere: no drift, no clipping, and the objective is -(token mean of the advantage)
    torch.testing.assert_close(out.kl_approx, torch.tensor(0.0), atol=1e-5, rtol=0)
    assert float(out.clip_fraction) == 0.0
    mask = td["masks", "all_assistant_mask"]
    expected = -td["advantage"].squeeze(-1)[mask].mean()
    torch.testing.assert_close(out.loss_objective, expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out.loss_kl_to_ref)

    # the same log-probs one column off no longer match: the alignment above is not vacuous
    td.set(("log_probs", "full"), torch.roll(own, 1, dims=1))
    assert float(loss(td).kl_approx.abs()) > 1e-3


def test_padded_fields_are_every_field_but_text():
    from rlhf_pipeline.schema.padding import padded_fields
    from rlhf_pipeline.schema import StoreSchema

    schema = StoreSchema(("advantage", "kl"))
    fields = padded_fields(schema)
    assert "prompt_text" not in fields and "response_text" not in fields
    assert set(fields) | {"prompt_text", "response_text"} == set(schema.field_names)
    batch = synthetic_batch(8, optional_fields=("advantage", "kl"))
    slim = TrajectoryBatch({name: batch[name] for name in fields})
    full_td, slim_td = pad_batch(batch), pad_batch(slim)
    for key in full_td.keys(True, True):
        assert torch.equal(full_td[key], slim_td[key])


def test_collator_read_uses_the_stores_fused_path_and_falls_back_to_pad_batch(tmp_path):
    from rlhf_pipeline.schema.padding import padded_fields
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore

    batch = synthetic_batch(40, group_size=4, prompt_len=(1, 9), response_len=(1, 12),
                            optional_fields=ALL_OPTIONAL, seed=5)
    positions = torch.tensor([39, 0, 17, 17, 8, 31])
    expected = pad_batch(batch.select(positions), pad_token_id=5)  # pad_batch ignores the text fields

    class PlainStore:  # a store without read_padded: read (no text) + pad_batch
        schema = StoreSchema(ALL_OPTIONAL)

        def read(self, positions, *, fields=None):
            assert fields == padded_fields(self.schema)
            return batch.select(torch.as_tensor(positions))

    collator = PaddedCollator(pad_token_id=5)
    with MemmapTrajectoryStore.create(tmp_path / "b", StoreSchema(ALL_OPTIONAL), segment_rows=16,
                                      durable=False) as store:
        store.append(batch)
        for got in (collator.read(store, positions), collator.read(PlainStore(), positions)):
            assert set(got.keys(True, True)) == set(expected.keys(True, True))
            for key in expected.keys(True, True):
                assert got[key].dtype == expected[key].dtype, key
                assert torch.equal(got[key], expected[key]), key
        assert_matches_reference(collator.read(store, positions), batch.select(positions), 5)


def test_padded_layout_holds_when_batches_grow_and_shrink():
    """The length templates grow with the widest batch seen; later narrower batches still match."""
    for seed, (prompt_len, response_len) in enumerate([((1, 3), (1, 4)), ((40, 300), (100, 1500)),
                                                      ((1, 2), (1, 2)), ((2, 9), (3, 2100))]):
        batch = synthetic_batch(6, group_size=3, prompt_len=prompt_len, response_len=response_len,
                                optional_fields=("advantage",), seed=seed)
        assert_matches_reference(pad_batch(batch, pad_token_id=4), batch, 4)


def test_non_finite_advantage_stays_on_the_response_columns():
    """pad_batch takes unvalidated batches too: a nan/inf advantage must not leak onto padding."""
    batch = synthetic_batch(4, group_size=2, prompt_len=(2, 5), response_len=(1, 6),
                            optional_fields=("advantage",), seed=7)
    batch = batch.with_columns(advantage=torch.tensor([float("nan"), -2.0, float("inf"), 0.5]))
    td = pad_batch(batch)
    advantage, mask = td["advantage"].squeeze(-1), td["masks", "all_assistant_mask"]
    assert torch.equal(advantage[~mask], torch.zeros(int((~mask).sum())))
    assert torch.isnan(advantage[0][mask[0]]).all() and torch.isinf(advantage[2][mask[2]]).all()
    assert torch.equal(advantage[1][mask[1]], torch.full((int(mask[1].sum()),), -2.0))
    # with finite advantages the padding is +0.0, never -0.0 (a negative advantage times 0)
    finite = pad_batch(batch.with_columns(advantage=torch.tensor([-1.0, -2.0, -3.0, 0.5])))
    off = finite["advantage"].squeeze(-1)[~finite["masks", "all_assistant_mask"]]
    assert not torch.signbit(off).any()


def test_replay_buffer_sample_reads_through_the_fused_path(tmp_path, monkeypatch):
    """make_replay_buffer's sample() with a PaddedCollator reads store.read_padded and returns
    what torchrl's get + collate would; other collate functions keep torchrl's path."""
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store, make_replay_buffer
    from rlhf_pipeline.storage.base import TrajectoryStore

    calls = []
    real_read_padded = TrajectoryStore.read_padded

    def counting_read_padded(self, positions, **kwargs):  # the real method, counted
        calls.append(len(positions))
        return real_read_padded(self, positions, **kwargs)

    monkeypatch.setattr(TrajectoryStore, "read_padded", counting_read_padded)
    batch = synthetic_batch(48, group_size=4, prompt_len=(1, 9), response_len=(1, 12),
                            optional_fields=("advantage", "ref_log_probs"), seed=8)
    with create_store(tmp_path / "b", "memmap", schema=StoreSchema(("advantage", "ref_log_probs")),
                      segment_rows=16) as store:
        store.append(batch)
        fused = make_replay_buffer(store, batch_size=8, collate_fn=PaddedCollator(pad_token_id=2))
        plain = make_replay_buffer(store, batch_size=8, collate_fn=lambda rows: pad_batch(rows, pad_token_id=2))
        for seed in range(3):
            torch.manual_seed(seed)
            got, info = fused.sample(return_info=True)
            torch.manual_seed(seed)
            expected = plain.sample()
            assert set(got.keys(True, True)) == set(expected.keys(True, True))
            for key in expected.keys(True, True):
                assert torch.equal(got[key], expected[key]), key
            assert torch.equal(got["trajectory_id"], batch["trajectory_id"][info["index"]])
    assert calls == [8, 8, 8]  # only the PaddedCollator buffer took the fused path


@pytest.mark.parametrize("backend", ["memmap", "zarr"])
def test_int32_index_dtype_halves_ids_and_positions_and_nothing_else_changes(tmp_path, backend):
    """The learner's batches: token ids and position_ids as int32, every value as in the default."""
    from helpers import assert_same_padded

    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store

    batch = synthetic_batch(40, group_size=4, prompt_len=(1, 9), response_len=(1, 12),
                            optional_fields=ALL_OPTIONAL, seed=6)
    wide, narrow = pad_batch(batch, pad_token_id=3), pad_batch(batch, pad_token_id=3, index_dtype=torch.int32)
    narrowed = {("tokens", "full"), ("tokens", "prompt"), ("tokens", "response"), "position_ids"}
    for key in wide.keys(True, True):
        assert narrow[key].dtype == (torch.int32 if key in narrowed else wide[key].dtype), key
        assert torch.equal(narrow[key].to(wide[key].dtype), wide[key]), key
    positions = torch.tensor([39, 0, 17, 17, 8, 31])
    with create_store(tmp_path / "b", backend, schema=StoreSchema(ALL_OPTIONAL), segment_rows=16) as store:
        store.append(batch)
        got = PaddedCollator(pad_token_id=3, index_dtype=torch.int32).read(store, positions)
        assert_same_padded(got, pad_batch(batch.select(positions), pad_token_id=3, index_dtype=torch.int32))
    with pytest.raises(ValueError, match="index_dtype must be torch.int64 .* or torch.int32"):
        PaddedCollator(index_dtype=torch.int16)
