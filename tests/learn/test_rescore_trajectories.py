"""Replay's re-scoring of multi-turn trajectories (learn/rescore.py on learn/trajectories.py's batches).

A trajectory is re-scored as it trains: one sequence, named by its last row. Its reference
log-probs come from one teacher-forced pass over its whole token list (each turn scored in the
conversation it was sampled in), only on sampled tokens; the environment's tokens get none and
no KL; its re-scored advantage is the buffer's at its last row."""

from __future__ import annotations

import pytest
import torch
from test_trajectories import (
    TURNS,
    _model,
    _multi_turn_run,
    _token_log_probs,
    multi_turn_rows,
    trajectories_of,
    trajectory_batch,
)

from rlhf_pipeline.agents.episode import rebuild_trajectory
from rlhf_pipeline.learn.learner import Learner
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.learn.rescore import BatchRescorer, ReferenceRescorer
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.schema.ragged import RaggedTensor


def _response_values(batch, key: str) -> torch.Tensor:
    response_mask = batch["masks", "response"]
    return RaggedTensor.from_padded(batch[key, "response"], response_mask).values


def test_reference_log_probs_of_a_trajectory_are_scored_in_its_whole_conversation():
    rows = multi_turn_rows(TURNS, seed=3)
    reference = _model(seed=5).eval()
    batch = ReferenceRescorer(_model(seed=5), kl_coef=0.1)(trajectory_batch(rows))
    ref = _response_values(batch, "ref_log_probs")
    kl = _response_values(batch, "kl")
    trained = batch["masks", "all_assistant_mask"][:, batch["masks", "prompt"].shape[1]:][batch["masks", "response"]]
    expected, at = [], 0
    with torch.no_grad():
        for trajectory in trajectories_of(rows):
            rebuilt = rebuild_trajectory(trajectory)
            prompt_length = len(trajectory["prompt_tokens"].row(int(torch.argmin(trajectory["step"]))))
            own = _token_log_probs(reference, rebuilt.token_ids)[prompt_length - 1:]  # the response's tokens
            mask = rebuilt.loss_mask[prompt_length:]
            expected.append(torch.where(mask, own, torch.zeros_like(own)))
            at += len(own)
    expected = torch.cat(expected)
    assert at == ref.numel() and bool((~trained).any())  # the premise: environment tokens in the responses
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)
    assert bool((ref[~trained] == 0).all()) and bool((kl[~trained] == 0).all())
    assert bool((kl[trained] != 0).any())


def test_re_scored_advantages_are_the_buffers_at_each_trajectorys_last_row():
    rows = multi_turn_rows(TURNS, seed=4)
    ends = torch.nonzero(rows["done"]).flatten()
    advantages = torch.linspace(-1.0, 1.0, len(rows))  # by position: what buffer_advantages gives
    batch = BatchRescorer(advantages)(ends, trajectory_batch(rows))
    torch.testing.assert_close(batch["sequence_advantage"], advantages[ends])
    assistant = batch["masks", "all_assistant_mask"]
    token = batch["advantage"].squeeze(-1)
    assert bool((token[~assistant] == 0).all())
    torch.testing.assert_close(token[assistant], advantages[ends].repeat_interleave(assistant.sum(1)))
    with pytest.raises(ValueError, match="turn_advantage=trajectory"):
        BatchRescorer(advantages)(ends, trajectory_batch(rows, turn_advantage="turn"))


def test_a_multi_turn_buffer_trains_with_a_re_scoring_transform(tmp_path):
    """The learner re-scores whole trajectories (not their rows) and trains on them."""
    paths = _multi_turn_run(tmp_path)
    seen = []

    class Recording(ReferenceRescorer):
        def __call__(self, batch):
            seen.append((int(batch["step"].min()), int(batch["masks", "all_assistant_mask"].sum()),
                         int(batch["masks", "response"].sum())))
            return super().__call__(batch)

    settings = LearnerSettings(sampler="exact", batch_size=12, micro_batch_tokens=64, lr=1e-3, max_staleness=None,
                               checkpoint_every=10, log_every=1)
    run = Learner(settings, paths, make_model=_model, steps=2, seed=1, show_progress=False,
                  batch_transform=BatchRescorer(None, Recording(_model(seed=9))))
    run.setup()
    run.train()
    run.cleanup()
    records = read_metrics(paths.metrics)
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r["losses/loss"])) for r in records)
    # every transformed batch was a batch of joined trajectories: responses holding environment tokens
    assert seen and all(assistant < response for _, assistant, response in seen)
    assert read_metrics(paths.metrics)[-1]["charts/trajectories"] > 0
