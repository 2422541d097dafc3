"""Optional dependencies, imported only by the commands that need them.

The core install stays small: Parquet and Hugging Face ``datasets`` readers come with the
``data`` extra, charts with the ``plot`` extra. :func:`require` imports one and, when it is
missing, says which extra installs it.
"""

from __future__ import annotations

import importlib
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
        extra = EXTRAS.get(module, "data")
        raise MissingExtraError(
            f"{purpose} needs the optional package {module.split('.')[0]!r}; install it with "
            f"`pip install -e '.[{extra}]'` (from a checkout) or `pip install 'rlhf-pipeline[{extra}]'`"
        ) from None
