"""Where runs live on disk: ``$RLHF_PIPELINE_HOME`` or ``storage/`` beside the package."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV_VAR = "RLHF_PIPELINE_HOME"


def default_home() -> Path:
    """The data home: ``$RLHF_PIPELINE_HOME`` if set, else ``<repo>/storage``.

    Only the *location* of data comes from the environment; pipeline settings never do.
    """
    override = os.environ.get(HOME_ENV_VAR)
    if override:
        return Path(override).expanduser().resolve()
    return (Path(__file__).resolve().parent.parent / "storage").resolve()


def run_dir(run_name: str, home: str | Path | None = None) -> Path:
    return (Path(home) if home is not None else default_home()) / run_name
