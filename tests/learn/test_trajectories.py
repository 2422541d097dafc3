"""Multi-turn trajectories trained as one sequence each (learn/trajectories.py).

The reference is computed by hand: for each trajectory, ``rebuild_trajectory`` gives its token
list, loss mask and sampling log-probs; one teacher-forced forward over that token list (no
padding, no packing) gives the current log-probs; the GRPO terms are written out on the masked
tokens. The learner's padded and packed steps (``plan_step``'s micro-batches and weights, then
``grpo_step_loss`` / ``grpo_packed_loss``) must give the same loss and gradients (float32, 1e-5).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from rlhf_pipeline.agents.episode import rebuild_trajectory
from rlhf_pipeline.coordination.weights import load_weights, publish_weights
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.learn.batch import PackedMicroBatch
from rlhf_pipeline.learn.learner import Learner
from rlhf_pipeline.learn.loss import grpo_packed_loss, grpo_step_loss
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.learn.packed_attention import use_packed_attention
from rlhf_pipeline.learn.samplers.exact import ExactUseSampler
from rlhf_pipeline.learn.samplers.window import FreshRowSampler
from rlhf_pipeline.learn.settings import GRPOLossConfig, LearnerSettings
from rlhf_pipeline.learn.step import plan_step
from rlhf_pipeline.learn.trajectories import (
    TOKEN_ADVANTAGE_KEY,
    is_single_turn,
    join_turns,
    masked_by_reason,
    pad_trajectories,
    read_trajectories,
    termination_codes,
    trajectory_draw,
)
from rlhf_pipeline.models.tiny import tiny_causal_lm
from rlhf_pipeline.schema import StoreSchema, TerminationReason, TrajectoryBatch
from rlhf_pipeline.schema.padding import PaddedCollator, pad_batch
from rlhf_pipeline.schema.synthetic import batch_with_lengths
from rlhf_pipeline.storage import create_store, open_buffer
from rlhf_pipeline.storage.sharded import shard_path

VOCAB = 97
TURNS = [3, 1, 4, 2, 2]  # one single-turn trajectory among multi-turn ones
OPTIONAL = ("advantage", "ref_log_probs", "termination_reason")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(seed: int = 0):
    return tiny_causal_lm(VOCAB, hidden_size=32, num_layers=2, num_heads=4, pad_token_id=0, eos_token_id=1,
                          seed=seed).train()


def multi_turn_rows(turns, *, seed: int = 0, first_id: int = 0, reasons=None) -> TrajectoryBatch:
    """Trajectory j has ``turns[j]`` rows (steps 0..n-1, the last done with ``reasons[j]``,
    ENV_DONE by default); opening prompts of 6-14 tokens, environment turns of 2-9, sampled turns
    of 1-8. Advantages differ from row to row (so per-turn and per-trajectory modes differ),
    mostly positive (see test_packing's ``_batch`` on why)."""
    g = torch.Generator().manual_seed(seed + 100)
    turns_t = torch.tensor(turns)
    step = torch.cat([torch.arange(n) for n in turns])
    n = len(step)
    prompt_lengths = torch.where(step == 0, torch.randint(6, 15, (n,), generator=g),
                                 torch.randint(2, 10, (n,), generator=g))
    response_lengths = torch.randint(1, 9, (n,), generator=g)
    base = batch_with_lengths(prompt_lengths, response_lengths, group_size=1, seed=seed, vocab_size=VOCAB,
                              optional_fields=("advantage", "ref_log_probs"))
    trajectory = torch.arange(len(turns)).repeat_interleave(turns_t)
    last = step == turns_t[trajectory] - 1
    reasons = reasons or [TerminationReason.ENV_DONE] * len(turns)
    code = torch.tensor([int(r) for r in reasons], dtype=torch.int32)[trajectory]
    code = torch.where(last, code, torch.zeros_like(code))
    terminated = torch.tensor([TerminationReason(int(c)).terminated for c in code])
    truncated = torch.tensor([TerminationReason(int(c)).truncated for c in code])
    return base.with_columns(
        trajectory_id=(trajectory + first_id).to(torch.int64), group_id=((trajectory + first_id) // 2).to(torch.int64),
        step=step.to(torch.int32), done=last, terminated=terminated, truncated=truncated, termination_reason=code,
        advantage=(1.0 + 0.7 * torch.randn(n, generator=g)).to(torch.float32),
        policy_version=torch.zeros(n, dtype=torch.int64))


def trajectories_of(rows: TrajectoryBatch) -> list[TrajectoryBatch]:
    ids = rows["trajectory_id"]
    return [rows.select(torch.nonzero(ids == t).squeeze(1)) for t in torch.unique_consecutive(ids).tolist()]


def with_sampler_log_probs_near(model, rows: TrajectoryBatch, seed: int = 0) -> TrajectoryBatch:
    """``rows`` whose stored sampling log-probs are ``model``'s own (teacher-forced over each
    rebuilt trajectory) plus noise of 0.05, and reference log-probs plus noise of 0.1: ratios
    stay near 1, so most tokens carry gradient."""
    g = torch.Generator().manual_seed(seed + 7)
    sampled = []
    with torch.no_grad():
        for trajectory in trajectories_of(rows):
            rebuilt = rebuild_trajectory(trajectory)
            own = _token_log_probs(model, rebuilt.token_ids)
            sampled.append(own[rebuilt.loss_mask[1:]])  # the turns' sampled tokens, turn after turn
    own = torch.cat(sampled)
    lengths = rows["response_tokens"].lengths()
    log_probs = own + 0.05 * torch.randn(own.shape, generator=g)
    ref = own + 0.1 * torch.randn(own.shape, generator=g)
    ragged = rows["response_log_probs"]
    return rows.with_columns(response_log_probs=type(ragged).from_lengths(log_probs.float(), lengths),
                             ref_log_probs=type(ragged).from_lengths(ref.float(), lengths))


def _token_log_probs(model, token_ids: torch.Tensor) -> torch.Tensor:
    """(L-1,) log-prob of tokens 1..L-1 given the tokens before them: one plain forward."""
    tokens = token_ids.long()[None]
    logits = model(input_ids=tokens).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None]).squeeze(-1)


