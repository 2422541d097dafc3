"""Loading pipeline files by path and --set overrides: clear errors before any work."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import preloaded

from rlhf_pipeline.pipeline import (
    PipelineError,
    apply_overrides,
    describe_settings,
    load_pipeline_module,
    make_settings,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT = REPO / "pipelines" / "default.py"


def _write(tmp_path, body: str) -> Path:
    path = tmp_path / "p.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_default_pipeline_loads_and_documents_its_settings():
    module = load_pipeline_module(DEFAULT)
    settings = make_settings(module, ["steps=7", "learner.lr=0.001", "arch=llama", "max_lag=none"])
    assert settings.steps == 7 and settings.learner.lr == 0.001 and settings.arch == "llama"
    assert settings.max_lag is None and settings.learner_settings().max_staleness is None
    text = describe_settings(settings)
    assert "learner.lr (float, > 0) = 0.001" in text
    assert "Completions per prompt" in text  # the docstring under group_size


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("group_sise=4", "unknown setting 'group_sise'. Did you mean 'group_size'?"),
        ("learner.lrr=1", "unknown setting 'learner.lrr'"),
        ("steps=ten", "setting 'steps' expects int, got 'ten'"),
        ("arch=gpt2", "setting 'arch' must be one of ['qwen2', 'llama'], got 'gpt2'"),
        ("steps", "--set expects key=value"),
        ("=5", "--set expects key=value, got '=5'"),  # was "unknown setting ''"
        ("seed.x=1", "'seed' has no sub-settings"),
    ],
)
def test_bad_overrides_name_the_field(override, message):
    module = load_pipeline_module(DEFAULT)
    with pytest.raises(PipelineError) as info:
        make_settings(module, [override])
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("learner.learning_rate", "learner.lr"),  # a synonym; was 'learner.min_lr_ratio'
        ("learning_rate", "learner.lr"),  # the right name under another parent
        ("lr", "learner.lr"),
        ("max_steps", "steps"),
        ("num_generations", "group_size"),
        ("learner.batchsize", "learner.batch_size"),  # underscores dropped
        ("learner.grad_clip", "learner.max_grad_norm"),
        ("learner.kl_coef", "learner.loss.kl_coef"),
        ("learner.warmup", "learner.warmup_steps"),
        ("learner.lrr", "learner.lr"),  # a typo under the same parent
        ("clip_eps_hi", "learner.loss.clip_eps_high"),
        ("group_sise", "group_size"),
        ("learner.foo", None),  # nothing close: no guess at all
    ],
)
def test_unknown_settings_suggest_what_was_meant(typed, meant):
    module = load_pipeline_module(DEFAULT)
    with pytest.raises(PipelineError) as info:
        make_settings(module, [f"{typed}=1"])
    message = str(info.value)
    assert message.startswith(f"unknown setting {typed!r}.")
    if meant is None:
        assert "Did you mean" not in message
    else:
        assert f"Did you mean {meant!r}?" in message


@pytest.mark.parametrize("typed", ["group_sise", "learner.foo", "nothing_like_any_setting"])
def test_an_unknown_setting_is_a_short_line_pointing_at_list_settings(typed):
    module = load_pipeline_module(DEFAULT)
    with pytest.raises(PipelineError) as info:
        make_settings(module, [f"{typed}=1"])
    message = str(info.value)
    # was every known setting, comma-separated: over 2,000 characters on one line
    assert "\n" not in message and len(message) < 200, message
    assert "--list-settings" in message and "learner.lr," not in message


def test_overrides_parse_bools_tuples_and_paths(tmp_path):
    path = _write(tmp_path, """
        from dataclasses import dataclass
        from pathlib import Path

        from rlhf_pipeline.run_settings import RunSettings

        @dataclass
        class Settings(RunSettings):
            flag: bool = False
            betas: tuple[float, float] = (0.9, 0.99)
            data: Path = Path("x")
            limit: int | None = 3

        def build(settings, run):
            raise NotImplementedError
    """)
    module = load_pipeline_module(path)
    s = apply_overrides(module.Settings(), ["flag=yes", "betas=0.5,0.6", "data=/tmp/d.jsonl", "limit=none"])
    assert s.flag is True and s.betas == (0.5, 0.6) and s.data == Path("/tmp/d.jsonl") and s.limit is None
    with pytest.raises(PipelineError, match="expects true/false"):
        apply_overrides(s, ["flag=maybe"])


def test_pipeline_file_contract_is_checked(tmp_path):
    with pytest.raises(PipelineError, match="does not exist"):
        load_pipeline_module(tmp_path / "missing.py")
    with pytest.raises(PipelineError, match="must define `Settings`"):
        load_pipeline_module(_write(tmp_path, "def build(s, r): pass\n"))
    with pytest.raises(PipelineError, match="a @dataclass subclassing rlhf_pipeline.run_settings.RunSettings"):
        load_pipeline_module(_write(tmp_path, """
            from dataclasses import dataclass
            @dataclass
            class Settings:  # the run's settings are the framework's: a pipeline adds its task's
                steps: int = 1
                device: str = "cpu"
            def build(s, r): pass
        """))


def test_a_syntax_error_in_a_pipeline_file_is_one_line_naming_the_place_and_exit_2(tmp_path, capsys):
    from rlhf_pipeline.cli.main import main

    path = _write(tmp_path, """
        from dataclasses import dataclass
        @dataclass
        class Settings:
            steps: int = 1
            device: str = "cpu"
        def build(settings run):
            pass
    """)
    assert main(["run", str(path), "--home", str(tmp_path / "home")]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"rlhf-pipeline run: error: {path}:7:") and said.count("\n") == 1, said
    assert "SyntaxError: invalid syntax" in said and said.endswith(": def build(settings run):\n")
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("body, line, words", [
    ("import os\nimport no_such_module_here\n", 2,
     "ModuleNotFoundError: No module named 'no_such_module_here', while the pipeline file was loaded; is it "
     "installed in this Python"),
    ("import json\n\nSETS = json.loads('{')\n", 3, "JSONDecodeError: Expecting property name"),
], ids=["missing-module", "raised-deeper"])
def test_a_pipeline_file_that_raises_while_loaded_is_one_line_naming_its_line(tmp_path, capsys, body, line, words):
    """It was a traceback through the import machinery; the line says where in the file, and where the
    error came from when a module it called raised it."""
    from rlhf_pipeline.cli.main import main

    path = tmp_path / "mine.py"
    path.write_text(body)
    assert main(["run", str(path), "--home", str(tmp_path / "home")]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"rlhf-pipeline run: error: {path}:{line}: ") and said.count("\n") == 1, said
    assert words in said and ("raised in " in said) == (line == 3), said
    assert not (tmp_path / "home").exists()


def test_cli_reports_unknown_setting_before_any_work(tmp_path):
    result = preloaded.run(
        [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(DEFAULT), "--home", str(tmp_path),
         "--set", "learner.batchsize=4"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "unknown setting 'learner.batchsize'. Did you mean 'learner.batch_size'?" in result.stderr
    assert not any(tmp_path.iterdir())  # no run directory was created


def test_a_pipeline_file_imports_the_modules_beside_it(tmp_path):
    folder = tmp_path / "my_pipelines"
    folder.mkdir()
    (folder / "my_rewards.py").write_text("STEPS = 11\n")
    declared = '(0 skips the warm start)")] = '  # warm_start_steps's default
    body = DEFAULT.read_text().replace(declared, declared + "STEPS  # ", 1)
    body = body.replace("from __future__ import annotations\n", "from __future__ import annotations\n\nfrom my_rewards import STEPS\n", 1)
    (folder / "mine.py").write_text(body)
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(folder / "mine.py"),
                             "--list-settings"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "  warm_start_steps (int, >= 0) = 11" in result.stdout


def test_cli_help_lists_the_run_flags():
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", "--help"],
                           capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for flag in ("--steps", "--home", "--device", "--run-name", "--set", "--list-settings"):
        assert flag in result.stdout


def test_a_resume_may_change_the_buffer_lock_settings_but_not_the_data_settings():
    from rlhf_pipeline.pipeline import settings_to_json
    from rlhf_pipeline.runs.run_directory import settings_changes

    module = load_pipeline_module(DEFAULT)
    saved = settings_to_json(make_settings(module, []))
    resumed = make_settings(module, ["buffer_lock_lease_s=10", "buffer_lock_wait_s=5", "group_size=4"])
    changed = settings_changes(saved, resumed, tag="[run]", since="the run started")
    assert list(changed) == ["group_size"]  # the writer lock is not the data


@pytest.mark.parametrize("old, new", [("rlhf_pipeline.ray_settings", "rlhf_pipeline.run_settings"),
                                      ("rlhf_pipeline.cluster.settings", "rlhf_pipeline.run_settings"),
                                      ("rlhf_pipeline.collate", "rlhf_pipeline.schema.padding"),
                                      ("rlhf_pipeline.collect.generate", "rlhf_pipeline.generation"),
                                      ("rlhf_pipeline.finite_settings", "rlhf_pipeline.setting_checks")])
def test_a_pipeline_file_importing_a_moved_module_is_refused_naming_its_new_place(tmp_path, old, new):
    """The old names are gone (no shims); a pipeline file written before a move, or a run's copy of one,
    is refused in one line that says where to import from."""
    path = tmp_path / "old_pipeline.py"
    path.write_text(f"import {old}\n")
    with pytest.raises(PipelineError) as raised:
        load_pipeline_module(path)
    message = str(raised.value)
    assert "\n" not in message and f"imports {old}, which moved" in message and new in message
