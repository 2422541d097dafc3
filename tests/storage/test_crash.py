"""A writer killed with SIGKILL at arbitrary moments never loses or damages a published row.

Writers are real processes started from a ``forkserver`` that imported the storage
modules once, so each of the several kills costs a fork, not an interpreter start.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal

import pytest
import torch
import store_worker
from backends import BACKENDS
from store_worker import check_resumes_after_a_kill

from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage.buffers import repair_buffer, verify_buffer

KILLS = 5


@pytest.fixture(scope="module")
def forkserver():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "store_worker", "backends", "rlhf_pipeline.storage.memmap.store",
                                     "rlhf_pipeline.storage.zarr.store"])
    return context


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
def test_sigkilled_writer_leaves_every_published_row_intact(backend_name, forkserver, tmp_path):
    torch.set_num_threads(1)
    backend = BACKENDS[backend_name]
    path = str(tmp_path / "buffer")
    backend.create(path, StoreSchema(), segment_rows=32).close()
    rng = random.Random(1234)
    for kill in range(KILLS):
        receive, send = forkserver.Pipe(duplex=False)
        writer = forkserver.Process(
            target=store_worker.append_forever, args=(backend_name, path, rng.randint(1, 40), send), daemon=True
        )
        writer.start()
        send.close()
        # let it publish a random number of appends, then kill it wherever it is
        published = 0
        for _ in range(rng.randint(1, 30)):
            if not receive.poll(120):
                writer.kill()
                pytest.fail(f"kill {kill}: the writer published nothing (exit code {writer.exitcode})")
            published = receive.recv()
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        receive.close()
        assert writer.exitcode == -signal.SIGKILL

        # the publish record is intact: whatever the killed writer left past it was never
        # acknowledged, so repair finds nothing to do and every published byte verifies
        report, = repair_buffer(path)
        assert not report.actions and not report.unrecoverable, f"kill {kill}: {report.format()}"
        assert report.rows_before >= published, f"kill {kill}: {report.format()}"
        check, = verify_buffer(path)
        assert check.ok, f"kill {kill}: {check.problems}"

        # the lock died with the writer
        check_resumes_after_a_kill(lambda: backend.open(path, "a"), lambda: backend.open(path, "r"),
                                   published, f"kill {kill}")


@pytest.mark.parametrize("moment", ["before", "payload"])
def test_a_store_killed_in_its_first_publish_is_a_new_store_not_a_damaged_one(forkserver, tmp_path, moment):
    """Rows a writer wrote before its first publish landed were never acknowledged: the store
    reopens empty without a word of damage, and its next writer discards them."""
    torch.set_num_threads(1)
    path = str(tmp_path / "buffer")
    backend = BACKENDS["memmap"]
    backend.create(path, StoreSchema(), segment_rows=32).close()  # 40 rows: a sealed segment and 8 more
    writer = forkserver.Process(target=store_worker.killed_in_first_publish, args=(path, moment), daemon=True)
    writer.start()
    writer.join(120)
    assert writer.exitcode == -signal.SIGKILL
    report, = repair_buffer(path)
    assert not report.actions and not report.unrecoverable and report.rows_before == 0, report.format()
    check, = verify_buffer(path)
    assert check.ok, check.problems
    check_resumes_after_a_kill(lambda: backend.open(path, "a"), lambda: backend.open(path, "r"), 0, moment)