# ====================================================================== the hand-written reference
def reference_loss(model, rows: TrajectoryBatch, config: GRPOLossConfig, turn_advantage: str) -> torch.Tensor:
    """The GRPO loss of ``rows``' trajectories, from rebuild_trajectory's token lists (see the module docstring)."""
    per_trajectory = []  # (policy terms, k3 terms) on each trajectory's sampled tokens
    for trajectory in trajectories_of(rows):
        rebuilt = rebuild_trajectory(trajectory)
        order = torch.argsort(trajectory["step"].to(torch.int64)).tolist()
        advantage, ref = [], []
        for i in order:
            prompt, response = len(trajectory["prompt_tokens"].row(i)), len(trajectory["response_tokens"].row(i))
            value = trajectory["advantage"][i] if turn_advantage == "turn" else trajectory["advantage"][order[-1]]
            advantage += [torch.zeros(prompt), torch.full((response,), float(value))]
            ref += [torch.zeros(prompt), trajectory["ref_log_probs"].row(i)]
        mask = rebuilt.loss_mask[1:]  # token t is scored from position t - 1
        logp = _token_log_probs(model, rebuilt.token_ids)[mask]
        old = rebuilt.log_probs[1:][mask]
        adv = torch.cat(advantage)[1:][mask]
        ref = torch.cat(ref)[1:][mask]
        if config.ratio_level == "sequence":  # GSPO: s = exp(mean(logp - old)), gradient s * d logp
            s = (logp - old).mean().exp()
            ratio = s.detach() * torch.exp(logp - logp.detach())
        else:
            ratio = torch.exp(logp - old)
        clipped = ratio.clamp(1 - config.clip_eps_low, 1 + config.clip_eps_high)
        policy = -torch.minimum(ratio * adv, clipped * adv)
        k3 = torch.exp(ref - logp) - (ref - logp) - 1
        per_trajectory.append((policy, k3))
    if config.aggregation == "token_mean":
        loss = torch.cat([p for p, _ in per_trajectory]).mean()
        kl = torch.cat([k for _, k in per_trajectory]).mean()
    else:  # sequence_mean: each trajectory's mean over its sampled tokens, then the mean over trajectories
        loss = torch.stack([p.mean() for p, _ in per_trajectory]).mean()
        kl = torch.stack([k.mean() for _, k in per_trajectory]).mean()
    return loss + config.kl_coef * kl


