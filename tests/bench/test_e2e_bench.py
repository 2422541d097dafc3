"""``bench e2e`` at a tiny size: both modes train to the same steps from the same parts; clean --json."""

from __future__ import annotations

import json

from rlhf_pipeline.bench.e2e_bench import FIGURES, format_table
from rlhf_pipeline.cli.main import main

TINY = ["warm_start_steps=5", "prompts_per_round=4", "group_size=4", "learner.batch_size=16",
        "learner.checkpoint_every=100"]


def test_both_modes_train_the_same_steps_and_report_every_figure(capfd):
    # the command runs in this process (each mode's run has processes of its own); capfd: the runs' output
    # goes to this process's stderr descriptor
    command = ["bench", "e2e", "--steps", "3", "--json"]
    for item in TINY:
        command += ["--set", item]
    assert main(command) == 0
    stdout, stderr = capfd.readouterr()
    records = json.loads(stdout)  # stdout is the JSON document alone; progress went to stderr
    assert [r["mode"] for r in records] == ["pipeline", "synchronous"]
    assert "[bench e2e] pipeline, run 1/1" in stderr
    for record in records:
        assert all(figure in record for figure in FIGURES), record
        assert record["steps"] == 3 and record["rows_trained"] == 3 * 16  # every step one batch of fresh rows
        assert 0 < record["time_to_first_step_s"] < record["wall_s"]
        assert record["learner_step_s"] > 0 and record["generation_s"] > 0
        assert 0 <= record["reward_first"] <= 1 and 0 <= record["reward_last"] <= 1
    pipeline, synchronous = records
    # the synchronous loop generates exactly what it trains on; the paced collector at most the
    # next batch more (plus a round if the learner waited for it long after it was written)
    assert synchronous["rows_generated"] == 3 * 16 and synchronous["rows_generated_per_row_trained"] == 1.0
    assert 3 * 16 <= pipeline["rows_generated"] <= 5 * 16
    table = format_table(records)
    assert "| wall_s |" in table and "rows generated per row trained at most 1.1" in table
