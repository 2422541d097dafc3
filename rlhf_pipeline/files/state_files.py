"""Loading the ``.pt`` state files of a run directory without ever running code from them.

A run directory may be shared between machines and users, and ``torch.load(weights_only=False)``
unpickles arbitrary objects: anyone who can write a file there could run code in every learner and
collector that resumes from it. Every state file we write (checkpoints, collector positions, pending
groups, published weights) holds only tensors and plain values, and :func:`load_state` and
:func:`load_state_bytes` read every one with ``weights_only=True``, which refuses any other object,
after checking each member against the CRC32 torch stored with it.
Design: docs/pipelines.md#the-run-directory.
"""

from __future__ import annotations

import os
import pickle
import struct
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


class StateFileError(ValueError):
    """A state file that cannot be loaded safely or at all; the message names it and the fix."""


def why_unreadable(exc: BaseException) -> str:
    """The first sentence of a reader's error, for a one-line refusal (torch's go on for a paragraph)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return first.split(". ")[0].rstrip(".")


CHECKPOINT_REMEDY = "a learner resumes from its previous checkpoint"


def damaged(what: str, where: str, exc: BaseException, *, kind: str = "a torch file",
            remedy: str = CHECKPOINT_REMEDY) -> StateFileError:
    """The one-line refusal of a state file (``what`` at ``where``) that ``exc`` says cannot be read:
    damaged, or not ``kind``; deleting it leaves ``remedy``."""
    return StateFileError(f"cannot read the {what} {where}: {why_unreadable(exc)}. It is damaged or not {kind}; "
                          f"delete it ({remedy})")


# what torch's reader raises on bytes cut short or overwritten (found by damaging state files at random)
_DAMAGED = (RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError, struct.error)


def load_state(path: str | os.PathLike, *, what: str, remedy: str = CHECKPOINT_REMEDY,
               legacy_numpy_arrays: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, with errors that say what to do.

    ``what`` names the file in messages ("learner checkpoint", "writer state"); ``remedy`` is what
    deleting a damaged one leaves. A refused file raises :class:`StateFileError` naming the file, what
    it holds that we never write, and what to do. ``legacy_numpy_arrays=True`` (learner checkpoints
    written before format 2, which hold NumPy's RNG state as an array) lets exactly the NumPy array and
    dtype types through, whose unpickling builds plain arrays and runs nothing else, and only when
    nothing else in the file needs unpickling.
    """
    path = Path(path)
    return _load(lambda: path, what=what, where=str(path), writers=f"anyone who can write to {path.parent}",
                 remedy=remedy, legacy_numpy_arrays=legacy_numpy_arrays, gone=lambda: not path.exists())


def load_state_bytes(data: bytes, *, what: str, where: str, remedy: str = CHECKPOINT_REMEDY,
                     legacy_numpy_arrays: bool = False) -> Any:
    """:func:`load_state` of a state object read from a URL (``where`` names it in messages):
    the same ``weights_only`` load, the same refusals."""
    import io

    return _load(lambda: io.BytesIO(data), what=what, where=where, writers="anyone who can write to that location",
                 remedy=remedy, legacy_numpy_arrays=legacy_numpy_arrays, gone=lambda: False)


def _load(source: Callable[[], Any], *, what: str, where: str, writers: str, remedy: str, legacy_numpy_arrays: bool,
          gone: Callable[[], bool]) -> Any:
    import torch

    if (failed := _member_failing_its_crc(source)) is not None:
        raise StateFileError(f"cannot read the {what} {where}: its {failed} fails the CRC32 torch stored with it. It "
                             f"is damaged; delete it ({remedy})")
    try:
        with warnings.catch_warnings():  # torch's note on the pickle protocol it read in damaged bytes
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(source(), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        unsafe = _unsafe_globals(source())
        if legacy_numpy_arrays and unsafe and set(unsafe) <= set(_numpy_array_types()):
            with torch.serialization.safe_globals(list(_numpy_array_types().values())):
                return torch.load(source(), map_location="cpu", weights_only=True)
        found = ", ".join(unsafe) if unsafe else "objects other than tensors and plain values"
        raise StateFileError(
            f"refusing to load the {what} {where}: it holds {found}, which could run code when loaded and which "
            f"rlhf_pipeline never writes. Find out who wrote it ({writers}), then delete it; {remedy}"
        ) from None
    except _DAMAGED as exc:
        if isinstance(exc, OSError) and gone():
            raise
        raise damaged(what, where, exc, remedy=remedy) from None


def _member_failing_its_crc(source: Callable[[], Any]) -> str | None:
    """The first member of a torch file (a zip archive) whose bytes fail the CRC32 stored with them:
    torch's reader never checks it, so a flipped bit inside a tensor loaded without a word. None when
    every member passes, or when it is no readable archive (torch's reader then says what it is)."""
    try:
        with zipfile.ZipFile(source()) as archive:
            return archive.testzip()
    except Exception:  # noqa: BLE001 - cut short, not a zip, gone: torch.load's own errors name it
        return None


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
