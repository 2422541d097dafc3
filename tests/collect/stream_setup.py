"""Shared by the streamed-round tests and their kill -9 worker: a tiny real policy whose completions
end at different steps (its EOS logit raised by a constant, so groups end apart and a round goes to
the store in several appends), and a collector writing to a memmap store."""

from __future__ import annotations

import torch

from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig, SingleTurn
from rlhf_pipeline.collect.toy_task import toy_prompts, toy_reward
from rlhf_pipeline.models import tiny_model_and_tokenizer

EOS_BIAS = 3.5
ROUND_ROWS = 12  # 4 prompts x 3 completions
GROUP_ROWS = 3  # completions a prompt


def policy():
    """(model, tokenizer): the tiny Qwen2 with ``EOS_BIAS`` added to its EOS logit."""
    model, tok = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, num_heads=4)
    bias = torch.zeros(model.config.vocab_size)
    bias[tok.eos_token_id] = EOS_BIAS
    model.lm_head.register_forward_hook(lambda module, inputs, logits: logits + bias)
    return model, tok


def collector(model, tok, sink) -> Collector:
    config = CollectorConfig(tasks_per_round=4, group_size=3,
                             sampling=SamplingConfig(max_new_tokens=16, temperature=1.0))
    source = PromptSource(toy_prompts(20, seed=1), seed=0, required_fields=("answer",))
    return Collector(model, tok, source, SingleTurn({"toy": toy_reward}), sink, config)


def collect_into(where, rows: int, on_append=lambda next_row: None) -> int:
    """A collector writing to ``where/buffer`` (made, or resumed from the state it last published) until
    it holds ``rows`` rows; ``on_append(next_row)`` after each append. The rows of the round in part it
    resumed with (0 for a round boundary)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import resume

    from rlhf_pipeline.collect.commit import stored_in_round
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store, make_replay_buffer, open_store

    buffer_path = Path(where) / "buffer"
    store = (open_store(buffer_path, mode="a") if buffer_path.exists()
             else create_store(buffer_path, "memmap", schema=StoreSchema()))
    buffer = make_replay_buffer(store)

    def sink(batch, writer_state):
        buffer.extend(batch, writer_state=writer_state)
        on_append(store.next_row)

    streamer = collector(*policy(), sink)
    try:
        resumed = stored_in_round(resume(streamer, store) or {}) * GROUP_ROWS
        while store.next_row < rows:
            streamer.collect()
    finally:
        store.close()
    return resumed
