"""Deprecated name: the padded learner batch moved to :mod:`rlhf_pipeline.schema.padding`."""

import warnings

from rlhf_pipeline.schema import padding as _moved

warnings.warn("rlhf_pipeline.collate moved to rlhf_pipeline.schema.padding: import PaddedCollator, "
              "pad_batch and padded_fields from there (the old name goes away in 0.3)", FutureWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)
