"""Subprocess side of ``test_zarr_full_disk.py``: a disk that fills at every byte of a commit record.

``RLIMIT_FSIZE`` set to ``k`` makes the kernel write at most the first ``k`` bytes of a file and
then fail with ``EFBIG``, as a full disk does with ``ENOSPC``: the write that crosses the limit
returns short, the next one fails. An audit hook sets the limit when the store opens its
``zarr.json.partial`` and only then, so the unit's own files are written whole and the record is
cut at byte ``k``, for every ``k`` from 0 up to the first that holds the whole record; a
fragment's chunk (written with one ``writev``) is cut the same way at a few bytes. The
store's code runs unchanged (nothing of ours is replaced); the limit and the hook are
process-wide and permanent, hence a process of their own.

Run as ``python tests/storage/full_disk_worker.py PATH``; prints one JSON line per publish path.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for entry in (str(_HERE), str(_HERE.parent)):
    if entry not in sys.path:
        sys.path.insert(0, entry)

from helpers import make_batch  # noqa: E402

from rlhf_pipeline.schema import TrajectoryBatch  # noqa: E402
from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore  # noqa: E402

RECORD = "zarr.json.partial"
_cut: tuple[str, int] | None = None  # (the file, by the end of its name; the bytes it gets)


def _limit_the_file(event: str, args: tuple) -> None:
    if event == "open" and _cut is not None and isinstance(args[0], (str, os.PathLike)) \
            and os.fspath(args[0]).endswith(_cut[0]):
        resource.setrlimit(resource.RLIMIT_FSIZE, (_cut[1], resource.RLIM_INFINITY))


def append_with_cut(store: ZarrTrajectoryStore, batch: TrajectoryBatch, k: int, file: str = RECORD) -> OSError | None:
    """Appends ``batch`` with room for ``k`` bytes of ``file`` (the record by default); the error, or None."""
    global _cut
    _cut = (file, k)
    try:
        store.append(batch)
        return None
    except OSError as exc:
        return exc
    finally:
        _cut = None
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def sweep(path: Path, *, segment_rows: int, durable: bool, step: int = 1, chunk_bytes: int = 0) -> dict:
    """Cuts the record of one append at every ``step``-th byte until it fits, then the first
    ``chunk_bytes`` of the next append's chunk every 23rd byte; checks the store after each cut."""
    first, second, third = (make_batch(1, 2, seed=i, first_group_id=i, first_trajectory_id=2 * i) for i in range(3))
    store = ZarrTrajectoryStore.create(str(path), segment_rows=segment_rows, durable=durable)
    store.append(first)
    good = (path / "zarr.json").read_bytes()
    k, unnamed, left = 0, [], []
    while (error := append_with_cut(store, second, k)) is not None:
        # the append failed at the record (not at a unit's files) and left the acknowledged record
        # in place, byte for byte
        assert error.errno == errno.EFBIG, (k, error)
        assert (path / "zarr.json").read_bytes() == good, f"the record was replaced by a cut at {k} bytes"
        assert len(store) == 2, (k, len(store))
        if not str(error.filename).endswith(RECORD):
            unnamed.append(k)
        # with nothing of the failed append beside it: a full disk gets that space back at once
        if (path / RECORD).exists() or \
                {p.name for p in (path / "units").iterdir()} != {"zarr.json", *(u.name for u in store.units)}:
            left.append(k)
        k += step
    record = (path / "zarr.json").read_bytes()
    try:
        json.loads(record)
    except ValueError:
        raise AssertionError(f"an append was acknowledged with {k} bytes of its commit record on disk, a torn "
                             f"zarr.json: {record[-40:]!r}") from None
    # the first limit that lets the append through holds the whole new record: no shorter cut got through
    assert k - step < len(record) <= k, (k, len(record))
    assert not unnamed, f"the errors of cuts at {unnamed[:8]}... do not name {RECORD}"
    assert not left, f"cuts at {left[:8]}... left the failed append's record or unit behind"
    for cut in range(0, chunk_bytes, 23):
        error = append_with_cut(store, third, cut, file="/c.0")
        assert error is not None and error.errno == errno.EFBIG and error.filename.endswith("c.0"), (cut, error)
        assert (path / "zarr.json").read_bytes() == record and len(store) == 4, cut
    store.append(third)  # the space is back
    if chunk_bytes:  # every cut fell inside the chunk
        assert (path / "units" / store.units[-1].name / "c.0").stat().st_size > chunk_bytes
    store.close()
    reader = ZarrTrajectoryStore.open(str(path))
    try:
        expected = TrajectoryBatch.cat([first, second, third])
        got = reader.read(list(range(len(reader))))
        assert got.trajectory_id.tolist() == expected.trajectory_id.tolist() == list(range(6))
        assert got.response_tokens.values.tolist() == expected.response_tokens.values.tolist()
    finally:
        reader.close()
    return {"store": path.name, "cuts": k, "record_bytes": len(record)}


def main(root: Path) -> None:
    sys.addaudithook(_limit_the_file)
    # Every byte of the path that every append but a segment's last takes (a fragment: two files,
    # their fsyncs issued together); every 61st byte of the other two (a sealed segment: five
    # files, one syncfs; a store opened with durable=False: Python's buffered writes).
    for name, segment_rows, durable, step in (("fragment", 1024, True, 1), ("segment", 2, True, 61),
                                              ("not-durable", 1024, False, 61)):
        print(json.dumps(sweep(root / name, segment_rows=segment_rows, durable=durable, step=step,
                               chunk_bytes=400 if name == "fragment" else 0)), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
