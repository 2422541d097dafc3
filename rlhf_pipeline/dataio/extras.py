"""Optional dependencies, imported only by the commands that need them.

The core install stays small: Parquet and Hugging Face ``datasets`` readers come with the
``data`` extra, charts with the ``plot`` extra. :func:`require` imports one and, when it is
missing, says which extra installs it. Design: docs/datasets.md.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from types import ModuleType

# module -> the extra of this package that installs it
EXTRAS = {"pyarrow": "data", "pyarrow.parquet": "data", "datasets": "data", "matplotlib": "plot"}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message says how to install it."""


def require(module: str, purpose: str) -> ModuleType:
    """``importlib.import_module(module)``, or an error naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(_missing(module, purpose)) from None


def missing_extra(modules: Sequence[str], purpose: str) -> str | None:
    """What :func:`require` would say of the first of ``modules`` that is not installed, found
    without importing any (a command checks before it imports torch); None when all are there."""
    for module in modules:
        top = module.split(".")[0]
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):  # a broken install, or sys.modules[top] set to None
            found = False
        if not found:
            return _missing(module, purpose)
    return None


def _missing(module: str, purpose: str) -> str:
    extra = EXTRAS.get(module, "data")
    return (f"{purpose} needs the optional package {module.split('.')[0]!r}; install it with "
            f"`pip install -e '.[{extra}]'` (from a checkout) or `pip install 'rlhf-pipeline[{extra}]'`")