def learner_step(model, batch, settings: LearnerSettings) -> tuple[float, dict[str, torch.Tensor]]:
    """The learner's accumulation (learn/step.py's plan and weights): (loss, {param: grad})."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    options = dataclasses.asdict(settings.loss)
    for part in plan_step(batch, settings).micro_batches:
        step_loss = grpo_packed_loss if isinstance(part.batch, PackedMicroBatch) else grpo_step_loss
        loss, _ = step_loss(model, part.batch, **options)
        (loss * part.weight).backward()
        total += float(loss.detach()) * part.weight
    return total, {name: p.grad.clone() for name, p in model.named_parameters()}


def reference_grads(model, rows, config, turn_advantage):
    model.zero_grad(set_to_none=True)
    loss = reference_loss(model, rows, config, turn_advantage)
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_same(got, want):
    (loss_got, grads_got), (loss_want, grads_want) = got, want
    assert loss_got == pytest.approx(loss_want, rel=1e-5, abs=1e-8)
    for name, g in grads_want.items():
        diff = float((grads_got[name] - g).norm())
        assert diff <= 1e-5 * float(g.norm()) + 1e-10, f"{name}: |Δgrad| {diff:.3g} vs |grad| {float(g.norm()):.3g}"


def trajectory_batch(rows: TrajectoryBatch, turn_advantage: str = "trajectory"):
    turns = torch.tensor([len(t) for t in trajectories_of(rows)])
    return pad_trajectories(join_turns(rows, turns, turn_advantage=turn_advantage))


VARIANTS = {
    "token_mean": {},
    "sequence_mean_kl": {"aggregation": "sequence_mean", "kl_coef": 0.1},
    "gspo": {"ratio_level": "sequence", "aggregation": "sequence_mean", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4},
}


# ====================================================================== one sequence per trajectory
@pytest.mark.parametrize("turn_advantage", ["trajectory", "turn"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_trajectory_trains_as_one_sequence_padded_and_packed_equal_the_hand_reference(variant, turn_advantage):
    model = _model()
    rows = with_sampler_log_probs_near(model, multi_turn_rows(TURNS))
    config = GRPOLossConfig(**VARIANTS[variant])
    want = reference_grads(model, rows, config, turn_advantage)
    assert any(float(g.abs().max()) > 0 for g in want[1].values())  # something to compare
    batch = trajectory_batch(rows, turn_advantage)
    for packing, budget in ((False, 60), (True, 60), (True, 10_000)):  # several micro-batches, and one
        settings = LearnerSettings(packing=packing, micro_batch_tokens=budget, loss=config)
        stepped = copy.deepcopy(model)
        if packing:
            use_packed_attention(stepped)
        assert_same(learner_step(stepped, batch, settings), want)


def test_per_turn_and_per_trajectory_advantages_differ():
    model = _model()
    rows = with_sampler_log_probs_near(model, multi_turn_rows(TURNS))
    turn = reference_loss(model, rows, GRPOLossConfig(), "turn")
    trajectory = reference_loss(model, rows, GRPOLossConfig(), "trajectory")
    assert abs(float((turn - trajectory).detach())) > 1e-3
    batch = trajectory_batch(rows, "turn")
    response = batch["tokens", "prompt"].shape[1]
    # the per-token advantage is each row's on its own turn's sampled tokens
    first = trajectories_of(rows)[0]
    r0 = len(first["response_tokens"].row(0))
    assert torch.all(batch[TOKEN_ADVANTAGE_KEY][0, response: response + r0] == first["advantage"][0])
    p1 = len(first["prompt_tokens"].row(1))
    assert torch.all(batch[TOKEN_ADVANTAGE_KEY][0, response + r0 + p1] == first["advantage"][1])


@pytest.mark.parametrize("packing", [False, True])
def test_environment_tokens_never_carry_loss_or_gradient(packing):
    """Perturbing what the batch holds at the environment's tokens (sampling and reference
    log-probs, per-token advantages) changes neither the loss nor any gradient, bit for bit."""
    model = _model()
    if packing:
        use_packed_attention(model)
    rows = with_sampler_log_probs_near(model, multi_turn_rows(TURNS))
    batch = trajectory_batch(rows, "turn")
    environment = batch["masks", "all_attention_mask"] & ~batch["masks", "all_assistant_mask"]
    environment[:, : batch["tokens", "prompt"].shape[1]] = False  # inside the response only
    assert int(environment.sum()) > 20
    perturbed = batch.clone()
    noise = 5.0 * torch.randn(environment.shape, generator=torch.Generator().manual_seed(3))
    prompt_width = batch["tokens", "prompt"].shape[1]
    for key in (("log_probs", "full"), ("next", "ref_log_probs", "full"), TOKEN_ADVANTAGE_KEY):
        perturbed[key] = torch.where(environment, batch[key] + noise, batch[key])
    for key in (("log_probs", "response"), ("ref_log_probs", "response")):
        full = ("log_probs", "full") if key[0] == "log_probs" else ("next", "ref_log_probs", "full")
        perturbed[key] = perturbed[full][:, prompt_width:]
    settings = LearnerSettings(packing=packing, micro_batch_tokens=60, loss=GRPOLossConfig(kl_coef=0.1))
    loss, grads = learner_step(model, batch, settings)
    loss_perturbed, grads_perturbed = learner_step(model, perturbed, settings)
    assert loss_perturbed == loss
    for name, g in grads.items():
        assert torch.equal(grads_perturbed[name], g), name


def test_single_turn_rows_join_to_the_padded_batch_they_already_are():
    rows = multi_turn_rows([1] * 6)
    padded = pad_batch(rows)
    assert is_single_turn(padded)
    joined = trajectory_batch(rows, "trajectory")
    for key in padded.keys(include_nested=True, leaves_only=True):
        assert torch.equal(joined[key], padded[key]), key
    assert not is_single_turn(pad_batch(multi_turn_rows(TURNS)))


def test_the_write_paths_group_advantage_is_the_trajectorys_on_every_turn():
    """What turn_advantage=trajectory relies on: GroupAdvantage (trajectory_return=sum) writes the
    group-relative return of the whole trajectory on every row of it."""
    from rlhf_pipeline.transforms.group_advantage import GroupAdvantage

    turns = [3, 1, 4, 2, 2, 3]
    rows = multi_turn_rows(turns).without("advantage")
    written = GroupAdvantage(group_size=2).write(rows)
    returns = torch.stack([t["reward"].double().sum() for t in trajectories_of(written)])  # (6,)
    pairs = returns.view(3, 2)
    want = ((pairs - pairs.mean(1, keepdim=True)) / pairs.std(1, keepdim=True).clamp_min(1e-6)).reshape(-1)
    for trajectory, value in zip(trajectories_of(written), want.tolist()):
        assert torch.allclose(trajectory["advantage"].double(), torch.full((len(trajectory),), value, dtype=torch.float64), atol=1e-6)
    batch = trajectory_batch(written, "trajectory")
    torch.testing.assert_close(batch["sequence_advantage"].double(), want, atol=1e-6, rtol=0)
    # per turn (trajectory_return="step": each turn's reward in its group): each row's on its turn's tokens
    per_turn = GroupAdvantage(group_size=2, trajectory_return="step").write(rows)
    batch = trajectory_batch(per_turn, "turn")
    for i, trajectory in enumerate(trajectories_of(per_turn)):
        want = trajectory["advantage"].repeat_interleave(trajectory["response_tokens"].lengths())
        assert torch.equal(batch[TOKEN_ADVANTAGE_KEY][i][batch["masks", "all_assistant_mask"][i]], want)


# ====================================================================== termination reasons
def test_masked_termination_reasons_name_the_trajectories_they_leave_out():
    reasons = [TerminationReason.ENV_DONE, TerminationReason.MAX_TURNS, TerminationReason.TOKEN_BUDGET,
               TerminationReason.ENV_DONE, TerminationReason.GENERATION_LENGTH]
    batch = trajectory_batch(multi_turn_rows(TURNS, reasons=reasons))
    assert masked_by_reason(batch, termination_codes(("max_turns", "GENERATION_LENGTH"))).tolist() == [
        False, True, False, False, True]
    assert not masked_by_reason(batch, termination_codes(())).any()
    with pytest.raises(ValueError, match="unknown termination reason 'max_turn'"):
        termination_codes(["max_turn"])
    with pytest.raises(ValueError, match="mask_termination_reasons"):
        LearnerSettings(mask_termination_reasons=("timeouts",))
    with pytest.raises(ValueError, match="turn_advantage"):
        LearnerSettings(turn_advantage="row")


# ====================================================================== whole trajectories from a store
def _store(path, *appends):
    store = create_store(path, "memmap", schema=StoreSchema(optional=OPTIONAL), segment_rows=16)
    for rows in appends:
        store.append(rows)
    return store


def _assert_whole(store, batch):
    """Every learner row of ``batch`` is a whole stored trajectory: its tokens are
    rebuild_trajectory's over every stored row of that trajectory, and so is its loss mask."""
    everything = store.read(torch.arange(len(store)))
    by_id = {int(t["trajectory_id"][0]): t for t in trajectories_of(everything)}
    tokens, attention = batch["tokens", "full"], batch["masks", "all_attention_mask"]
    for i, trajectory_id in enumerate(batch["trajectory_id"].tolist()):
        rebuilt = rebuild_trajectory(by_id[trajectory_id])
        assert tokens[i][attention[i]].tolist() == rebuilt.token_ids.tolist()
        assert batch["masks", "all_assistant_mask"][i][attention[i]].tolist() == rebuilt.loss_mask.tolist()


