"""The row model, the lowest layer: what one stored row is, its columnar and padded forms.

:mod:`.fields` (``FIELDS``, ``StoreSchema``, ``Trajectory``), :mod:`.batch` (``TrajectoryBatch``, the door
check ``validate_batch``), :mod:`.from_rows` (rows into columns), :mod:`.ragged` (``RaggedTensor``),
:mod:`.padding` (the learner's padded batch), :mod:`.termination`, :mod:`.tool_errors` and :mod:`.ids`
(what stored codes and ids mean), :mod:`.synthetic` (valid rows for benchmarks and tests).
``from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch, ...`` names what :mod:`.fields`,
:mod:`.batch` and :mod:`.termination` define, each imported when first named. Nothing here imports
another layer. Design: docs/schema.md; invariants: docs/architecture.md#rows-and-the-padded-batch.
"""

import importlib

# name -> the module defining it. Resolved on first use (PEP 562), so that a torch-free reader
# (``inspect``, which names termination reasons) can import ``.termination`` without the
# package importing torch through ``.batch`` and ``.fields``.
_DEFINED_IN = {
    "TrajectoryBatch": "batch", "validate_batch": "batch", "TerminationReason": "termination",
    **{name: "fields" for name in (
        "FIELDS", "FIELDS_BY_NAME", "LOG_PROB_TOLERANCE", "NUMPY_DTYPES", "OPTIONAL_FIELDS", "REQUIRED_FIELDS",
        "SCHEMA_VERSION", "TOKEN_ID_MAX", "Column", "FieldKind", "FieldSpec", "StoreSchema", "Trajectory",
        "TrajectoryValidationError")},
}
__all__ = sorted(_DEFINED_IN)


def __getattr__(name: str):
    module = _DEFINED_IN.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_DEFINED_IN))
