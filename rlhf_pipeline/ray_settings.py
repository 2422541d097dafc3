"""Deprecated name: ``RaySettings`` moved to :mod:`rlhf_pipeline.cluster.settings`.

Kept so that pipeline files written before the move (and the copies run directories keep of
them) still load; they get a warning that names the new import.
"""

import warnings

from rlhf_pipeline.cluster import settings as _moved

warnings.warn("rlhf_pipeline.ray_settings moved to rlhf_pipeline.cluster.settings: write "
              "`from rlhf_pipeline.cluster.settings import RaySettings` (the old name goes away in 0.3)",
              FutureWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)
