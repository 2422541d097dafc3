"""The run directory's copy of its pipeline file: compared at every start, kept with the modules
beside it that it imports, so that export-model, import and show rebuild what the run trains."""

from __future__ import annotations

import shutil
import sys

import pytest
from dataio_setup import DEFAULT_PIPELINE, SMALL

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.dataio.run_pipeline import load_run_pipeline
from rlhf_pipeline.pipeline import PipelineError, RunPaths, load_pipeline_module, make_settings
from rlhf_pipeline.runs.processes import build_pipeline
from rlhf_pipeline.runs.run_directory import prepare_run_directory, publish_initial_policy

DEFAULT = DEFAULT_PIPELINE.read_text()
TOKENIZER_LINE = "    tokenizer = char_tokenizer()\n"
# the first file of the user: its tokenizer has no chat template (a start fails on it)
WITHOUT_TEMPLATE = DEFAULT.replace(TOKENIZER_LINE, TOKENIZER_LINE + "    tokenizer.chat_template = None\n")


def start(pipeline_file, paths, publish=False):
    module = load_pipeline_module(pipeline_file)
    pipeline = build_pipeline(module, make_settings(module, [*SMALL, "warm_start_steps=0"]), paths)
    prepare_run_directory(pipeline, paths)
    if publish:
        publish_initial_policy(pipeline, paths)  # weights version 0: the run has built a policy from the file


def test_a_changed_pipeline_replaces_the_copy_until_the_run_publishes_then_is_refused(tmp_path, capsys):
    assert TOKENIZER_LINE in DEFAULT
    mine = tmp_path / "src" / "mine.py"
    mine.parent.mkdir()
    paths = RunPaths(tmp_path / "run")
    mine.write_text(WITHOUT_TEMPLATE)
    start(mine, paths)  # a first start that failed after the copy was made, before any weights
    mine.write_text(DEFAULT)  # fixed, and started again under the same run name
    start(mine, paths)
    err = capsys.readouterr().err
    assert "the run's copy of its pipeline file is replaced by" in err and "published no policy" in err
    assert (paths.root / "pipeline.py").read_text() == DEFAULT
    assert load_run_pipeline(paths.root).tokenizer.chat_template is not None  # what export-model saves

    start(mine, paths, publish=True)  # the same file again: nothing to say
    assert "replaced" not in capsys.readouterr().err
    mine.write_text(DEFAULT + "\n# changed after the run trained\n")
    with pytest.raises(PipelineError, match=r"differs from the copy run directory .* was started with, in "
                                            r".*pipeline.py, and the run has published policy weights .* remove "
                                            r".*pipeline.py and start again"):
        start(mine, paths)
    assert (paths.root / "pipeline.py").read_text() == DEFAULT
    # the command says it in one line
    assert main(["learn", str(mine), "--home", str(tmp_path), "--run-name", "run", "--steps", "1",
                 *[a for s in SMALL for a in ("--set", s)], "--set", "warm_start_steps=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlhf-pipeline learn: error: pipeline file ") and len(err.strip().splitlines()) == 1
    (paths.root / "pipeline.py").unlink()  # the user's way to go on with the changed file
    start(mine, paths)
    assert (paths.root / "pipeline.py").read_text() == mine.read_text()


def test_the_modules_beside_the_pipeline_file_are_kept_and_compared(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the run's copy puts its modules' directory there
    name = f"copy_helper_{tmp_path.name.replace('-', '_')}"  # a name no other test has imported
    source = tmp_path / "src"
    (source / f"{name}_pkg").mkdir(parents=True)
    (source / f"{name}.py").write_text(f"from {name}_pkg.inner import TEMPLATE_OFF\n")
    (source / f"{name}_pkg" / "__init__.py").write_text("")
    (source / f"{name}_pkg" / "inner.py").write_text("TEMPLATE_OFF = False\n")
    (source / "unused.py").write_text("raise RuntimeError('not imported by the pipeline')\n")
    mine = source / "mine.py"
    mine.write_text(DEFAULT.replace(TOKENIZER_LINE, TOKENIZER_LINE + f"    import {name}\n"
                                    f"    if {name}.TEMPLATE_OFF:\n        tokenizer.chat_template = None\n"))
    monkeypatch.syspath_prepend(str(source))  # how the user's start imported them
    paths = RunPaths(tmp_path / "run")
    start(mine, paths, publish=True)
    kept = sorted(p.relative_to(paths.root).as_posix() for p in (paths.root / "pipeline_modules").rglob("*.py"))
    assert kept == [f"pipeline_modules/{name}.py", f"pipeline_modules/{name}_pkg/__init__.py",
                    f"pipeline_modules/{name}_pkg/inner.py"]  # not unused.py, not rlhf_pipeline

    # the files moved away; a fresh process (none of them imported) rebuilds the run from its copy
    shutil.rmtree(source)
    for module in [m for m in sys.modules if m.startswith(name)]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(source)])
    assert load_run_pipeline(paths.root).tokenizer.chat_template is not None
    assert main(["show", str(paths.root)]) == 2  # the tokenizer loads; the buffer is empty
    assert "holds no rows" in capsys.readouterr().err

    # a changed neighbour is a changed pipeline
    source.mkdir()
    shutil.copytree(paths.root / "pipeline_modules", source, dirs_exist_ok=True)
    mine.write_text((paths.root / "pipeline.py").read_text())
    (source / f"{name}_pkg" / "inner.py").write_text("TEMPLATE_OFF = True\n")
    monkeypatch.syspath_prepend(str(source))
    with pytest.raises(PipelineError, match=rf"in .*pipeline_modules/{name}_pkg/inner.py, and the run has published"):
        start(mine, paths)

    # a run started before runs kept them: one line saying what to pass
    shutil.rmtree(paths.root / "pipeline_modules")
    for module in [m for m in sys.modules if m.startswith(name)]:
        monkeypatch.delitem(sys.modules, module)
    kept_dir = str(paths.root / "pipeline_modules")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in (str(source), kept_dir)])
    assert main(["show", str(paths.root)]) == 2
    err = capsys.readouterr().err
    assert f"imports '{name}', which is neither installed here nor kept by the run" in err
    assert "pass --pipeline PIPELINE.py" in err and len(err.strip().splitlines()) == 1


def test_a_finished_run_given_another_pipeline_file_is_refused_for_it_not_told_there_is_nothing_to_do(tmp_path):
    """At a --steps the run has reached, `run` said "nothing to do" before it compared the file given with
    the run's copy: the answer for the run's own pipeline, not for another file."""
    import subprocess

    import preloaded

    def run(pipeline_file) -> subprocess.CompletedProcess:
        return preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(pipeline_file), "--home",
                              str(tmp_path), "--run-name", "run", "--steps", "2",
                              *[a for s in SMALL for a in ("--set", s)]], capture_output=True, text=True, timeout=300)

    first = run(DEFAULT_PIPELINE)
    assert first.returncode == 0, first.stderr[-3000:]
    mine = tmp_path / "mine.py"
    mine.write_text(DEFAULT + "\n# another file, the same settings\n")
    other = run(mine)
    assert other.returncode == 2 and "nothing to do" not in other.stderr, other.stderr[-3000:]
    assert f"pipeline file {mine} (with the modules beside it that it imports) differs from the copy" in other.stderr
    again = run(DEFAULT_PIPELINE)  # the run's own file: nothing to do, as before
    assert again.returncode == 0 and "has already reached step 2 (--steps 2); nothing to do" in again.stderr
