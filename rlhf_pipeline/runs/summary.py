"""What a finished or interrupted run says about itself: its newest checkpoint's step and the
reward it reached. Imports no torch: the launcher prints these after its children are done.
Design: docs/pipelines.md#stopping.
"""

from __future__ import annotations

import signal
import sys

from rlhf_pipeline.files.log_parts import read_log_records
from rlhf_pipeline.files.run_paths import RunPaths


def print_interrupted(paths: RunPaths, signum: int) -> None:
    """What ``run`` (on this machine or on Ray) says when a signal stopped it: how far the learner's
    checkpoints reached, and how to resume."""
    from rlhf_pipeline.learn.checkpoint import run_checkpoints

    reached = run_checkpoints(paths).latest_step()
    saved = f"the learner's newest checkpoint is at step {reached}; " if reached is not None else ""
    print(f"[run] interrupted ({signal.Signals(signum).name}); {saved}run the same command again to "
          f"resume {paths.location}", file=sys.stderr, flush=True)


def reward_first_and_last(records: list[dict]) -> tuple[int, float, float]:
    """The mean training reward of the first and of the last tenth of a run's logged steps (at least
    one step each), and how many steps a tenth is: what the run's last line reports (NaN without any)."""
    rewards = [r["charts/reward_mean"] for r in records if "charts/reward_mean" in r]
    k = max(1, len(rewards) // 10)
    first = sum(rewards[:k]) / k if rewards else float("nan")
    last = sum(rewards[-k:]) / k if rewards else float("nan")
    return k, first, last


def print_summary(paths: RunPaths) -> None:
    records = read_log_records(paths.store, paths.key(paths.metrics))
    if not records:
        return
    k, first, last = reward_first_and_last(records)
    steps = "step" if k == 1 else f"{k} steps"
    print(f"[run] done: {records[-1]['step']} learner steps; mean reward {first:.3f} "
          f"(first {steps}) -> {last:.3f} (last {steps})", file=sys.stderr)
    from rlhf_pipeline.learn.checkpoint import kept_best

    _, best = kept_best(paths)  # read once the evaluator is done
    if best is not None:
        print(f"[run] best checkpoint by {best.metric}: {best.describe()} "
              f"(rlhf-pipeline export-model {paths.location} OUT --best)", file=sys.stderr)
    if paths.url is not None:
        metrics = paths.store.describe(paths.key(paths.metrics))
        print(f"[run] metrics: {metrics} (parts)  tensorboard: {paths.store.describe('tensorboard')} "
              f"(uploaded at the end; cached in {paths.tensorboard})", file=sys.stderr)
        return
    print(f"[run] metrics: {paths.metrics}  tensorboard: {paths.tensorboard}", file=sys.stderr)

