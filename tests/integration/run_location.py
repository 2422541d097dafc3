"""What the integration tests read back from a run wherever it lives (a directory, ``s3://``, ``az://``):
its logs, its newest weights and the bytes of its objects, through the run's own store, so that one
test body holds for every location the ``run_home`` fixture (``tests/conftest.py``) hands it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from rlhf_pipeline.coordination.weights import load_weights
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.runs.lineage import run_store_at


def logged(run: str | Path, log: str = "metrics.jsonl") -> list[dict]:
    """The lines of the run's log ``log`` (at a URL: its numbered parts, in order)."""
    if "://" in str(run):
        return read_metrics(log, store=run_store_at(run))
    return read_metrics(Path(run) / log)


def same_weights(a: str | Path, b: str | Path) -> bool:
    """The runs' newest weights are equal, tensor by tensor."""
    (wa, _), (wb, _) = load_weights(run_store_at(a)), load_weights(run_store_at(b))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def digest(run: str | Path) -> dict[str, str]:
    """Every object of the run (a file, in a directory) by a digest of its bytes."""
    store = run_store_at(run)
    return {key: hashlib.sha256(store.read(key) or b"").hexdigest() for key in sorted(store.walk())}


TIMING = ("time", "tokens_per_s", "_s")  # metrics that measure time, not what was trained


def trained(records: list[dict], labels: tuple[str, ...] = ()) -> list[dict]:
    """What was trained, step by step: the metrics less those measuring time (and any naming ``labels``)."""
    return [{k: v for k, v in r.items() if not k.endswith(TIMING) and not any(n in k for n in labels)}
            for r in records]
