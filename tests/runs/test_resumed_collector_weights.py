"""Which weights a restarted collector starts with, against a real run directory: the version its
last round used, never a newer one a stopped learner published past the checkpoint the restarted
learner resumes from (those are taken back and published again under the same numbers)."""

from __future__ import annotations

import torch

from rlhf_pipeline.coordination.weights import WeightsPoller, publish_weights, retract_versions_after
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.learn.checkpoint import Progress, run_checkpoints
from rlhf_pipeline.runs.processes import _resumed_learner_version, _wait_for_weights


class _NoWait:
    def sleep(self) -> None:
        pass


def _weights(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2,), float(version))}


def _run_killed_after_checkpoint(tmp_path) -> RunPaths:
    """Versions 0-11 published (keep_last=3 leaves 9-11), the newest checkpoint of step 6 / version 6."""
    paths = RunPaths(tmp_path / "run")
    for version in range(12):
        publish_weights(paths.store, _weights(version), version, keep_last=3)
    run_checkpoints(paths).save(Progress(seed=0, step=6, policy_version=6), {"model": {}})
    return paths


def test_the_version_of_the_checkpoint_a_learner_resumes_from(tmp_path) -> None:
    paths = _run_killed_after_checkpoint(tmp_path)
    assert _resumed_learner_version(paths) == 6
    fresh = RunPaths(tmp_path / "fresh")
    publish_weights(fresh.store, _weights(0), 0)
    assert _resumed_learner_version(fresh) == 0  # before the first checkpoint: the initial policy


def test_a_collector_that_held_a_pruned_version_waits_for_it_to_be_published_again(tmp_path) -> None:
    paths = _run_killed_after_checkpoint(tmp_path)
    calls = []

    def learner_resumes() -> bool:  # the restarted learner, between two of the collector's listings
        calls.append(1)
        if len(calls) == 2:
            retract_versions_after(paths.store, 6)
            publish_weights(paths.store, _weights(7), 7, keep_last=3)
            publish_weights(paths.store, _weights(8), 8, keep_last=3)
        return len(calls) > 10

    update = _wait_for_weights(WeightsPoller(paths.store), learner_resumes, _NoWait(), held=8,
                               republished_after=_resumed_learner_version(paths))
    assert update is not None
    state, version = update
    assert version == 8 and torch.equal(state["w"], _weights(8)["w"])  # not the stopped learner's 11
    assert len(calls) == 2


def test_a_held_version_at_or_before_the_checkpoint_falls_back_to_the_newest_when_pruned(tmp_path) -> None:
    paths = _run_killed_after_checkpoint(tmp_path)
    run_checkpoints(paths).save(Progress(seed=0, step=10, policy_version=10), {"model": {}})
    update = _wait_for_weights(WeightsPoller(paths.store), lambda: True, _NoWait(), held=8,
                               republished_after=_resumed_learner_version(paths))
    assert update is not None and update[1] == 11  # 8 stays pruned: nothing publishes it again
