"""What the storage benchmarks run on and compare: the synthetic data (:class:`BenchSpec`), the
backends by name (:data:`BACKENDS`, :func:`load_backend`) and the baselines the ratios are
taken against; plus the helpers every benchmark shares (:func:`log`, :func:`directory_bytes`).
Design: docs/benchmarks.md#adding-a-backend.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

    from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch


# backend name -> "module:factory" (imported only when the backend runs)
BACKENDS: dict[str, str] = {
    "raw-numpy": "rlhf_pipeline.bench.baselines:RawNumpyBackend",
    "raw-numpy-fsync": "rlhf_pipeline.bench.baselines:RawNumpyFsyncBackend",
    "memmap": "rlhf_pipeline.bench.storage_bench:MemmapBackend",
    "memmap-nofsync": "rlhf_pipeline.bench.storage_bench:MemmapNoFsyncBackend",
    "memmap-seg256": "rlhf_pipeline.bench.storage_bench:MemmapSmallSegmentsBackend",
    "torchrl-lazystack": "rlhf_pipeline.bench.baselines:TorchRLLazyStackBackend",
    "torchrl-lazymemmap": "rlhf_pipeline.bench.baselines:TorchRLLazyMemmapBackend",
    "zarr": "rlhf_pipeline.bench.zarr_backend:ZarrBackend",
    "zarr-s3": "rlhf_pipeline.bench.zarr_backend:RemoteZarrBackend",  # at --location
    "zarr-s3-throttled": "rlhf_pipeline.bench.zarr_backend:ThrottledRemoteZarrBackend",  # reader refresh <= 1/s
}


# what runs without --backends (a variant that only repeats a point can stay out of it)
DEFAULT_BACKENDS: tuple[str, ...] = ("raw-numpy", "raw-numpy-fsync", "memmap", "memmap-nofsync",
                                     "torchrl-lazystack", "torchrl-lazymemmap", "zarr")


# backends that need --location (an object store); the rest run anywhere
REMOTE_BACKENDS: tuple[str, ...] = ("zarr-s3", "zarr-s3-throttled")


# with --location: the remote store beside the local ones it is compared with
LOCATION_BACKENDS: tuple[str, ...] = ("raw-numpy", "raw-numpy-fsync", "memmap", "zarr", "zarr-s3",
                                      "zarr-s3-throttled")


BASELINE = "raw-numpy"


# writes compare with the raw baseline that does the same durability work: a store that
# fsyncs every append against raw files fsynced after every batch
DURABLE_BASELINE = "raw-numpy-fsync"


@dataclass(frozen=True)
class BenchSpec:
    """What every backend is run on; equal specs give byte-identical data and positions."""

    completions: int = 16_384
    group_size: int = 8
    min_prompt_len: int = 32
    max_prompt_len: int = 256
    min_response_len: int = 16
    max_response_len: int = 1024
    write_batch_size: int = 512
    sample_batch_size: int = 64
    sample_batches: int = 200
    seed: int = 0
    optional_fields: tuple[str, ...] = ("advantage",)
    index_dtype: str = "int32"  # of token ids and position_ids: the learner's (int64: pad_batch's default)
    location: str | None = None  # the object-store URL the zarr-s3 backend writes under
    storage_options: tuple[tuple[str, Any], ...] = ()  # its fsspec options (endpoint_url, key, ...)

    @property
    def torch_index_dtype(self) -> torch.dtype:
        import torch

        return {"int32": torch.int32, "int64": torch.int64}[self.index_dtype]

    @property
    def schema(self) -> StoreSchema:
        from rlhf_pipeline.schema import StoreSchema

        return StoreSchema(self.optional_fields)

    def batches(self):
        from rlhf_pipeline.schema.synthetic import synthetic_batches

        return synthetic_batches(
            self.completions, group_size=self.group_size,
            prompt_len=(self.min_prompt_len, self.max_prompt_len),
            response_len=(self.min_response_len, self.max_response_len),
            batch_size=self.write_batch_size, seed=self.seed, optional_fields=self.optional_fields,
        )

    def sample_positions(self) -> list[torch.Tensor]:
        import torch

        generator = torch.Generator().manual_seed(self.seed + 1)
        return [
            torch.randint(0, self.completions, (self.sample_batch_size,), generator=generator)
            for _ in range(self.sample_batches)
        ]


class StorageBackend(Protocol):
    name: str

    def setup(self, directory: Path, spec: BenchSpec) -> None: ...
    def write(self, batch: TrajectoryBatch) -> None: ...
    def finish_writes(self) -> None: ...
    def sample_padded(self, positions: torch.Tensor) -> TensorDict: ...
    def disk_bytes(self) -> int: ...
    def close(self) -> None: ...


def directory_bytes(path: Path) -> int:
    """Allocated bytes of what lies under ``path``, as ``du`` counts them (files and directories,
    sparse files only what is written; ``path``'s own directory block not included): for our
    stores exactly the ``bytes on disk`` that ``rlhf-pipeline inspect`` reports."""
    from rlhf_pipeline.storage.summary import disk_usage

    return sum(disk_usage(entry.path) for entry in os.scandir(path))


def load_backend(name: str) -> StorageBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from {sorted(BACKENDS)}")
    module_name, _, attr = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module_name), attr)()


def log(message: str, enabled: bool = True) -> None:
    """One progress line on stderr (the tables go to stdout), when ``enabled``."""
    if enabled:
        print(message, file=sys.stderr, flush=True)
