"""Checks on a finished agent run's buffer, shared by the tests that generate its turns with vLLM
(an engine the collector owns, a server at a URL)."""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf_pipeline.agents.episode import rebuild_trajectory
from rlhf_pipeline.coordination.weights import load_weights, published_versions
from rlhf_pipeline.generation import SamplingConfig, teacher_forced_log_probs
from rlhf_pipeline.models import char_tool_tokenizer, tiny_causal_lm
from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.storage import open_buffer


def check_every_turn_holds_its_versions_log_probs(run: Path, tolerance: float = 1e-5) -> None:
    """Each trajectory of ``pipelines/tool_use.py``'s run (its model shape with ``num_heads=2``)
    rebuilt from its rows, as the learner does, and scored as one sequence by the version its rows
    name: the stored log-probs of every turn, later turns in the context of the earlier ones. A
    prompt re-tokenized on the way to the engine, a turn sampled on a stale prefix cache or head,
    or a row naming the wrong version fails this."""
    with open_buffer(run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)))
    tokenizer = char_tool_tokenizer()
    model = tiny_causal_lm(len(tokenizer), hidden_size=64, num_layers=2, num_heads=2, max_position_embeddings=384,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    versions = rows["policy_version"]
    checked, later_turns = set(), 0
    for version in published_versions(run):
        picked = torch.nonzero(versions == version).flatten()
        if not len(picked):
            continue
        model.load_state_dict(load_weights(run, version)[0])
        mine = rows.select(picked)
        for trajectory in sorted(set(mine["trajectory_id"].tolist())):
            rebuilt = rebuild_trajectory(mine.select(torch.nonzero(mine["trajectory_id"] == trajectory).flatten()))
            ids = rebuilt.token_ids.tolist()
            with torch.no_grad():
                scored = teacher_forced_log_probs(model, RaggedTensor.from_sequences([ids[:1]], dtype=torch.int64),
                                                  RaggedTensor.from_sequences([ids[1:]], dtype=torch.int64),
                                                  SamplingConfig(temperature=1.0))
            again = torch.cat([torch.zeros(1), scored.row(0).float()])
            difference = (again - rebuilt.log_probs)[rebuilt.loss_mask].abs().max()
            assert float(difference) < tolerance, f"version {version}, trajectory {trajectory}"
            later_turns += int(mine["step"][mine["trajectory_id"] == trajectory].max()) > 0
        checked.add(version)
    assert len(checked) >= 2 and later_turns > 0  # version 0 and a swapped-in one; multi-turn trajectories
