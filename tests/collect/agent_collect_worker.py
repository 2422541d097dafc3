"""A collector process for the kill -9 test: collects until the store holds ``rounds`` rounds, resuming
from the state its store last published, as ``rlhf-pipeline collect`` does.

    agent_collect_worker.py STORE ROUNDS [HANG_IN_ROUND READY_FILE]

With HANG_IN_ROUND, the environment writes READY_FILE at the second turn of an episode of that
round and then blocks, so the process can be killed mid-episode, mid-round.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from agent_setup import agent_collector, hang_forever, open_or_create, tiny_policy


def main() -> None:
    args = sys.argv[1:]
    collect(Path(args[0]), int(args[1]), int(args[2]) if len(args) > 2 else None,
            Path(args[3]) if len(args) > 3 else None)


def collect(store_path: Path, rounds: int, hang_round: int | None = None, ready: Path | None = None) -> None:
    """Collects into the store at ``store_path`` until it holds ``rounds`` rounds, resuming from the state
    it last published (the test runs it in its own process too, for the runs it does not kill)."""
    torch.set_num_threads(1)
    store = open_or_create(store_path)
    model, tokenizer = tiny_policy()
    collector = None

    def on_step(turn):
        if collector.batches_emitted == hang_round and turn.index == 1:
            ready.write_text("mid-episode")
            hang_forever()

    collector = agent_collector(model, tokenizer, store, on_step=on_step)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import resume

    resume(collector, store)
    while collector.batches_emitted < rounds:
        collector.collect()
    store.close()


if __name__ == "__main__":
    main()
