"""``rlhf-pipeline show`` on a run: the run's own tokenizer decodes the newest trajectory."""

from __future__ import annotations

import torch

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.storage import open_buffer


def test_a_runs_newest_trajectory_is_decoded_with_the_runs_tokenizer(tiny_run, capsys):
    assert main(["show", str(tiny_run), "--color", "never"]) == 0
    out = capsys.readouterr().out
    with open_buffer(str(tiny_run / "buffer"), mode="r") as store:
        done = store.read(torch.arange(len(store)), fields=("done", "trajectory_id", "prompt_text", "response_text"))
    last = int(torch.nonzero(done["done"]).flatten()[-1])
    assert out.startswith(f"trajectory {int(done['trajectory_id'][last])} ")
    assert f"not trained | {done['prompt_text'][last]}\n" in out
    assert f"trained     | {done['response_text'][last]}" in out  # then the EOS the text leaves out
