"""A collector process for the kill -9 test: collects until the store holds ``rounds`` rounds, saving
its position as ``rlhf-pipeline collect`` does (collect/position.py).

    agent_collect_worker.py [--per-episode] STORE STATE_FILE ROUNDS [HANG_IN_ROUND READY_FILE]

``--per-episode``: the collector's turns are per episode (``AgentCollectorConfig.turns``). With HANG_IN_ROUND, the environment writes READY_FILE at the second turn of an episode of that
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
    args = [a for a in sys.argv[1:] if a != "--per-episode"]
    turns = "per_episode" if "--per-episode" in sys.argv else "lockstep"
    store_path, state_file, rounds = Path(args[0]), Path(args[1]), int(args[2])
    hang_round = int(args[3]) if len(args) > 3 else None
    ready = Path(args[4]) if len(args) > 4 else None
    store = open_or_create(store_path)
    model, tokenizer = tiny_policy()
    collector = None

    def on_step(turn):
        if collector.batches_emitted == hang_round and turn.index == 1:
            ready.write_text("mid-episode")
            hang_forever()

    collector = agent_collector(model, tokenizer, store, on_step=on_step, turns=turns)
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
