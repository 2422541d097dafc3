"""The row model, the lowest layer: what one stored row is, its columnar and padded forms.

* :mod:`.fields` -- the field table (``FIELDS``), ``StoreSchema`` and one row, ``Trajectory``;
* :mod:`.batch` -- ``TrajectoryBatch`` (N rows as columns) and ``validate_batch``, the door check;
* :mod:`.from_rows` -- rows given one by one (dicts, ``Trajectory``) into columns;
* :mod:`.ragged` -- ``RaggedTensor``, flat values plus offsets;
* :mod:`.padding` -- the learner's padded ``(B, T)`` batch (``pad_batch``, ``PaddedCollator``);
* :mod:`.termination` -- ``TerminationReason``, the codes of the ``termination_reason`` field;
* :mod:`.ids` -- which collector wrote a row, from its id's high bits;
* :mod:`.synthetic` -- valid synthetic batches of any size, for benchmarks and tests.

``from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch, ...`` is the public import; it
names what :mod:`.fields` and :mod:`.batch` define. Nothing here imports another layer.
"""

from rlhf_pipeline.schema.batch import TrajectoryBatch, validate_batch
from rlhf_pipeline.schema.fields import (
    FIELDS,
    FIELDS_BY_NAME,
    LOG_PROB_TOLERANCE,
    NUMPY_DTYPES,
    OPTIONAL_FIELDS,
    REQUIRED_FIELDS,
    SCHEMA_VERSION,
    TOKEN_ID_MAX,
    Column,
    FieldKind,
    FieldSpec,
    StoreSchema,
    Trajectory,
    TrajectoryValidationError,
)
from rlhf_pipeline.schema.termination import TerminationReason

__all__ = [
    "FIELDS", "FIELDS_BY_NAME", "LOG_PROB_TOLERANCE", "NUMPY_DTYPES", "OPTIONAL_FIELDS",
    "REQUIRED_FIELDS", "SCHEMA_VERSION", "TOKEN_ID_MAX", "Column", "FieldKind", "FieldSpec",
    "StoreSchema", "TerminationReason", "Trajectory", "TrajectoryBatch", "TrajectoryValidationError", "validate_batch",
]
