"""What a run's settings ask of this machine, told without importing torch: a CUDA device (a GPU
driver's files) for ``--device cuda``, peft for ``learner.lora.rank > 0``; refused before a child
imports torch to find it missing. Design: docs/pipelines.md#start-up.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from typing import Any

from rlhf_pipeline.pipeline import PipelineError

# NVIDIA's driver (a container given a GPU gets these too), Jetson's integrated GPU, AMD's ROCm (torch
# answers to "cuda" there), WSL 2's pass-through
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/nvhost-ctrl-gpu", "/dev/kfd", "/dev/dxg")


def no_cuda_reason(platform: str = sys.platform, root: str = "/") -> str | None:
    """Why no CUDA device can be used here, or None when one may be. ``root``: where to look for
    the driver's files (tests)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from this process"
    if platform == "darwin":
        return "macOS has no CUDA"
    if not platform.startswith("linux"):
        return None
    here = [os.path.join(root, path.lstrip("/")) for path in GPU_DRIVER_FILES]
    if any(os.path.exists(path) for path in here) or glob.glob(os.path.join(root, "dev", "nvidia[0-9]*")):
        return None
    return "this machine has no GPU driver (no /dev/nvidia*, /proc/driver/nvidia, /dev/kfd or /dev/dxg)"


def check_cuda_device(device: str, what: str = "setting 'device'") -> None:
    """Raises :class:`PipelineError` when ``device`` is a CUDA device this machine cannot have."""
    if not str(device).startswith("cuda"):
        return
    reason = no_cuda_reason()
    if reason is not None:
        raise PipelineError(f"{what} is {device!r} but {reason}; use --device cpu")


def check_lora_trainable(lora: Any) -> None:
    """Raises :class:`PipelineError` when ``lora`` (``learner.lora``) asks for an adapter and peft, which
    the learner trains it with, is not installed: the learner's process found out with a traceback once
    the collectors were sampling. A collector needs no peft (it merges adapters with torch alone)."""
    if lora.enabled and importlib.util.find_spec("peft") is None:
        raise PipelineError(f"setting 'learner.lora.rank' is {lora.rank}: a LoRA learner trains its adapter with "
                            f"peft, which is not installed; install it with `pip install -e '.[lora]'` (from a "
                            f"checkout) or `pip install 'rlhf-pipeline[lora]'`")
