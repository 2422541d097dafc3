"""A hackable training reward caught by the held-out evaluation: ``pipelines/default.py`` copied, as a
user starts a pipeline, with its training reward swapped for one that pays for length whatever the
sum, and its held-out set scored by the exact answer only. A real run (processes, stores, the tiny
model, our loop): the training reward rises, the held-out exact answers do not, and the best version
by the evaluation is an early one; ``inspect``, ``show`` and ``export`` read the eval store and show why."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import preloaded

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.evaluation.evaluator import eval_metrics_path, set_store_location
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.learn.checkpoint import run_best, run_checkpoints
from rlhf_pipeline.learn.metrics import read_metrics

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

HACKABLE = '''

def length_reward(prompts, completions, **_):
    """Pays for length, whatever the answer: what a policy learns first is to stop ending its answer."""
    return [min(len(c), 6) / 6 for c in completions]


def exact_answer(prompts, completions, *, answer, **_):
    """The strict verifier: 1 for the exact sum, else 0."""
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
'''


def hackable_pipeline(directory: Path) -> Path:
    """``pipelines/default.py`` with the training reward ``length_reward`` and the held-out set scored by
    ``exact_answer``."""
    source = (REPO / "pipelines" / "default.py").read_text()
    for old, new in (('rewards = {"toy": toy_reward}', 'rewards = {"length": length_reward}'),
                     ("score=toy_reward,", "score=exact_answer,")):
        assert source.count(old) == 1, f"pipelines/default.py no longer has {old!r}: update this test's copy"
        source = source.replace(old, new)
    path = directory / "hackable.py"
    path.write_text(source + HACKABLE)
    return path


def test_a_length_reward_rises_while_held_out_exact_answers_do_not(tmp_path, capsys):
    # measured over seeds 0-2 on one and two threads (identical figures): the training reward went
    # from about 0.32 in the first 10 steps to 0.71-0.98 in the last 10, held-out pass@1 from 0.3-0.7 at
    # step 0 to 0.0 at step 60, the best version by it at step 0 (seed 2: 0.3 at steps 0 and 20)
    pipeline = hackable_pipeline(tmp_path)
    result = preloaded.run(
        [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(pipeline), "--steps", "60",
         "--home", str(tmp_path), "--run-name", "hacked", "--set", "eval.every_steps=20",
         "--set", "learner.keep_best=eval/held_out/pass@1"],
        cwd=REPO, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    run = tmp_path / "hacked"

    rewards = [line["charts/reward_mean"] for line in read_metrics(run / "metrics.jsonl")]
    assert len(rewards) == 60
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.2, (first, last)  # the training reward rises

    evaluated = read_metrics(eval_metrics_path(run))
    assert [line["step"] for line in evaluated] == [0, 20, 40, 60]
    exact = [line["eval/held_out/pass@1"] for line in evaluated]
    assert exact[0] >= 0.2, exact  # the warm start answers some held-out sums exactly
    assert exact[-1] <= exact[0] - 0.2, exact  # and the hacked policy answers fewer, not more
    best = exact.index(max(exact))  # the first of the best
    assert evaluated[best]["step"] <= 20, exact  # an early one
    # the best checkpoint (the starting policy has none): the first best-scored of steps 20, 40, 60, not the last
    kept = run_best(RunPaths(run))
    scores = {line["step"]: line["eval/held_out/pass@1"] for line in evaluated if line["step"] > 0}
    assert kept.step == min(step for step in scores if scores[step] == max(scores.values())) < 60, scores
    assert kept.step in run_checkpoints(RunPaths(run)).steps()

    # the eval store, read like a buffer: every version's 40 held-out sums, and what the hack wrote
    store = set_store_location(run, "held_out")
    assert main(["inspect", str(store)]) == 0
    assert "v0: 40, v20: 40, v40: 40, v60: 40" in capsys.readouterr().out
    assert main(["export", str(store), str(tmp_path / "evaluated.jsonl"), "--quiet"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "evaluated.jsonl").read_text().splitlines()]
    assert len(rows) == 160
    def longest(version: int) -> int:
        return max(len(row["response_text"]) for row in rows if row["policy_version"] == version)

    assert longest(60) > longest(0)  # the hacked answers run on past the sum
    last = next(i for i, row in enumerate(rows) if row["policy_version"] == 60 and row["reward"] == 0.0)
    assert main(["show", str(store), "--row", str(last), "--pipeline", str(pipeline)]) == 0
    shown = capsys.readouterr().out
    assert "policy version 60" in shown and rows[last]["response_text"] in shown
