"""What a memmap reader following a writer pays to check the open segment's bytes on read.

    python benchmarks/bench_open_segment_reads.py                          # this checkout only
    python benchmarks/bench_open_segment_reads.py --baseline-rev 0f715ed   # and an older library, side by side

A writer appends GRPO-shaped rows (prompts of 32-256 tokens, responses of 16-1024, an
``advantage`` column; the storage benchmark's data) in rounds of ``--round-rows``, as a
collector does; after each publish a reader in the same process refreshes and reads a padded
batch of 64 rows drawn from the newest 1,024 (a learner's ``sample_window``), then
``--samples`` more batches from the same state. Timed per publish: the append, the reader's
first refresh-and-read (``follow``: where the checks of the bytes just published run), and the
median of the later reads (``sample``: steady state). ``read checks`` is the time the reader
spent inside its checks of bytes against their recorded CRCs at that publish (where the library
has them). ``full CRC`` is what checking the open segment's whole published prefix costs at
that publish (CRC32C over every file's published bytes): what re-checking it per publish, or
per read, would add instead of checking each published byte once.

With ``--baseline-rev`` the ``rlhf_pipeline`` package of that git revision (``git archive``)
runs in alternation with this checkout (A B A B ..., each run its own process), so both meet the
same moments of a shared machine; the table shows the median of the runs' medians, the range
over runs, and the ratios of the medians and of the best runs (this checkout over the baseline;
the noise of a shared machine only ever adds time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_worker(rounds: int, round_rows: int, samples: int, seed: int) -> dict[str, list[float]]:
    """One run in this process (with whichever ``rlhf_pipeline`` it imports): ms per publish."""
    import google_crc32c
    import numpy as np
    import torch

    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.schema.padding import PaddedCollator
    from rlhf_pipeline.schema.synthetic import synthetic_batches
    from rlhf_pipeline.storage.memmap.store import MemmapTrajectoryStore

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(seed)
    collator = PaddedCollator(index_dtype=torch.int32)
    times: dict[str, list[float]] = {"append": [], "follow": [], "sample": [], "full CRC": []}
    checking = _time_read_checks()  # seconds spent checking bytes on read, where the library does
    if checking is not None:
        times["read checks"] = []
    with tempfile.TemporaryDirectory(prefix="bench-open-segment-") as tmp:
        path = Path(tmp) / "buffer"
        batches = synthetic_batches(rounds * round_rows, batch_size=round_rows, seed=seed,
                                    optional_fields=("advantage",))
        # durable=False: the fsyncs would swamp the append's CPU cost on a shared disk
        with MemmapTrajectoryStore.create(path, StoreSchema(("advantage",)), durable=False) as writer, \
                MemmapTrajectoryStore.open(path) as reader:
            for batch in batches:
                if checking is not None:
                    checking[0] = 0.0
                start = time.perf_counter()
                writer.append(batch)
                times["append"].append(time.perf_counter() - start)
                start = time.perf_counter()
                reader.refresh()
                rows = len(reader)
                collator.read(reader, _positions(rows, generator))
                times["follow"].append(time.perf_counter() - start)
                steady = []
                for _ in range(samples):
                    positions = _positions(rows, generator)
                    start = time.perf_counter()
                    collator.read(reader, positions)
                    steady.append(time.perf_counter() - start)
                times["sample"].append(statistics.median(steady))
                times["full CRC"].append(_full_crc_seconds(path, google_crc32c, np))
                if checking is not None:
                    times["read checks"].append(checking[0])
    return {name: [t * 1e3 for t in values] for name, values in times.items()}


def _time_read_checks() -> list[float] | None:
    """Wraps the reader's byte checks with a timer (a one-element list of seconds); None when the
    library under test has none (a version before them)."""
    try:
        from rlhf_pipeline.storage.memmap.views import SegmentView
    except ImportError:
        return None
    spent = [0.0]
    check = SegmentView._check

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return check(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    SegmentView._check = timed
    return spent


def _positions(rows: int, generator):
    import torch

    return torch.randint(max(0, rows - 1024), rows, (64,), generator=generator)


def _full_crc_seconds(path: Path, google_crc32c, np) -> float:
    """CRC32C of every file of the open (last) segment over its published bytes, from the page cache."""
    from rlhf_pipeline.storage.memmap.inspection import PublishedView
    from rlhf_pipeline.storage.memmap.layout import segment_dir_name, segment_files

    view = PublishedView(path)
    state = view.segments[-1]
    directory = path / segment_dir_name(state.id)
    arrays = [np.memmap(directory / name, dtype=np.uint8, mode="r", shape=(count * dtype.itemsize,))
              for name, (dtype, count) in segment_files(view.fields, state).items() if count]
    start = time.perf_counter()
    for array in arrays:
        google_crc32c.value(array)
    return time.perf_counter() - start


def _baseline_tree(rev: str) -> Path:
    """``rlhf_pipeline/`` of git revision ``rev`` in a temporary directory (for PYTHONPATH)."""
    target = Path(tempfile.mkdtemp(prefix=f"bench-baseline-{rev}-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "rlhf_pipeline"],
                             capture_output=True, check=True).stdout
    archive_path = target / "tree.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(target, filter="data")
    return target


def _run_isolated(pythonpath: Path | None, args: argparse.Namespace) -> dict[str, list[float]]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rounds", str(args.rounds),
               "--round-rows", str(args.round_rows), "--samples", str(args.samples), "--seed", str(args.seed)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
    return json.loads(result.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rev", default=None, help="git revision whose rlhf_pipeline is the baseline")
    parser.add_argument("--runs", type=int, default=3, help="runs per version, alternated (default 3)")
    parser.add_argument("--rounds", type=int, default=96, help="publishes per run (default 96: 1.5 segments)")
    parser.add_argument("--round-rows", type=int, default=64, help="rows per publish (default 64)")
    parser.add_argument("--samples", type=int, default=5, help="steady-state reads per publish (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args.rounds, args.round_rows, args.samples, args.seed)))
        return 0

    versions: dict[str, Path | None] = {"this checkout": None}
    if args.baseline_rev:
        versions[f"baseline {args.baseline_rev}"] = _baseline_tree(args.baseline_rev)
    medians: dict[tuple[str, str], list[float]] = {}
    for run in range(args.runs):
        for label, tree in versions.items():  # alternate, so both see the same load
            record = _run_isolated(tree, args)
            for what, values in record.items():
                medians.setdefault((what, label), []).append(statistics.median(values))
            print(f"[bench] run {run + 1}/{args.runs} {label}: "
                  + ", ".join(f"{w} {statistics.median(v):.3f} ms" for w, v in record.items()), file=sys.stderr)
    print(f"{args.rounds} publishes of {args.round_rows} GRPO rows, a reader following; "
          f"median over publishes, then over {args.runs} runs (range over runs)")
    both = len(versions) > 1
    print(f"| what | {' | '.join(versions)} |" + (" this / baseline: median, best |" if both else ""))
    print("|---" * (len(versions) + 1 + both) + "|")
    for what in ("append", "follow", "sample", "full CRC", "read checks"):
        cells, centres, bests = [], [], []
        for label in versions:
            runs = medians.get((what, label))
            if runs is None:
                cells.append("none")
                continue
            centres.append(statistics.median(runs))
            bests.append(min(runs))
            cells.append(f"{centres[-1]:.3f} ms ({min(runs):.3f}-{max(runs):.3f})")
        ratio = ""
        if both:
            ratio = (f" {centres[0] / centres[1]:.2f}x, {bests[0] / bests[1]:.2f}x |" if len(centres) == 2 else " |")
        print(f"| {what} | {' | '.join(cells)} |" + ratio)
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:  # runs under the baseline's package too, which may predate bench/page.py
        sys.exit(main(sys.argv[1:]))
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
