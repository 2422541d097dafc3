"""The README's promises that code can check: CI runs its test command, its schema table is true."""

from __future__ import annotations

import re
from pathlib import Path

from rlhf_pipeline.schema import FIELDS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert block, "README must open with a bash block holding the two commands"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_exactly_two_commands():
    commands = _readme_commands()
    assert len(commands) == 2
    assert "rlhf-pipeline run pipelines/default.py" in commands[0]
    assert "pytest" in commands[1]
    for command in commands:
        # CPU build of torch first, so no later install resolves a CUDA build
        assert "pip install -q torch==2.13.0" in command


def test_ci_runs_the_readme_test_command():
    ci_script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert _readme_commands()[1] in ci_script


def test_schema_table_matches_fields():
    rows = {}
    for line in README.splitlines():
        match = re.match(r"\| `(\w+)` \| (token|row|text) \| (\w+(?:-\w+)?) \|", line)
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3))
    assert set(rows) == {f.name for f in FIELDS}
    for spec in FIELDS:
        kind, dtype = rows[spec.name]
        assert kind == spec.kind, spec.name
        expected = "utf-8" if spec.kind == "text" else str(spec.dtype).removeprefix("torch.")
        assert dtype == expected, spec.name


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_python_examples_run(tmp_path, monkeypatch):
    """Every Python example in the README runs as written, against a real store."""
    import torch

    from rlhf_pipeline.models import tiny_causal_lm
    from helpers import make_batch

    torch.set_num_threads(1)
    blocks = _python_blocks()
    assert len(blocks) >= 2
    for number, block in enumerate(blocks):
        workdir = tmp_path / f"example{number}"
        workdir.mkdir()
        monkeypatch.chdir(workdir)
        # the names the examples take as given: a batch of whole groups of 8 (with advantages
        # unless the example computes them on the write path) and a reference model
        computes_advantage = "GroupAdvantage(" in block
        namespace = {
            "batch": make_batch(2, 8, vocab_size=64, optional=() if computes_advantage else ("advantage",)),
            "ref_model": tiny_causal_lm(64, hidden_size=16, num_layers=1, num_heads=2),
        }
        exec(compile(block, f"README.md python block {number}", "exec"), namespace)
        stores = [v for v in namespace.values() if type(v).__name__.endswith("TrajectoryStore")]
        assert stores, "each example should build a store"
        assert any(len(s) > 0 for s in stores), "each example should write rows"
