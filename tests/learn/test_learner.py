"""The learner recipe on a real memmap buffer and a real tiny model (CPU, one thread)."""

from __future__ import annotations

import dataclasses
import re
import threading

import pytest
import torch

from rlhf_pipeline.schema.padding import pad_batch
from rlhf_pipeline.learn.batch import plan_microbatches, split_microbatches
from rlhf_pipeline.learn.learner import Learner, Prefetcher, group_reward_stats, logprob_diff_by_staleness
from rlhf_pipeline.learn.loss import GRPOLossConfig, grpo_step_loss
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.learn.step import lr_lambda
from rlhf_pipeline.learn.samplers import DataTimeoutError
from rlhf_pipeline.learn.samplers.window import FreshRowSampler
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm
from rlhf_pipeline.pipeline import RunPaths
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_store
from rlhf_pipeline.schema.synthetic import synthetic_batch
from rlhf_pipeline.coordination.weights import latest_version, load_weights, publish_weights

TOKENIZER = char_tokenizer()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_model():
    return tiny_causal_lm(len(TOKENIZER), hidden_size=32, num_layers=1, num_heads=2, seed=0)


def rows(n: int, seed: int = 0, version: int = 0):
    batch = synthetic_batch(n, group_size=4, prompt_len=(3, 8), response_len=(1, 6), seed=seed,
                            optional_fields=("advantage",), vocab_size=len(TOKENIZER))
    return batch.with_columns(policy_version=torch.full((n,), version, dtype=torch.int64))


def make_run(tmp_path, n_rows: int = 64) -> RunPaths:
    paths = RunPaths(tmp_path / "run")
    store = create_store(paths.buffer, "memmap", schema=StoreSchema(optional=("advantage",)), segment_rows=32)
    store.append(rows(n_rows))
    store.close()
    publish_weights(paths.root, make_model().state_dict(), 0)
    return paths


SETTINGS = LearnerSettings(batch_size=16, sample_window=64, micro_batch_tokens=64, lr=1e-3, warmup_steps=2,
                           lr_schedule="cosine", max_staleness=None, checkpoint_every=2, log_every=1)


def learner(paths, steps, **changes) -> Learner:
    settings = dataclasses.replace(SETTINGS, **changes)
    return Learner(settings, paths, make_model=make_model, steps=steps, seed=1, show_progress=False)


# ====================================================================== micro-batches
def test_microbatch_plan_covers_every_row_once_within_budget():
    prompt = torch.tensor([3, 8, 5, 2, 7, 1])
    response = torch.tensor([6, 1, 4, 2, 9, 3])
    plans = plan_microbatches(prompt, response, max_tokens=20)
    assert sorted(torch.cat(plans).tolist()) == list(range(6))
    for rows_ in plans:
        width = int(prompt[rows_].max() + response[rows_].max())
        assert len(rows_) == 1 or len(rows_) * width <= 20


def test_gradient_accumulation_over_microbatches_equals_the_whole_batch():
    batch = pad_batch(rows(12, seed=3), pad_token_id=TOKENIZER.pad_token_id)
    grads = []
    for budget in (10_000, 24):
        model = make_model().train()
        micro = split_microbatches(batch, budget)
        assert (len(micro) == 1) == (budget == 10_000)
        total_tokens = int(batch["masks", "response"].sum())
        for mb in micro:
            loss, _ = grpo_step_loss(model, mb)
            (loss * int(mb["masks", "response"].sum()) / total_tokens).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


# ====================================================================== sampling
def test_sampler_skips_stale_rows_and_counts_them(tmp_path):
    store = create_store(tmp_path / "b", "memmap", schema=StoreSchema(optional=("advantage",)))
    store.append(rows(32, version=0))
    store.append(rows(32, seed=1, version=5))
    reader = open_store(tmp_path / "b", mode="r")
    sampler = FreshRowSampler(reader, batch_size=16, window=64, seed=0, max_staleness=1)
    sampler.current_version = 6
    drawn = sampler.draw(0)
    assert reader.read(drawn.positions)["policy_version"].eq(5).all()
    assert drawn.dropped_stale > 0
    sampler.current_version = 7  # now every row is too old: it waits, then says why
    sampler.timeout_s, sampler.poll_s = 0.3, 0.05
    with pytest.raises(DataTimeoutError, match="no more than 1 versions old"):
        sampler.draw(1)
    # the same draw index gives the same rows: nothing to checkpoint but the index
    sampler.current_version = 6
    assert sampler.draw(3).positions.tolist() == sampler.draw(3).positions.tolist()
    reader.close()
    store.close()


