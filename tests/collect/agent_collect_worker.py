"""A collector process for the kill -9 test: collects until the store holds ``rounds`` rounds, saving
its position as ``rlhf-pipeline collect`` does (collect/position.py).

    agent_collect_worker.py STORE STATE_FILE ROUNDS [HANG_IN_ROUND READY_FILE]

With HANG_IN_ROUND, the environment writes READY_FILE at the second turn of an episode of that
round and then blocks, so the process can be killed mid-episode, mid-round.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from agent_setup import agent_collector, hang_forever, open_or_create, tiny_policy

from rlhf_pipeline.collect.position import CollectorPosition


def main() -> None:
    torch.set_num_threads(1)
    store_path, state_file, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    hang_round = int(sys.argv[4]) if len(sys.argv) > 4 else None
    ready = Path(sys.argv[5]) if len(sys.argv) > 5 else None
    store = open_or_create(store_path)
    model, tokenizer = tiny_policy()
    collector = None

    def on_step(turn):
        if collector.batches_emitted == hang_round and turn.index == 1:
            ready.write_text("mid-episode")
            hang_forever()

    collector = agent_collector(model, tokenizer, store, on_step=on_step)
    position = CollectorPosition(state_file, store)
    saved = position.load()
    if saved is not None:
        collector.load_state_dict(saved)
    while collector.batches_emitted < rounds:
        collector.collect(before_write=position.before_write)
        position.after_write(collector.state_dict())
    store.close()


if __name__ == "__main__":
    main()
