"""Subprocess side of the long-run test in test_open_files.py: a collector-like writer and a
learner-like reader in one process over a buffer of small segments, for many steps.

Run as ``python tests/storage/fd_limit_worker.py BUFFER STEPS MAPPED_SEGMENTS`` under a low
``RLIMIT_NOFILE``. Every step the reader refreshes, reads the newest rows and a padded batch
of random rows anywhere in the buffer (as the window and uniform samplers do); the writer adds
a segment every fourth step, into a store without capacity, so the segments only grow. Prints
one line: descriptors, mappings and RSS after step 100 and at the end.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from helpers import make_batch  # noqa: E402
from rlhf_pipeline.storage import create_store, open_buffer  # noqa: E402
from rlhf_pipeline.storage.sharded import shard_path  # noqa: E402

SEGMENT_ROWS = 8


def usage() -> tuple[int, int, int]:
    """(open descriptors, mappings, resident KiB) of this process."""
    with open("/proc/self/maps") as maps:
        mapped = sum(1 for _ in maps)
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
    return len(os.listdir("/proc/self/fd")), mapped, rss


def main(buffer: str, steps: int, mapped_segments: int) -> None:
    torch.set_num_threads(1)
    writer = create_store(shard_path(buffer, 0), "memmap", segment_rows=SEGMENT_ROWS, durable=False)
    segments = 0

    def write_segment() -> None:
        nonlocal segments
        writer.append(make_batch(2, 4, seed=segments, prompt_len=(1, 4), response_len=(1, 4),
                                 first_trajectory_id=segments * SEGMENT_ROWS))
        segments += 1

    write_segment()
    reader = open_buffer(buffer, mapped_segments=mapped_segments)
    generator = torch.Generator().manual_seed(0)
    early = usage()
    for step in range(steps):
        if step % 4 == 0:
            write_segment()
        rows = reader.refresh()
        newest = reader.read(torch.arange(rows - SEGMENT_ROWS, rows))
        assert newest["trajectory_id"].tolist() == list(range(rows - SEGMENT_ROWS, rows)), step
        anywhere = torch.randint(0, rows, (8,), generator=generator)
        padded = reader.read_padded(anywhere)
        assert padded["trajectory_id"].tolist() == anywhere.tolist(), step
        if step == 100:
            early = usage()
    late = usage()
    print(f"steps {steps} segments {segments} fds {early[0]}->{late[0]} maps {early[1]}->{late[1]} "
          f"rss_kib {early[2]}->{late[2]}", flush=True)
    reader.close()
    writer.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
