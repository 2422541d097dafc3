"""learner.keep_best in the checkpoint manager: the best checkpoint by the evaluator's scores, kept beside
the rolling ones, and the candidates still awaiting their score (real files; the evaluator's side is its
two files, ``eval/metrics.jsonl`` and ``eval/pinned_from.json``, written as it writes them)."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_pipeline.coordination.eval_pins import EvalPins
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.learn.checkpoint import Progress, run_best, run_checkpoints
from rlhf_pipeline.learn.keep_best import KeepBest, NoBestCheckpoint
from rlhf_pipeline.learn.settings import LearnerSettings

METRIC = "eval/held_out/pass@1"


def keep_best(paths: RunPaths, every_steps: int = 2, publish_every: int = 1) -> KeepBest:
    pins = EvalPins(paths.store, every_steps=every_steps, publish_every=publish_every, before_training=True)
    return KeepBest(METRIC, paths.store, pins)


def scored(paths: RunPaths, version: int, value: float, *, release: bool = True) -> None:
    """What the evaluator does when it finishes a version: its summary line, then the release."""
    line = {"step": version, METRIC: value, "eval/held_out/prompts": 40.0, "eval/policy_version": float(version)}
    with open(paths.root / "eval" / "metrics.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    if release:
        EvalPins(paths.store, every_steps=2, publish_every=1, before_training=True).release_below(version + 1)


@pytest.fixture()
def paths(tmp_path):
    (tmp_path / "eval").mkdir()
    return RunPaths(tmp_path)


def saved(manager, *steps: int) -> None:
    for step in steps:
        manager.save(Progress(seed=0, step=step, policy_version=step), {"w": torch.full((1,), float(step))})


def test_candidates_wait_for_their_score_and_only_the_best_stays_beside_the_newest(paths):
    manager = run_checkpoints(paths, keep_last=1, keep_best=keep_best(paths))
    assert [manager.best_candidate(s) for s in range(1, 7)] == [False, True, False, True, False, True]
    saved(manager, 1, 2, 3, 4)
    assert manager.steps() == [2, 4] and manager.best() is None  # 2 awaits its score; 4 is the newest
    scored(paths, 0, 0.9)  # the starting policy has no checkpoint: never the best
    scored(paths, 2, 0.5)
    saved(manager, 5)
    assert manager.steps() == [2, 4, 5]
    best = manager.best()
    assert (best.step, best.policy_version, best.metric, best.value) == (2, 2, METRIC, 0.5)
    assert torch.equal(manager.load(best.location)[1]["w"], torch.full((1,), 2.0))
    scored(paths, 4, 0.25)  # lower: 4 goes by the schedule alone
    saved(manager, 6)
    assert manager.steps() == [2, 6] and manager.best().step == 2
    scored(paths, 6, 0.75)  # better: the old best goes at the next prune
    saved(manager, 7)
    assert manager.steps() == [6, 7] and manager.best().describe() == f"step 6 (policy version 6): {METRIC} 0.75"


def test_of_equal_scores_the_earliest_is_the_best_and_a_given_up_version_is_pruned(paths):
    manager = run_checkpoints(paths, keep_last=1, keep_best=keep_best(paths))
    saved(manager, 2, 4, 6)
    scored(paths, 2, 0.5)
    scored(paths, 4, 0.5)
    EvalPins(paths.store, every_steps=2, publish_every=1, before_training=True).release_below(7)  # 6: given up
    saved(manager, 8)
    assert manager.steps() == [2, 8] and manager.best().step == 2


def test_a_score_logged_but_not_released_yet_counts_and_a_torn_or_repeated_line_changes_nothing(paths):
    manager = run_checkpoints(paths, keep_last=1, keep_best=keep_best(paths))
    saved(manager, 2, 4)
    scored(paths, 2, 0.5, release=False)
    scored(paths, 2, 0.5, release=False)  # a kill between the line and the evaluator's publish logs it twice
    with open(paths.root / "eval" / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "eval/held_out/pass@1": 1.0, "eval/pol')  # cut short by a kill
    saved(manager, 5)
    assert manager.steps() == [2, 4, 5] and manager.best().step == 2  # 4 still awaits its score


def test_without_keep_best_the_schedule_alone_prunes(paths):
    manager = run_checkpoints(paths, keep_last=1)
    saved(manager, 2, 4)
    scored(paths, 2, 1.0)
    saved(manager, 5)
    assert manager.steps() == [5] and manager.best() is None and not manager.best_candidate(2)


def test_the_best_of_a_run_is_read_from_its_settings_or_refused_saying_why(paths):
    with pytest.raises(NoBestCheckpoint, match="was not run with learner.keep_best"):
        run_best(paths)
    (paths.root / "settings.json").write_text(json.dumps(
        {"learner": {"keep_best": METRIC, "publish_every": 1}, "eval": {"every_steps": 2}}))
    manager = run_checkpoints(paths, keep_last=1, keep_best=keep_best(paths))
    saved(manager, 2)
    with pytest.raises(NoBestCheckpoint, match=f"no kept checkpoint's policy version has a score of {METRIC}"):
        run_best(paths)
    scored(paths, 2, 0.5)
    assert run_best(paths).step == 2


@pytest.mark.parametrize("value", ["held_out/pass@1", "eval/held_out", "eval//pass@1"])
def test_keep_best_must_name_an_evaluation_summary(value):
    with pytest.raises(ValueError, match="setting 'learner.keep_best' must name an evaluation summary"):
        LearnerSettings(keep_best=value)


def test_a_later_evaluation_of_any_kept_checkpoint_counts_and_the_old_best_goes_at_the_next_prune(paths):
    # what `rlhf-pipeline eval RUN --step 3` adds: a score for a checkpoint kept by keep_every, no candidate
    manager = run_checkpoints(paths, keep_last=1, keep_every=3, keep_best=keep_best(paths))
    saved(manager, 2, 3, 4)
    scored(paths, 2, 0.5)
    scored(paths, 4, 0.25)
    assert manager.best().step == 2 and not manager.best_candidate(3)
    scored(paths, 3, 0.75, release=False)
    assert manager.best().step == 3
    assert manager.prune() == [2] and manager.steps() == [3, 4]


def test_scores_logged_as_a_run_at_a_url_logs_them_numbered_parts_count_too(tmp_path):
    from rlhf_pipeline.coordination.eval_pins import EVAL_METRICS, eval_scores
    from rlhf_pipeline.files.run_store import LocalRunStore
    from rlhf_pipeline.learn.metrics import MetricsWriter

    store = LocalRunStore(tmp_path)
    writer = MetricsWriter(EVAL_METRICS, store=store)  # how a writer at a URL logs: part objects
    writer.log(2, {METRIC: 0.5, "eval/policy_version": 2.0})
    writer.close()
    assert not (tmp_path / EVAL_METRICS).exists() and eval_scores(store, METRIC) == {2: 0.5}