def test_exact_sampling_trains_every_trajectory_once_whole(tmp_path):
    appends = [multi_turn_rows(TURNS, seed=s, first_id=10 * s) for s in range(4)]
    store = _store(tmp_path / "buffer", *appends)
    sampler = ExactUseSampler(store, batch_size=8, uses=1)
    collator = PaddedCollator(pad_token_id=0, index_dtype=torch.int32)
    seen, deferred = [], 0
    for draw in range(len(store) // 8):
        sampled = sampler.draw(draw)
        drawn = collator.read(store, sampled.positions)
        sampled, batch = trajectory_draw(store, sampled, drawn, pad_token_id=0, turn_advantage="trajectory")
        deferred += int(sampled.metrics["charts/rows_deferred_to_trajectory_end"])
        if batch is None:
            continue
        assert sampled.positions.numel() == batch.batch_size[0]
        # the narrowed draw names each trajectory's last row
        assert store.read(sampled.positions)["done"].all()
        _assert_whole(store, batch)
        seen += batch["trajectory_id"].tolist()
    assert sorted(seen) == sorted(10 * s + j for s in range(4) for j in range(len(TURNS)))
    assert deferred == len(store) - len(seen)
    store.close()


def test_whole_trajectories_from_a_buffer_of_shards_written_while_it_is_read(tmp_path):
    """Two collectors' shards, appended between draws: positions of the union run shard after
    shard, so a trajectory's turns are still the rows just before its last one."""
    buffer = tmp_path / "buffer"
    writers = [_store(shard_path(buffer, k)) for k in range(2)]
    reader = open_buffer(buffer)
    sampler = ExactUseSampler(reader, batch_size=10, uses=1, timeout_s=5)
    collator = PaddedCollator(pad_token_id=0)
    seen, written = [], []
    for draw in range(8):
        for k, writer in enumerate(writers):
            first = (k << 40) + 10 * draw
            writer.append(multi_turn_rows(TURNS, seed=10 * draw + k, first_id=first))
            written += [first + j for j in range(len(TURNS))]
        sampled = sampler.draw(draw)
        sampled, batch = trajectory_draw(reader, sampled, collator.read(reader, sampled.positions), pad_token_id=0,
                                         turn_advantage="trajectory")
        if batch is not None:
            _assert_whole(reader, batch)
            seen += batch["trajectory_id"].tolist()
    assert len(seen) == len(set(seen)) > 20  # each trajectory at most once, and many of them
    assert set(seen) <= set(written)
    reader.close()
    for writer in writers:
        writer.close()


def test_a_trajectory_whose_last_turn_is_not_written_yet_is_never_in_a_batch(tmp_path):
    rows = multi_turn_rows(TURNS)
    ended = torch.nonzero(rows["trajectory_id"] < 4).squeeze(1)
    last_one = torch.nonzero(rows["trajectory_id"] == 4).squeeze(1)
    store = _store(tmp_path / "buffer", rows.select(ended), rows.select(last_one[:1]))  # turn 0 of 2 written
    collator = PaddedCollator(pad_token_id=0)
    sampler = FreshRowSampler(store, batch_size=len(store), window=len(store), seed=0, max_staleness=None)
    sampled = sampler.draw(0)  # every stored row
    sampled, batch = trajectory_draw(store, sampled, collator.read(store, sampled.positions), pad_token_id=0,
                                     turn_advantage="trajectory")
    assert sorted(batch["trajectory_id"].tolist()) == [0, 1, 2, 3]
    _assert_whole(store, batch)
    store.append(rows.select(last_one[1:]))  # its last turn arrives
    sampled = FreshRowSampler(store, batch_size=len(store), window=len(store), seed=0, max_staleness=None).draw(0)
    sampled, batch = trajectory_draw(store, sampled, collator.read(store, sampled.positions), pad_token_id=0,
                                     turn_advantage="trajectory")
    assert sorted(batch["trajectory_id"].tolist()) == [0, 1, 2, 3, 4]
    _assert_whole(store, batch)
    store.close()


@pytest.mark.parametrize("sharded", [False, True])
def test_a_trajectory_whose_first_turns_were_evicted_is_left_out_and_counted(tmp_path, sharded):
    """Sharded: the evicting store is the second shard, so its first position is not the union's."""
    buffer = tmp_path / "buffer"
    first_shard = _store(shard_path(buffer, 0), multi_turn_rows(TURNS, seed=2, first_id=100)) if sharded else None
    writer = create_store(shard_path(buffer, 1) if sharded else buffer, "memmap",
                          schema=StoreSchema(optional=OPTIONAL), segment_rows=2, capacity_rows=10)
    writer.append(multi_turn_rows(TURNS))
    writer.append(multi_turn_rows(TURNS, seed=1, first_id=10))  # 24 rows: the oldest 14 are evicted
    held = writer.read(torch.arange(len(writer)))
    assert held["trajectory_id"][0] == 10 and held["step"][0] == 2  # trajectory 10's last turn, alone
    store = open_buffer(buffer)
    sampled = FreshRowSampler(store, batch_size=len(store), window=len(store), seed=0, max_staleness=None).draw(0)
    sampled, batch = trajectory_draw(store, sampled, PaddedCollator().read(store, sampled.positions),
                                     pad_token_id=0, turn_advantage="trajectory")
    assert sampled.metrics["charts/trajectories_incomplete"] == 1
    assert sorted(batch["trajectory_id"].tolist()) == [11, 12, 13, 14] + ([100, 101, 102, 103, 104] if sharded else [])
    _assert_whole(store, batch)
    for opened in (store, writer, first_shard):
        if opened is not None:
            opened.close()


def test_reading_a_trajectory_whose_first_turns_were_evicted_since_its_draw_fails_loudly(tmp_path):
    """What a data-parallel rank other than 0 meets when its view of the buffer evicted a
    trajectory's first turns after rank 0 drew its last row: no fragment is trained."""
    store = create_store(tmp_path / "buffer", "memmap", schema=StoreSchema(optional=OPTIONAL), segment_rows=2,
                         capacity_rows=10)
    store.append(multi_turn_rows(TURNS))
    store.append(multi_turn_rows(TURNS, seed=1, first_id=10))
    held = store.read(torch.arange(len(store)))
    assert held["trajectory_id"][0] == 10 and held["step"][0] == 2  # its turns 0 and 1 are gone
    with pytest.raises(RuntimeError, match="evicted"):
        read_trajectories(store, torch.tensor([0]), torch.tensor([2]), pad_token_id=0)
    whole = read_trajectories(store, torch.tensor([5]), held["step"][5:6], pad_token_id=0)  # trajectory 12, 4 turns
    assert whole["trajectory_id"].tolist() == [12]
    _assert_whole(store, whole)
    store.close()


def test_rows_of_a_trajectory_not_stored_together_are_refused(tmp_path):
    rows = multi_turn_rows([2, 2])
    # turn 0 of trajectory 0, then trajectory 1 whole, then trajectory 0's last turn
    store = _store(tmp_path / "buffer", rows.select([0]), rows.select([2, 3]), rows.select([1]))
    positions = torch.tensor([3])
    sampled = FreshRowSampler(store, batch_size=4, window=4, seed=0, max_staleness=None).draw(0)
    sampled = dataclasses.replace(sampled, positions=positions)
    with pytest.raises(ValueError, match="not stored together in step order"):
        trajectory_draw(store, sampled, PaddedCollator().read(store, positions), pad_token_id=0,
                        turn_advantage="trajectory")
    store.close()


# ====================================================================== the learner over a multi-turn buffer
def _multi_turn_run(path, reasons=None) -> RunPaths:
    paths = RunPaths(path / "run")
    store = _store(paths.buffer, *(multi_turn_rows(TURNS, seed=s, first_id=10 * s, reasons=reasons)
                                   for s in range(4)))
    store.close()
    publish_weights(paths.root, _model().state_dict(), 0)
    return paths


def _learn(paths, steps: int, **changes) -> list[dict]:
    settings = LearnerSettings(sampler="exact", batch_size=12, micro_batch_tokens=64, lr=1e-3, max_staleness=None,
                               checkpoint_every=10, log_every=1, **changes)
    run = Learner(settings, paths, make_model=_model, steps=steps, seed=1, show_progress=False)
    run.setup()
    run.train()
    run.cleanup()
    return read_metrics(paths.metrics)


def test_the_learner_trains_multi_turn_buffers_packed_and_padded_alike(tmp_path):
    records = {packing: _learn(_multi_turn_run(tmp_path / str(packing)), 3, packing=packing)
               for packing in (True, False)}
    packed, padded = records[True], records[False]
    assert [r["charts/trajectories"] for r in packed] == [r["charts/trajectories"] for r in padded]
    assert all(r["charts/trajectories"] >= 1 for r in packed)
    # 12 rows drawn per step: those that end a trajectory become its learner row, the others wait for it
    assert [r["charts/trajectories"] + r["charts/rows_deferred_to_trajectory_end"] for r in packed] == [12.0] * 3
    for key in ("losses/loss", "losses/policy_loss", "losses/entropy", "losses/grad_norm"):
        assert [r[key] for r in packed] == pytest.approx([r[key] for r in padded], rel=1e-4, abs=1e-6), key
    packed_weights = load_weights(tmp_path / "True" / "run", 3)[0]
    for name, want in load_weights(tmp_path / "False" / "run", 3)[0].items():
        torch.testing.assert_close(packed_weights[name], want, rtol=1e-4, atol=1e-6)


def test_the_learner_leaves_out_trajectories_that_ended_for_a_masked_reason(tmp_path):
    reasons = [TerminationReason.ENV_DONE, TerminationReason.MAX_TURNS, TerminationReason.ENV_DONE,
               TerminationReason.TOKEN_BUDGET, TerminationReason.ENV_DONE]
    records = _learn(_multi_turn_run(tmp_path, reasons), 4, mask_termination_reasons=("max_turns", "token_budget"))
    masked = sum(r["charts/trajectories_masked"] for r in records)
    trained = sum(r["charts/rows"] for r in records)
    # the exact sampler draws every row once: 20 trajectories, 8 of them ending for a masked reason
    assert masked == 8 and records[-1]["charts/trajectories_masked_total"] == 8
    assert trained == 12
    assert all(r["charts/rows_dropped_stale"] == 0 for r in records)


def test_masking_leaves_out_single_turn_rows_by_their_stored_reason(tmp_path):
    paths = RunPaths(tmp_path / "run")
    reasons = [TerminationReason.GENERATION_LENGTH if i % 3 == 0 else TerminationReason.ENV_DONE for i in range(12)]
    store = _store(paths.buffer, multi_turn_rows([1] * 12, reasons=reasons), multi_turn_rows([1] * 12, seed=1))
    store.close()
    publish_weights(paths.root, _model().state_dict(), 0)
    records = _learn(paths, 2, mask_termination_reasons=("generation_length",))
    assert [r["charts/trajectories_masked"] for r in records] == [4.0, 0.0]
    assert [r["charts/rows"] for r in records] == [8.0, 12.0]
    assert "charts/trajectories" not in records[0]  # single-turn draws take the path they always took


def test_rows_trained_counts_every_turn_of_the_trajectories_trained(tmp_path):
    records = _learn(_multi_turn_run(tmp_path), 4)
    # the exact sampler drew all 48 rows: every turn of every trajectory went into a loss
    assert sum(r["charts/trajectories"] for r in records) == 20
    assert records[-1]["charts/rows_trained"] == 48
    assert records[-1]["charts/rows_generated_per_row_trained"] == 1.0


def test_a_resumed_multi_turn_run_continues_exactly_like_an_uninterrupted_one(tmp_path):
    """Deferring rows to their trajectory's last row keeps no state of its own: the sampler's
    state and the learner's progress are all a resume needs."""
    def learner(paths):
        settings = LearnerSettings(sampler="window", batch_size=12, sample_window=48, micro_batch_tokens=64, lr=1e-3,
                                   max_staleness=None, checkpoint_every=10, log_every=1,
                                   mask_termination_reasons=("max_turns",))
        return Learner(settings, paths, make_model=_model, steps=4, seed=1, show_progress=False)

    reasons = [TerminationReason.ENV_DONE, TerminationReason.MAX_TURNS] + [TerminationReason.ENV_DONE] * 3
    straight, resumed = _multi_turn_run(tmp_path / "a", reasons), _multi_turn_run(tmp_path / "b", reasons)
    run = learner(straight)
    run.setup()
    run.train()
    run.cleanup()
    first = learner(resumed)
    first.setup()
    assert first.train(max_steps=2) is False
    first.cleanup()
    second = learner(resumed)
    second.setup()
    assert second.train() is True
    second.cleanup()
    a, b = read_metrics(straight.metrics), read_metrics(resumed.metrics)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in ("losses/loss", "losses/grad_norm", "charts/trajectories", "charts/rows_trained",
                "charts/trajectories_masked_total"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    wa, wb = (load_weights(p.root, 4)[0] for p in (straight, resumed))
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
