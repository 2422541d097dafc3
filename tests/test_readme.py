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
