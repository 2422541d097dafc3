"""Retention with ``hold_rewind_points=false`` still holds the rows of ``learner.keep_best``'s best
checkpoint (and of a candidate awaiting its score): ``branch --from-step best`` finds them (a real
shard, real checkpoints, the evaluator's summary lines as it writes them)."""

from __future__ import annotations

import json

from helpers import make_batch

from rlhf_pipeline.coordination.eval_pins import EvalPins
from rlhf_pipeline.coordination.pacing import LearnerIntake, PacingPublisher
from rlhf_pipeline.learn.checkpoint import CheckpointManager, Progress
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.pipeline import RunPaths
from rlhf_pipeline.runs.retention import ShardRetention
from rlhf_pipeline.storage import create_store
from rlhf_pipeline.storage.retention import RetentionSettings

METRIC = "eval/held_out/pass@1"
LEARNER = LearnerSettings(batch_size=16, sample_window=32)  # a sampler reaches 32 rows behind its position


def test_without_held_rewind_points_the_best_and_an_unscored_candidate_still_hold_their_rows(tmp_path):
    paths = RunPaths(tmp_path / "run")
    store = create_store(paths.buffer / "shard-0000", "memmap", segment_rows=16, evict_grace_s=0.0)
    for r in range(40):
        store.append(make_batch(2, 6, seed=r, first_group_id=2 * r, first_trajectory_id=12 * r))
    paths.root.joinpath("settings.json").write_text(json.dumps(
        {"learner": {"keep_best": METRIC, "publish_every": 1}, "eval": {"every_steps": 2}}))
    (paths.root / "eval").mkdir()
    PacingPublisher(paths.pacing).publish(LearnerIntake(consumed={"shard-0000": 240}))
    manager = CheckpointManager(paths.checkpoints, keep_last=10)
    for step, rows in ((2, 120), (4, 160), (5, 240)):  # 2 and 4 published versions the evaluator scores
        manager.save(Progress(seed=0, step=step, policy_version=step), {}, record={"buffer_rows": {"shard-0000": rows}})
    retention = ShardRetention(RetentionSettings(max_rows=48, hold_rewind_points=False), paths, "shard-0000",
                               str(paths.buffer / "shard-0000"), LEARNER)

    report = retention.after_round(store, None)  # neither is scored: both may become the best
    assert store.first_row <= 120 - 32 and "checkpoint of step 2" in report.held_by
    scored(paths, {2: 0.5, 4: 0.25})
    report = retention.after_round(store, None)  # 2 is the best: its rows stay; 4, scored lower, holds none
    assert store.first_row <= 120 - 32 and "checkpoint of step 2" in report.held_by
    manager.save(Progress(seed=0, step=6, policy_version=6), {}, record={"buffer_rows": {"shard-0000": 200}})
    manager.save(Progress(seed=0, step=7, policy_version=7), {}, record={"buffer_rows": {"shard-0000": 240}})
    scored(paths, {6: 0.75})
    report = retention.after_round(store, None)  # 6 is the best now: rows before its window go
    assert 160 - 32 < store.first_row <= 200 - 32 and "checkpoint of step 6" in report.held_by
    store.close()


def scored(paths: RunPaths, scores: dict[int, float]) -> None:
    """What the evaluator does as it finishes versions: a summary line each, then the release."""
    with open(paths.root / "eval" / "metrics.jsonl", "a") as f:
        for version, value in scores.items():
            f.write(json.dumps({"step": version, METRIC: value, "eval/policy_version": float(version)}) + "\n")
    EvalPins(paths.store, every_steps=2, publish_every=1, before_training=True).release_below(max(scores) + 1)
