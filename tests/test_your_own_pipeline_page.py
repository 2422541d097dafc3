"""docs/your-own-pipeline.md builds two pipeline files block by block; the files ship under
``pipelines/examples/``. The page's blocks, in order, must be the file's code (its module docstring
and blank lines aside), so the page cannot show code the shipped file does not run, nor the file
grow code the page does not show. tests/integration/test_example_pipelines.py runs both files."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "your-own-pipeline.md"
EXAMPLES = ["pipelines/examples/reverse_words.py", "pipelines/examples/binary_tool.py"]
PART = re.compile(r"<!-- docs-test: fragment \(part of (pipelines/examples/\w+\.py)[^)]*\) -->\n+```python\n(.*?)^```",
                  re.S | re.M)


def page_parts(text: str) -> dict[str, list[str]]:
    """file -> the page's blocks marked as parts of it, in page order."""
    parts: dict[str, list[str]] = {}
    for match in PART.finditer(text):
        parts.setdefault(match.group(1), []).append(match.group(2))
    return parts


def code_lines(source: str, *, drop_docstring: bool) -> list[str]:
    lines = source.splitlines()
    if drop_docstring:
        first = ast.parse(source).body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            lines = lines[first.end_lineno:]
    return [line.rstrip() for line in lines if line.strip()]


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_page_shows_the_whole_file_in_order(example):
    parts = page_parts(PAGE.read_text(encoding="utf-8"))
    assert example in parts, f"the page has no block marked as a part of {example}"
    shown = code_lines("\n".join(parts[example]), drop_docstring=False)
    shipped = code_lines((ROOT / example).read_text(encoding="utf-8"), drop_docstring=True)
    assert shown == shipped, (f"docs/your-own-pipeline.md and {example} differ: edit both (first difference at code "
                              f"line {next(i for i, (a, b) in enumerate(zip(shown + [''], shipped + [''])) if a != b)})")


def test_the_check_sees_a_difference():
    text = PAGE.read_text(encoding="utf-8")
    example = EXAMPLES[0]
    changed = page_parts(text.replace("return rewards", "return rewards[::-1]", 1))[example]
    shipped = code_lines((ROOT / example).read_text(encoding="utf-8"), drop_docstring=True)
    assert code_lines("\n".join(changed), drop_docstring=False) != shipped


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_page_runs_what_it_builds(example):
    """Its run command names the file, and the file's own docstring names the page."""
    text = PAGE.read_text(encoding="utf-8")
    assert re.search(rf"^rlhf-pipeline run {re.escape(example)}$", text, re.M)
    assert "docs/your-own-pipeline.md" in (ROOT / example).read_text(encoding="utf-8").split('"""')[1]