def test_sampler_waits_for_new_rows_when_asked(tmp_path):
    store = create_store(tmp_path / "b", "memmap", schema=StoreSchema(optional=("advantage",)))
    store.append(rows(32))
    reader = open_store(tmp_path / "b", mode="r")
    sampler = FreshRowSampler(reader, batch_size=8, window=32, seed=0, max_staleness=None,
                              new_rows_per_draw=16, timeout_s=0.3, poll_s=0.05)
    assert sampler.draw(0).sampler_state == {"min_next_row": 48}
    with pytest.raises(DataTimeoutError, match="waiting for row 48"):
        sampler.draw(1)
    store.append(rows(16, seed=2))
    assert sampler.draw(1).buffer_next_row == 48
    reader.close()
    store.close()


def test_prefetcher_runs_ahead_in_order_and_reraises_errors():
    def produce(i):
        if i == 3:
            raise ValueError("bad row 3")
        return i * 10

    prefetcher = Prefetcher(produce, 1, depth=2)
    assert [prefetcher.next()[:2] for _ in range(2)] == [(1, 10), (2, 20)]
    with pytest.raises(ValueError, match="bad row 3"):
        prefetcher.next()
    prefetcher.close()


# ====================================================================== schedule + stats
def test_lr_schedule_warms_up_then_decays_by_cosine():
    f = lr_lambda(dataclasses.replace(SETTINGS, warmup_steps=2, min_lr_ratio=0.1), total_steps=10)
    assert [round(f(s), 3) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert f(10) == pytest.approx(0.1) and f(6) < f(3)
    constant = lr_lambda(dataclasses.replace(SETTINGS, lr_schedule="constant", warmup_steps=0), 10)
    assert constant(9) == 1.0


def test_group_reward_stats_counts_groups_without_signal():
    stats = group_reward_stats(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5]), torch.tensor([7, 7, 8, 8, 9]))
    assert stats["charts/frac_reward_zero_std"] == 0.5  # group 7 has no spread; 9 has a single row
    assert stats["charts/reward_mean"] == pytest.approx(0.7)


def test_the_log_prob_gap_is_reported_by_staleness_in_eight_series_however_many_versions_sampled():
    """Rows of versions 0..9 trained by version 9: the gap of the rows 0, 1 and 2 versions behind
    each on its own (token-weighted mean, max), those 3 to 9 behind together; a run's series do not
    grow with its versions."""
    staleness = torch.arange(10).repeat_interleave(2).float()  # two rows a version
    tokens = torch.tensor([3.0, 1.0] * 10)
    sums = tokens * (staleness + 1) / 100  # each token of a row K behind is off by (K + 1) / 100
    maxes = (staleness + 1) / 100
    maxes[0] = 0.5  # one token of a row of the learner's own version far off
    charts = logprob_diff_by_staleness(staleness, torch.stack([sums, maxes, tokens], dim=-1))
    names = [f"{kind}/staleness_{k}" for kind in ("mean", "max") for k in ("0", "1", "2", "3plus")]
    assert sorted(charts) == sorted(f"losses/sampler_logprob_diff_{name}" for name in names)
    assert charts["losses/sampler_logprob_diff_mean/staleness_0"] == pytest.approx(0.01)
    assert charts["losses/sampler_logprob_diff_max/staleness_0"] == pytest.approx(0.5)
    assert charts["losses/sampler_logprob_diff_mean/staleness_2"] == pytest.approx(0.03)
    assert charts["losses/sampler_logprob_diff_mean/staleness_3plus"] == pytest.approx((4 + 10) / 2 / 100)
    assert charts["losses/sampler_logprob_diff_max/staleness_3plus"] == pytest.approx(0.10)
    # a bucket without tokens is left out, not written as 0
    no_tokens = torch.stack([sums, maxes, torch.where(staleness == 1, 0.0, tokens)], dim=-1)
    assert "losses/sampler_logprob_diff_mean/staleness_1" not in logprob_diff_by_staleness(staleness, no_tokens)


def test_bad_learner_settings_name_the_field():
    with pytest.raises(ValueError, match="'learner.sample_window' \\(8\\) must be >= batch_size \\(16\\)"):
        dataclasses.replace(SETTINGS, sample_window=8)
    with pytest.raises(ValueError, match="unknown GRPO loss option"):
        GRPOLossConfig.from_options({"clip": 0.2})


