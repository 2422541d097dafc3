"""Whether this machine can have a CUDA device, told without importing torch.

``run --device cuda`` on a machine without a GPU used to be refused only once the learner child
had imported torch and built the pipeline (36 s on a loaded 2-core machine). A command asked for
``cuda`` calls :func:`check_cuda_device` first, which looks for a GPU driver's files: it says
"no" only where no CUDA device can be there, and "maybe" wherever it cannot tell. Where it lets a
run through, ``torch.cuda.is_available()`` in the pipeline's ``build`` and in the learner stays
the authority (a CPU-only torch build on a GPU machine, a driver too old for torch, are found there).

What it looks for, on Linux: NVIDIA's kernel driver makes ``/dev/nvidiactl``, ``/dev/nvidia0``...
and ``/proc/driver/nvidia`` (a container given a GPU by the NVIDIA container toolkit or a
Kubernetes device plugin gets these too); Jetson boards' integrated GPU is
``/dev/nvhost-ctrl-gpu``; a ROCm build of torch answers to ``cuda`` through AMD's ``/dev/kfd``;
WSL 2 passes a GPU through ``/dev/dxg``. macOS has no CUDA. Elsewhere (Windows) it does not guess.
"""

from __future__ import annotations

import glob
import os
import sys

from rlhf_pipeline.pipeline import PipelineError

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
