"""Loading the ``.pt`` state files of a run directory without ever running code from them.

A run directory may be shared between machines and users, and ``torch.load(weights_only=False)``
unpickles arbitrary objects: anyone who can write a file there could run code in every learner and
collector that resumes from it. Every state file we write (checkpoints, collector positions, pending
groups, published weights) holds only tensors and plain values, and :func:`load_state` and
:func:`load_state_bytes` read every one with ``weights_only=True``, which refuses any other object.
Design: docs/pipelines.md#the-run-directory.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any


class StateFileError(ValueError):
    """A state file that cannot be loaded safely or at all; the message names it and the fix."""


def why_unreadable(exc: BaseException) -> str:
    """The first sentence of a reader's error, for a one-line refusal (torch's go on for a paragraph)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return first.split(". ")[0].rstrip(".")


def load_state(path: str | os.PathLike, *, what: str, legacy_numpy_arrays: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, with errors that say what to do.

    ``what`` names the file in messages ("learner checkpoint", "collector position"). A refused file
    raises :class:`StateFileError` naming the file, what it holds that we never write, and what to do.
    ``legacy_numpy_arrays=True`` (learner checkpoints written before format 2, which hold NumPy's RNG
    state as an array) lets exactly the NumPy array and dtype types through, whose unpickling builds
    plain arrays and runs nothing else, and only when nothing else in the file needs unpickling.
    """
    import torch

    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        unsafe = _unsafe_globals(path)
        if legacy_numpy_arrays and unsafe and set(unsafe) <= set(_numpy_array_types()):
            with torch.serialization.safe_globals(list(_numpy_array_types().values())):
                return torch.load(path, map_location="cpu", weights_only=True)
        found = ", ".join(unsafe) if unsafe else "objects other than tensors and plain values"
        raise StateFileError(
            f"refusing to load the {what} {path}: it holds {found}, which could run code when loaded "
            f"and which rlhf_pipeline never writes. Find out who wrote it (anyone who can write to "
            f"{path.parent}), then delete it; a learner resumes from its previous checkpoint"
        ) from None
    except (RuntimeError, EOFError, OSError) as exc:
        if isinstance(exc, OSError) and not path.exists():
            raise
        raise StateFileError(
            f"cannot read the {what} {path}: {why_unreadable(exc)}. The file is damaged or "
            f"not a torch file; delete it (a learner resumes from its previous checkpoint)"
        ) from None


def load_state_bytes(data: bytes, *, what: str, where: str, legacy_numpy_arrays: bool = False) -> Any:
    """:func:`load_state` of a state object read from a URL (``where`` names it in messages):
    the same ``weights_only`` load, the same refusals."""
    import io

    import torch

    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        unsafe = _unsafe_globals(io.BytesIO(data))
        if legacy_numpy_arrays and unsafe and set(unsafe) <= set(_numpy_array_types()):
            with torch.serialization.safe_globals(list(_numpy_array_types().values())):
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        found = ", ".join(unsafe) if unsafe else "objects other than tensors and plain values"
        raise StateFileError(
            f"refusing to load the {what} {where}: it holds {found}, which could run code when loaded and which "
            f"rlhf_pipeline never writes. Find out who wrote it (anyone who can write to that location), then "
            f"delete it; a learner resumes from its previous checkpoint"
        ) from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise StateFileError(
            f"cannot read the {what} {where}: {why_unreadable(exc)}. The object is damaged or not a torch "
            f"file; delete it (a learner resumes from its previous checkpoint)"
        ) from None


def _unsafe_globals(path) -> list[str]:
    import torch

    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 - only used to word the message and to spot legacy files
        return []


def _numpy_array_types() -> dict[str, Any]:
    """What unpickling a plain NumPy array needs, by the name pickle records (NumPy 1 or 2)."""
    import numpy as np

    try:
        from numpy._core import multiarray
        module = "numpy._core.multiarray"
    except ImportError:  # NumPy 1
        from numpy.core import multiarray
        module = "numpy.core.multiarray"
    types = {f"{module}._reconstruct": multiarray._reconstruct, "numpy.ndarray": np.ndarray,
             "numpy.dtype": np.dtype}
    for dtype_class in (type(np.dtype(t)) for t in ("uint32", "int64", "float64", "uint8")):
        types[f"numpy.dtypes.{dtype_class.__name__}"] = dtype_class
    return types
