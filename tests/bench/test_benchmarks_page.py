"""``rlhf-pipeline bench NAME ... --page PAGE``, and a script of ``benchmarks/`` run with ``--page PAGE``,
keep what the benchmark printed on the benchmarks page: one block per command line, in the section that
names the benchmark, the page's prose untouched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_pipeline.bench.page import BLOCK_CLOSE, _commit, blocks, run_and_keep
from rlhf_pipeline.cli.main import main

TINY = ["bench", "curation", "--rows", "300", "--completions", "64", "--rounds", "1", "--steps", "2", "--quiet"]
COMMAND = "rlhf-pipeline bench curation --rows 300 --completions 64 --rounds 1 --steps 2 --quiet"

SECTION = """\
## Curation: `rlhf-pipeline bench curation`

What the benchmark measures, in prose a person wrote.

### Latest numbers

A person's reading of the figures.
"""
REST = """\
## The door: `benchmarks/bench_validation.py`

Another benchmark's section, which a curation record must not enter.
"""
PAGE = "# Benchmarks\n\nIntro.\n\n" + SECTION + "\n" + REST


def _page(tmp_path, text=PAGE):
    page = tmp_path / "benchmarks.md"
    page.write_text(text)
    return page


def test_a_record_follows_its_benchmarks_opening_text_and_leaves_the_prose_as_it_was(tmp_path, capsys):
    page = _page(tmp_path)
    assert main([*TINY, "--page", str(page)]) == 0
    printed = capsys.readouterr().out
    text = page.read_text()
    start, end = text.index("<!-- bench-record: "), text.index(BLOCK_CLOSE) + len(BLOCK_CLOSE) + 1
    lead, subsection = SECTION.split("### Latest")
    assert text[:start] == "# Benchmarks\n\nIntro.\n\n" + lead  # the section's opening text, then the block
    assert text[end:] == "\n### Latest" + subsection + "\n" + REST
    body = blocks(text)[COMMAND]  # keyed by the command without --page
    assert f"`{COMMAND} --page docs/benchmarks.md`" in body
    assert "commit " in body and "CPU cores" in body and "torch " in body and "load average " in body
    table_rows = [line for line in printed.splitlines() if line.startswith("|")]
    assert len(table_rows) >= 8 and all(row in body.splitlines() for row in table_rows)
    title = printed.splitlines()[0]  # a line of text before the tables: its own paragraph on the page
    assert f"\n\n{title}\n\n" in body


def test_the_same_command_replaces_its_block_and_another_adds_its_own(tmp_path, capsys):
    page = _page(tmp_path)
    assert main([*TINY, "--page", str(page)]) == 0
    capsys.readouterr()
    assert main([*TINY, f"--pag={page}"]) == 0  # argparse takes the abbreviation for --page
    second = blocks(page.read_text())
    assert list(second) == [COMMAND]  # replaced, not added
    assert second[COMMAND].count("| ours (sum tree) |") == 1
    assert all(line in second[COMMAND] for line in capsys.readouterr().out.splitlines()
               if line.startswith("| ")), "the block holds the second run's figures"
    assert main([*TINY[:-1], "--json", "--quiet", "--page", str(page)]) == 0
    json_command = COMMAND.replace("--quiet", "--json --quiet")
    text = page.read_text()
    assert list(blocks(text)) == [COMMAND, json_command]
    assert text.index(json_command) < text.index("### Latest numbers")
    fenced = blocks(text)[json_command].split("```json\n", 1)[1].split("\n```", 1)[0]
    assert {record["measure"] for record in json.loads(fenced)} == {"prioritized", "filter"}
    capsys.readouterr()


@pytest.mark.parametrize("text, said", [
    (REST, "no heading names `rlhf-pipeline bench curation`"),
    (PAGE.replace("### Latest", "<!-- bench-record: rlhf-pipeline bench curation -->\n### Latest"),
     f"each needs its own '{BLOCK_CLOSE}' line"),
])
def test_a_page_that_cannot_take_the_record_is_refused_and_left_as_it_was(tmp_path, capsys, text, said):
    page = _page(tmp_path, text)
    assert main([*TINY, "--page", str(page)]) == 2
    assert said in capsys.readouterr().err
    assert page.read_text() == text


def test_a_missing_page_is_refused_before_the_benchmark_runs(tmp_path, capsys):
    assert main([*TINY, "--page", str(tmp_path / "nowhere.md")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "nowhere.md: no such file" in err


def test_a_benchmark_that_fails_leaves_the_page_as_it_was(tmp_path, capsys):
    page = _page(tmp_path)

    def fails() -> int:
        print("| half | a table |")
        return 1

    assert run_and_keep(fails, command="rlhf-pipeline bench curation", page=page) == 1
    assert page.read_text() == PAGE
    assert "exited 1" in capsys.readouterr().err


def test_the_recorded_commit_calls_a_checkout_changed_by_its_page_alone_clean(tmp_path):
    """From the second record on, the page differs from the commit: that must not mark every record
    after the first as run on uncommitted code."""
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "docs").mkdir()
    page, code = tmp_path / "docs" / "benchmarks.md", tmp_path / "code.py"
    page.write_text(PAGE)
    code.write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    page.write_text(PAGE + "a record\n")
    assert _commit(page, tmp_path).startswith("commit ") and "uncommitted" not in _commit(page, tmp_path)
    code.write_text("x = 2\n")
    assert _commit(page, tmp_path).endswith(" with uncommitted changes")
    assert _commit(tmp_path.parent / "elsewhere.md", tmp_path).endswith(" with uncommitted changes")


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["benchmarks/bench_validation.py", "--repeat", "1"]


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_a_script_of_benchmarks_keeps_its_output_in_the_section_that_names_it(tmp_path):
    """The scripts that are not ``bench`` commands record the same way: their section is the one whose
    heading names the script; fixed-width columns are kept as printed, in a fence."""
    page = _page(tmp_path)
    ran = _script("--page", str(page))
    assert ran.returncode == 0, ran.stderr[-3000:]
    command = "python " + " ".join(SCRIPT)
    text = page.read_text()
    assert list(blocks(text)) == [command]
    assert text.index("## The door") < text.index(f"<!-- bench-record: {command} -->")
    assert text.startswith(PAGE.rstrip("\n"))  # the prose before it as it was
    body = blocks(text)[command]
    printed = [line for line in ran.stdout.splitlines() if line.strip()]
    assert len(printed) >= 4 and "```text\n" + "\n".join(ran.stdout.strip("\n").splitlines()) + "\n```" in body
    again = _script(f"--page={page}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert list(blocks(page.read_text())) == [command]  # replaced


def test_a_script_whose_section_is_missing_is_refused_before_it_runs(tmp_path):
    page = _page(tmp_path, SECTION)
    ran = _script("--page", str(page))
    assert ran.returncode == 2 and ran.stdout == ""
    assert "no heading names `benchmarks/bench_validation.py`" in ran.stderr
    assert page.read_text() == SECTION
    left_out = _script("--page")  # the page left out: one line, not a traceback
    assert left_out.returncode == 2 and left_out.stderr.strip().splitlines() == [
        "bench_validation.py: argument --page: expected one argument; e.g. --page docs/benchmarks.md"]
