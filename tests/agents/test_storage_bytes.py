"""Episodes in a real memmap store: they read back and rebuild exactly, and a turn costs a constant
number of bytes (storage linear in the trajectory's turns, not quadratic)."""

from __future__ import annotations

import json

import torch
from agent_scripts import ScriptedModel

from rlhf_pipeline.agents.environment import StepResult
from rlhf_pipeline.agents.episode import Episode, EpisodeLimits, episodes_to_batch, rebuild_trajectory
from rlhf_pipeline.agents.tools import ToolBox, parse_hermes
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store

SCRIPT = ['<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>',
          "the result of the tool is 408, let me check it once more"]


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def episode_of(tokenizer, box, turns: int, seed: int) -> Episode:
    model = ScriptedModel(tokenizer, SCRIPT[seed % 2:] + SCRIPT[:seed % 2])
    episode = Episode(tokenizer, [{"role": "user", "content": f"what is 12 times 34? ({seed})"}],
                      tools=box.schemas, parser=parse_hermes, limits=EpisodeLimits(max_turns=turns))
    while not episode.done:
        turn = episode.add_turn(*model.sample(len(episode.turns), episode.max_new_tokens()))
        answer = box.run(turn.tool_calls) if turn.tool_calls else [{"role": "user", "content": "check again"}]
        episode.add_environment(StepResult(answer, reward=float(len(episode.turns))))
    return episode


def store_episodes(path, episodes):
    store = create_store(path, "memmap", schema=StoreSchema(optional=("termination_reason",)))
    batch = episodes_to_batch(episodes, group_ids=[0] * len(episodes), trajectory_ids=list(range(len(episodes))),
                              policy_version=0)
    store.append(batch)
    return store


def test_episodes_read_back_from_a_store_and_rebuild_exactly(tmp_path, bpe_tokenizer):
    box = ToolBox([multiply])
    episodes = [episode_of(bpe_tokenizer, box, turns, seed) for seed, turns in enumerate((1, 3, 6, 4))]
    store = store_episodes(tmp_path / "buffer", episodes)
    rows = store.read(torch.arange(len(store)))
    store.close()
    for trajectory, episode in enumerate(episodes):
        rebuilt = rebuild_trajectory(rows.select(torch.nonzero(rows["trajectory_id"] == trajectory).flatten()))
        assert rebuilt.token_ids.numpy().tobytes() == torch.tensor(episode.token_ids, dtype=torch.int32).numpy().tobytes()
        assert rebuilt.loss_mask.to(torch.uint8).numpy().tobytes() == bytes(episode.loss_mask)
        assert rebuilt.termination_reason is episode.reason
    box.close()


def test_a_turn_costs_constant_bytes(tmp_path, bpe_tokenizer, record_property):
    box = ToolBox([multiply])
    n_episodes, turns = 8, 8
    measured = {}
    for t in (turns, 2 * turns):
        episodes = [episode_of(bpe_tokenizer, box, t, seed) for seed in range(n_episodes)]
        store = store_episodes(tmp_path / f"turns{t}", episodes)
        stats = store.stats()
        store.close()
        # what storing the whole conversation again on every row would have cost, in token ids
        history_tokens = sum(sum(len(s.ids) for s in e.segments[: 2 * (k + 1)]) for e in episodes for k in range(t))
        measured[t] = {"raw_bytes": stats.raw_bytes, "disk_bytes": stats.bytes_on_disk,
                       "tokens": sum(len(e.token_ids) for e in episodes), "history_tokens": history_tokens}
    small, large = measured[turns], measured[2 * turns]
    per_turn = (large["raw_bytes"] - small["raw_bytes"]) / (n_episodes * turns)  # the marginal turn
    report = {"raw_bytes_per_turn": round(per_turn, 1),
              "tokens_per_turn": (large["tokens"] - small["tokens"]) / (n_episodes * turns),
              **{f"{t}_turns": m for t, m in measured.items()}}
    record_property("agents_bytes_per_turn", json.dumps(report))
    print("\nbytes per turn:", json.dumps(report))
    # linear: twice the turns, about twice the bytes (the opening prompt is paid once)
    assert 1.6 < large["raw_bytes"] / small["raw_bytes"] < 2.1
    assert large["disk_bytes"] / small["disk_bytes"] < 2.2
    # the same conversations stored as full histories would grow ~4x
    assert large["history_tokens"] / small["history_tokens"] > 3.0
    box.close()
