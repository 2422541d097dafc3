"""What needs no vLLM: the engine side's imports, setup-vllm's refusals, the settings' checks."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from rlhf_pipeline.generation.settings import GenerationSettings, check_generation, find_vllm_python
from rlhf_pipeline.generation.vllm_setup import MARKER, SetupError, setup_vllm
from rlhf_pipeline.pipeline import PipelineError, load_pipeline_module, make_settings

PACKAGE = Path(__file__).resolve().parents[2] / "rlhf_pipeline"
ENGINE_SIDE = ("generation/vllm_server.py", "generation/vllm_worker.py", "generation/__init__.py", "__init__.py")
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
            assert name in ("rlhf_pipeline.generation.vllm_worker",), f"{module} imports {name}"


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
        module.check(make_settings(module, ["generation.engine=vllm"]))
    module.check(make_settings(module, []))  # the default, our loop, is unchanged
