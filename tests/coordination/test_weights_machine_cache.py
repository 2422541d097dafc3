"""Collectors of one machine share one download per weights version of a run at a URL: separate
reader processes (``weights_reader.py``, a collector's ``WeightsPoller``), grouped into two
"machines" by cache directory, poll a run on moto's S3 server while the learner publishes; the
server counts each reader's GETs of weight objects by the key it signs with."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import torch

from rlhf_pipeline.coordination.weights import publish_weights
from rlhf_pipeline.files.object_run_store import ObjectRunStore

READER = Path(__file__).with_name("weights_reader.py")
MACHINES = {"machine-a": 3, "machine-b": 1}  # collectors per machine
VERSIONS = 3


def policy(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 64), float(version + 1)), "b": torch.arange(64, dtype=torch.float32)}


def test_each_machine_gets_each_version_once_however_many_collectors_it_runs(s3_server, tmp_path):
    url = s3_server.url("run")
    learner = ObjectRunStore(url, storage_options=s3_server.options)
    publish_weights(learner, policy(0), 0)
    readers = {}
    with s3_server.requests.recording(by_key=True) as entries:
        for machine, count in MACHINES.items():
            for index in range(count):
                readers[f"{machine}.{index}"] = subprocess.Popen(
                    [sys.executable, str(READER), url, s3_server.endpoint, f"{machine}.{index}",
                     str(tmp_path / machine / "cache"), str(VERSIONS - 1)],
                    stdout=subprocess.PIPE, text=True)
        loaded = collections.defaultdict(list)
        try:
            for version in range(VERSIONS):
                if version:
                    publish_weights(learner, policy(version), version)
                for name, reader in readers.items():  # every reader has this version before the next one
                    loaded[name].append(reader.stdout.readline().split())
            assert all(reader.wait(timeout=60) == 0 for reader in readers.values())
        finally:
            for reader in readers.values():
                reader.kill()
    expected = [["loaded", str(v), str(float(policy(v)["w"].sum() + policy(v)["b"].sum()))] for v in range(VERSIONS)]
    assert all(lines == expected for lines in loaded.values()), dict(loaded)
    gets = collections.Counter()
    for key, method, path in entries:
        if method == "GET" and "/weights/policy_" in path and key in readers:
            gets[key.split(".")[0], path.rsplit("/", 1)[1]] += 1
    assert gets == {(machine, f"policy_{v:08d}.safetensors"): 1 for machine in MACHINES for v in range(VERSIONS)}


def test_a_poller_with_a_cache_loads_either_format_and_a_set_version(s3_server, tmp_path):
    import io

    from rlhf_pipeline.coordination.weights import WeightsPoller
    from rlhf_pipeline.files.machine_cache import MachineCache

    store = ObjectRunStore(s3_server.url("run"), storage_options=s3_server.options)
    legacy = io.BytesIO()  # a run made before safetensors, resumed at the URL
    torch.save({"version": 0, "state_dict": {"w": torch.zeros(3)}}, legacy)
    store.create("weights/policy_00000000.pt", legacy.getvalue())
    cache = MachineCache(tmp_path / "cache")
    poller = WeightsPoller(store, cache=cache)
    state, version = poller.poll()
    assert version == 0 and torch.equal(state["w"], torch.zeros(3))
    for v in (1, 2):
        publish_weights(store, {"w": torch.full((3,), float(v))}, v)
    state, version = poller.poll_version(1)  # a paced collector's set version, not the newest
    assert version == 1 and torch.equal(state["w"], torch.ones(3))
    assert poller.poll()[1] == 2 and poller.poll() is None
    assert cache.downloads == 3
    assert WeightsPoller(tmp_path / "run-directory", cache=cache).cache is None  # files are read in place