# ====================================================================== the recipe
def test_a_resumed_learner_hands_on_its_version_as_published_not_its_live_weights(tmp_path):
    # Ray's learner actor hands collectors Learner.publication() after a step: resumed from a checkpoint
    # taken past its version's step (publish_every=2, checkpoint at step 3), its live weights trained on
    paths = make_run(tmp_path)
    first = learner(paths, steps=4, publish_every=2, checkpoint_every=1)
    first.setup()
    first.train(max_steps=3)
    first.cleanup()
    resumed = learner(paths, steps=4, publish_every=2, checkpoint_every=1)
    resumed.setup()
    try:
        assert resumed.progress.step == 3 and resumed.progress.policy_version == 1
        published = load_weights(paths.root, 1)[0]
        handed = resumed.publication()
        assert set(handed) == set(published) and all(torch.equal(handed[k], published[k]) for k in published)
        live = resumed.model.state_dict()
        assert not all(torch.equal(live[k], published[k]) for k in published)  # step 3's, not version 1's
        resumed.train()
        assert resumed.progress.policy_version == 2  # published at step 4: now the live weights
        handed = resumed.publication()
        assert all(torch.equal(handed[k], v) for k, v in resumed.model.state_dict().items())
    finally:
        resumed.cleanup()


def test_a_cosine_run_resumed_with_more_steps_says_its_learning_rate_moved(tmp_path, capsys):
    """The cosine spans the run's steps: resumed with a larger --steps, the learning rate of the next
    step jumps back up the new curve. That happened without a word; now one line says it. Resumed to
    the same last step, nothing is said."""
    paths = make_run(tmp_path)
    first = learner(paths, steps=4)
    first.setup()
    first.train()
    first.cleanup()
    capsys.readouterr()
    for steps, said in ((4, False), (8, True)):
        resumed = learner(paths, steps=steps)
        resumed.setup()
        resumed.cleanup()
        err = capsys.readouterr().err
        assert ("learner.lr_schedule=cosine decays to the run's last step, now 8" in err) == said, err
    rates = re.search(r"step 5 is (\S+) where the checkpoint's schedule had (\S+)$", err.strip())
    assert rates is not None and float(rates.group(1)) > float(rates.group(2)) == pytest.approx(1e-4), err


