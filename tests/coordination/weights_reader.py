"""A collector's weights side in a process of its own, for the machine-cache test: polls a run at a
URL as ``collect_main`` does (``WeightsPoller``, with this machine's cache or without one) and prints
``loaded VERSION SUM`` for each version it loads, until it has loaded LAST.

    weights_reader.py URL ENDPOINT ACCESS_KEY CACHE_DIR|- LAST

The access key id is what the test's server counts this reader's requests by (moto takes any).
"""

from __future__ import annotations

import sys
import time

import torch

from rlhf_pipeline.coordination.weights import WeightsPoller
from rlhf_pipeline.files.machine_cache import MachineCache
from rlhf_pipeline.files.object_run_store import ObjectRunStore

GIVE_UP_S = 120.0  # a reader never outlives a test that stopped publishing


def main() -> int:
    torch.set_num_threads(1)
    url, endpoint, key, cache_dir, last = sys.argv[1:]
    store = ObjectRunStore(url, storage_options={"endpoint_url": endpoint, "key": key, "secret": "s"})
    poller = WeightsPoller(store, cache=None if cache_dir == "-" else MachineCache(cache_dir))
    deadline = time.monotonic() + GIVE_UP_S
    while poller.current_version < int(last):
        if time.monotonic() > deadline:
            print(f"gave up at version {poller.current_version}", flush=True)
            return 1
        update = poller.poll()
        if update is None:
            time.sleep(0.02)
            continue
        state, version = update
        print(f"loaded {version} {float(sum(t.sum() for t in state.values()))}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
