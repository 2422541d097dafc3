"""Writes the stores in ``format1-stores.tar.gz``: buffers as the library wrote them before checksums.

The archive was made by running this script with the library of commit 403534f (memmap
manifests without field layout, segments without checksums; Zarr format 1: per-field units
and packed fragments, no crc32c), e.g. from ``git archive 403534f | tar -x -C /tmp/old`` with
``/tmp/old`` and ``/tmp/old/tests`` first on ``sys.path`` (and, in a venv holding an editable
install of a newer checkout, its ``__editable__`` finder removed from ``sys.meta_path``, so
that the old package is the one imported); the argument is the output directory.

``tests/storage/test_old_stores.py`` checks that today's library reads them (row for row
against ``helpers.make_batch`` with the same seeds), appends to them and verifies them.
"""

from __future__ import annotations

import shutil
import sys
import tarfile
from pathlib import Path

from helpers import make_batch

from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore
from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore

SCHEMA = StoreSchema(optional=("advantage",))


def batches():
    return [make_batch(2, 3, seed=i, optional=("advantage",), first_group_id=2 * i, first_trajectory_id=6 * i,
                       policy_version=i) for i in range(3)]  # 18 rows: two sealed segments of 8 and 2 more


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with MemmapTrajectoryStore.create(out / "memmap", SCHEMA, segment_rows=8) as store:
        for b in batches():
            store.append(b)
    with ZarrTrajectoryStore.create(str(out / "zarr-closed"), SCHEMA, segment_rows=8) as store:
        for b in batches():
            store.append(b)
    with ZarrTrajectoryStore.create(str(out / "zarr-live"), SCHEMA, segment_rows=8) as store:
        for b in batches():
            store.append(b)
        store.flush()  # sealed segments published, the open one still a packed fragment: copy it now
        shutil.copytree(out / "zarr-live", out / "zarr-packed", ignore=shutil.ignore_patterns("writer.lock"))
    shutil.rmtree(out / "zarr-live")
    for lock in out.rglob("writer.lock"):
        lock.unlink()
    with tarfile.open(out / "format1-stores.tar.gz", "w:gz") as tar:
        for name in ("memmap", "zarr-closed", "zarr-packed"):
            tar.add(out / name, arcname=name)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
