"""Subprocess side of the multiprocess and crash tests, and the checksummed rows they share.

Every row written here is derived from its ``trajectory_id`` alone, so a reader can
check any row it gets without knowing what else was written: a torn or partially
written row (zeros, bytes from another row, a short text) fails :func:`check_rows`.

Run as ``python tests/storage/store_worker.py append|sample BACKEND PATH ...``; the
backend comes from ``backends.BACKENDS`` so every backend runs the same workers.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for entry in (str(_HERE), str(_HERE.parent)):
    if entry not in sys.path:
        sys.path.insert(0, entry)

import torch  # noqa: E402

from rlhf_pipeline.schema.ragged import RaggedTensor, lengths_to_offsets  # noqa: E402
from rlhf_pipeline.schema import TrajectoryBatch  # noqa: E402

VOCAB = 50_000


def _lengths(tids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return 1 + tids % 7, 1 + (tids * 13) % 29  # prompt, response


def _expected_tokens(tids: torch.Tensor, lengths: torch.Tensor, salt: int) -> torch.Tensor:
    starts = lengths_to_offsets(lengths)[:-1]
    total = int(lengths.sum())
    position = torch.arange(total) - starts.repeat_interleave(lengths, output_size=total)
    owner = tids.repeat_interleave(lengths, output_size=total)
    return ((owner * 31 + position * salt) % VOCAB).to(torch.int32)


def _texts(tids: list[int]) -> tuple[list[str], list[str]]:
    return [f"prompt of {t}: ünïcödé" for t in tids], [f"answer {t} " + "😀" * (t % 5) for t in tids]


def checksummed_batch(first_tid: int, n: int) -> TrajectoryBatch:
    return rows_for(torch.arange(first_tid, first_tid + n, dtype=torch.int64))


def rows_for(tids: torch.Tensor) -> TrajectoryBatch:
    """The rows with these trajectory ids, exactly as the writer writes them."""
    n = len(tids)
    p_len, r_len = _lengths(tids)
    prompt_text, response_text = _texts(tids.tolist())
    return TrajectoryBatch({
        "prompt_tokens": RaggedTensor(_expected_tokens(tids, p_len, 3), lengths_to_offsets(p_len)),
        "response_tokens": RaggedTensor(_expected_tokens(tids, r_len, 5), lengths_to_offsets(r_len)),
        "response_log_probs": RaggedTensor(
            -(tids % 97 + 1).to(torch.float32).repeat_interleave(r_len) / 100, lengths_to_offsets(r_len)
        ),
        "group_id": tids // 4,
        "trajectory_id": tids,
        "step": torch.zeros(n, dtype=torch.int32),
        "reward": (tids % 1000).to(torch.float32),
        "done": torch.ones(n, dtype=torch.bool),
        "terminated": torch.ones(n, dtype=torch.bool),
        "truncated": torch.zeros(n, dtype=torch.bool),
        "policy_version": tids // 100,
        "prompt_text": prompt_text,
        "response_text": response_text,
    })


def check_rows(batch: TrajectoryBatch) -> None:
    """Raises AssertionError naming the first row that is not exactly what was written."""
    tids = batch["trajectory_id"]
    if len(tids) == 0:
        return
    expected = rows_for(tids)
    for name in batch.field_names:
        want, got = expected[name], batch[name]
        same = got.equal(want) if isinstance(got, RaggedTensor) else (
            torch.equal(got, want) if isinstance(got, torch.Tensor) else list(got) == list(want)
        )
        if not same:
            raise AssertionError(f"field {name!r} of rows with trajectory ids {tids.tolist()} is torn or wrong")


def writer_state_at(next_row: int) -> bytes:
    """The writer state the appending workers publish with the rows up to ``next_row``."""
    return f"rows to {next_row}".encode() * 50  # a few KB, as a collector's position is


def check_resumes_after_a_kill(open_for_append, open_for_read, published: int, label: str) -> None:
    """After a writer was killed: the store reopens for appending with every row published before
    the kill intact and ids without a gap, takes three more rows, and a reader sees exactly those."""
    with open_for_append() as store:
        assert store.next_row >= published, f"{label}: published {published}, reopened {store.next_row}"
        # the state of the last publish came with exactly its rows: both old or both new, never mixed
        if store.next_row:
            assert store.writer_state == writer_state_at(store.next_row), f"{label}: writer state of other rows"
        everything = store.read(torch.arange(len(store)))
        check_rows(everything)
        assert everything["trajectory_id"].tolist() == list(range(store.next_row))
        resumed = store.next_row
        assert store.append(checksummed_batch(resumed, 3)).tolist() == [resumed, resumed + 1, resumed + 2]
    with open_for_read() as reader:
        assert reader.next_row == resumed + 3
        check_rows(reader.read(torch.arange(len(reader))))


def _append(backend, path: str, batch_rows: int, batches: int, report=None) -> None:
    store = backend.open(path, "a")
    done = 0
    while batches < 0 or done < batches:
        # the state names the rows it goes with: a reader finds the two together or neither
        store.append(checksummed_batch(store.next_row, batch_rows),
                     writer_state=writer_state_at(store.next_row + batch_rows))
        done += 1
        if report is None:
            print(f"published {store.next_row}", flush=True)
        else:
            report.send(store.next_row)
    store.close()


def append_forever(backend_name: str, path: str, batch_rows: int, report) -> None:
    """Entry point for a ``multiprocessing`` child: appends until killed, sending ``next_row``."""
    from backends import BACKENDS

    _append(BACKENDS[backend_name], path, batch_rows, -1, report)


def killed_in_first_publish(path: str, moment: str) -> None:
    """Entry point for a ``multiprocessing`` child: appends 40 rows to a new memmap store and is
    killed (SIGKILL) inside that append's publish, the store's first: with the rows written and
    synced and the slot untouched (``moment="before"``), or with the slot's payload written and
    its header not (``"payload"``, the slot is written payload first)."""
    import json
    import os
    import signal

    from rlhf_pipeline.storage.memmap.state_slots import StateSlots
    from rlhf_pipeline.storage.memmap.store import MemmapTrajectoryStore

    def publish(self, seq, data, *, durable=True):
        if moment == "payload":
            fd = os.open(self.paths[seq % 2], os.O_WRONLY | os.O_CREAT, 0o644)
            os.pwrite(fd, json.dumps(data).encode(), 24)  # past the 24-byte header, as publish writes it
            os.fsync(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    StateSlots.publish = publish
    MemmapTrajectoryStore.open(path, "a").append(checksummed_batch(0, 40))


def _sample(backend, path: str, samples: int, batch_size: int) -> None:
    """Samples ``samples`` batches while another process appends, checking every row."""
    from rlhf_pipeline.storage.torchrl_glue import make_replay_buffer

    reader = backend.open(path, "r")
    if reader.refresh_interval_s:
        # an object store's reader re-reads the record at most once a second by default; the
        # writer appends in lock step with the samples here, so every refresh must read it
        reader.refresh_interval_s = 0.0
    rb = make_replay_buffer(reader, batch_size=batch_size)
    print("ready", flush=True)
    lengths_seen: set[int] = set()
    evicted_races = last_next = 0
    done = 0
    while done < samples:
        len(reader)  # refreshes
        assert reader.next_row >= last_next, f"published rows went back from {last_next} to {reader.next_row}"
        last_next = reader.next_row
        lengths_seen.add(last_next)
        try:
            batch = rb.sample()
        except IndexError as exc:  # rows evicted between refresh and read: the documented retry
            assert "evicted" in str(exc), exc
            evicted_races += 1
            continue
        check_rows(batch)
        done += 1
        print("sampled", flush=True)  # the writer appends once per line, so both run together
    print(f"ok samples={done} distinct_lengths={len(lengths_seen)} evicted_races={evicted_races}", flush=True)


def main(argv: list[str]) -> None:
    from backends import BACKENDS

    mode, backend_name, path = argv[:3]
    backend = BACKENDS[backend_name]
    if mode == "append":
        _append(backend, path, batch_rows=int(argv[3]), batches=int(argv[4]))
    elif mode == "sample":
        _sample(backend, path, samples=int(argv[3]), batch_size=int(argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode!r}; use append or sample")


if __name__ == "__main__":
    main(sys.argv[1:])