def test_learner_steps_publishes_and_writes_metrics(tmp_path):
    paths = make_run(tmp_path)
    run = learner(paths, steps=3, publish_every=1)
    run.setup()
    assert run.train() is True
    run.cleanup()
    assert latest_version(paths.root) == 3
    records = read_metrics(paths.metrics)
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("losses/loss", "losses/kl", "losses/entropy", "losses/clip_frac_low", "losses/clip_frac_high",
                "losses/ess", "losses/grad_norm", "charts/reward_mean", "charts/frac_reward_zero_std",
                "charts/advantage_mean", "charts/response_length_mean", "charts/tokens_per_s",
                "charts/data_wait_s", "charts/staleness_mean", "charts/learning_rate"):
        assert key in records[0], key
    assert records[0]["charts/learning_rate"] < records[1]["charts/learning_rate"]  # warm-up
    assert any(paths.tensorboard.iterdir())
    assert [p.name for p in run.checkpoints.paths()] == ["step_00000002.pt", "step_00000003.pt"]


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    straight = make_run(tmp_path / "a")
    run = learner(straight, steps=6)
    run.setup()
    run.train()
    run.cleanup()

    resumed = make_run(tmp_path / "b")
    first = learner(resumed, steps=6)
    first.setup()
    assert first.train(max_steps=3) is False  # "interrupted" after 3 steps; checkpoint saved
    first.cleanup()
    assert first.checkpoints.latest().name == "step_00000003.pt"
    second = learner(resumed, steps=6)
    second.setup()
    assert second.progress.step == 3
    assert second.train() is True
    second.cleanup()

    a, b = read_metrics(straight.metrics), read_metrics(resumed.metrics)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for key in ("losses/loss", "losses/grad_norm", "charts/learning_rate", "charts/reward_mean"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    wa, wb = (load_weights(p.root, 6)[0] for p in (straight, resumed))
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_the_initial_policy_handed_over_is_trained_as_is_and_a_resume_loads_its_checkpoint(tmp_path):
    # `run` builds the initial policy, publishes it as version 0 and hands it to its learner: no
    # second model built, the same steps as a learner that reads version 0 back
    built = []

    def counting_make_model():
        built.append(1)
        return make_model()

    reloaded = make_run(tmp_path / "a")
    run = learner(reloaded, steps=3, publish_every=1)
    run.setup()
    run.train()
    run.cleanup()

    handed = make_run(tmp_path / "b")
    initial = make_model()  # what make_run published as version 0
    settings = dataclasses.replace(SETTINGS, publish_every=1)
    first = Learner(settings, handed, make_model=counting_make_model, steps=4, seed=1, show_progress=False,
                    initial_policy=initial)
    first.setup()
    assert first.model is initial and built == [] and first.progress.policy_version == 0
    assert first.train(max_steps=3) is False  # stopped after 3 steps, with a checkpoint
    first.cleanup()
    wa, wb = (load_weights(p.root, 3)[0] for p in (reloaded, handed))
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name

    # a resumed learner loads its checkpoint's weights, whatever it is handed
    second = Learner(settings, handed, make_model=counting_make_model, steps=4, seed=1, show_progress=False,
                     initial_policy=make_model())
    second.setup()
    assert built == [1] and second.progress.step == 3
    for name, value in second.model.state_dict().items():
        assert torch.equal(value, wb[name]), name
    second.cleanup()


def test_stop_request_saves_a_checkpoint(tmp_path):
    paths = make_run(tmp_path)
    stop = threading.Event()
    run = Learner(SETTINGS, paths, make_model=make_model, steps=50, seed=1, stop_event=stop, show_progress=False)
    run.setup()
    stop.set()
    assert run.train() is False
    run.cleanup()
    assert run.checkpoints.latest() is not None


def test_a_stop_while_waiting_for_rows_ends_training_with_a_checkpoint(tmp_path):
    """SIGTERM while the buffer has no new rows (its collector died): no hang, a checkpoint."""
    paths = make_run(tmp_path)
    stop = threading.Event()
    # 16 new rows per step that never come: the second draw waits on the buffer
    run = Learner(dataclasses.replace(SETTINGS, new_rows_per_step=16, prefetch_depth=1), paths,
                  make_model=make_model, steps=50, seed=1, stop_event=stop, show_progress=False)
    run.setup()
    timer = threading.Timer(1.0, stop.set)
    timer.start()
    finished = []
    trainer = threading.Thread(target=lambda: finished.append(run.train()))
    trainer.start()
    trainer.join(timeout=60)
    timer.cancel()
    assert not trainer.is_alive(), "train() kept waiting after the stop request"
    assert finished == [False] and run.progress.step == 1
    run.cleanup()
    assert run.checkpoints.latest() is not None


def test_prefetcher_next_gives_up_when_stopped_with_nothing_queued():
    stop = threading.Event()
    release = threading.Event()

    def produce(i):
        release.wait()  # a draw that ends only once stopped, and then is dropped
        raise InterruptedError("sampling stopped")

    prefetcher = Prefetcher(produce, 0, depth=1, stop=stop)
    threading.Timer(0.3, lambda: (stop.set(), release.set())).start()
    with pytest.raises(InterruptedError):
        prefetcher.next()
    prefetcher.close()


def test_packed_and_padded_learners_train_alike(tmp_path):
    """learner.packing (the default) and packing=false: the same draws, losses and weights."""
    runs = {}
    for packing in (True, False):
        paths = make_run(tmp_path / str(packing))
        run = learner(paths, steps=3, packing=packing, micro_batch_tokens=40)
        run.setup()
        run.train()
        run.cleanup()
        runs[packing] = paths
    packed, padded = (read_metrics(runs[p].metrics) for p in (True, False))
    assert [r["charts/rows"] for r in packed] == [r["charts/rows"] for r in padded] == [16.0] * 3
    for key in ("losses/loss", "losses/policy_loss", "losses/entropy", "losses/grad_norm"):
        assert [r[key] for r in packed] == pytest.approx([r[key] for r in padded], rel=1e-4, abs=1e-6), key
    weights_packed, weights_padded = (load_weights(runs[p].root, 3)[0] for p in (True, False))
    for name, want in weights_padded.items():
        torch.testing.assert_close(weights_packed[name], want, rtol=1e-4, atol=1e-6)
