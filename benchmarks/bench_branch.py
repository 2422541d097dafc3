"""What ``rlhf-pipeline branch`` costs as the parent's buffer grows: time and bytes.

    python benchmarks/bench_branch.py                              # 10k, 100k and 1M rows, 3 branches each
    python benchmarks/bench_branch.py --rows 10000 1000000 --repeats 5 --json out.json

For each size, a recorded buffer of that many synthetic rows (short prompts and responses of the
default pipeline's character vocabulary, an ``advantage`` column) is replayed 4 steps by the default
pipeline's tiny model (a checkpoint every 2 steps, both kept), then branched at step 2 ``--repeats``
times, each into a new run. Timed: the ``branch`` command in this process (imports already paid; a
fresh ``rlhf-pipeline branch`` adds the CLI's start-up, ~1-16 s by the machine's load). Bytes: what
the branch directory holds in all, and what it holds that is not a hard link to the parent's files
(new bytes on disk). Printed: median [min-max] per size, and the load average before and after.

A branch of a replay references its recorded buffer by path (nothing of it is copied); what grows
with the rows is what the checkpoint holds about them (the sampler's state). A branch of a run with
collectors also writes ``parent-rows/``, a selection naming each row it may read, which does grow
with the rows; this benchmark measures the replay case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT = str(REPO / "pipelines" / "default.py")
SETTINGS = ["warm_start_steps=0", "hidden_size=32", "num_layers=1", "num_heads=2", "learner.batch_size=16",
            "learner.checkpoint_every=2", "learner.keep_checkpoints=2", "learner.log_every=100"]


def make_recorded(path: Path, rows: int) -> None:
    import torch

    from rlhf_pipeline.models import char_tokenizer
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.schema.synthetic import synthetic_batches
    from rlhf_pipeline.storage import create_store

    store = None
    first = 0
    for batch in synthetic_batches(rows, group_size=4, prompt_len=(3, 8), response_len=(1, 6), batch_size=50_000,
                                   seed=0, optional_fields=("advantage",), vocab_size=len(char_tokenizer())):
        ids = torch.arange(first, first + len(batch))
        batch = batch.with_columns(trajectory_id=ids, group_id=ids // 4)
        if store is None:
            store = create_store(path, "memmap", schema=StoreSchema.for_batch(batch), segment_rows=65_536)
        store.append(batch)
        first += len(batch)
    store.close()


def branch_bytes(branch: Path) -> tuple[int, int]:
    """(all bytes in the branch's files, bytes of those that are not hard links to another file)."""
    total = new = 0
    for path in branch.rglob("*"):
        if path.is_file() and not path.is_symlink():
            stat = path.stat()
            total += stat.st_size
            new += stat.st_size if stat.st_nlink == 1 else 0
    return total, new


def measure(rows: int, repeats: int, work: Path) -> dict:
    from rlhf_pipeline.cli.main import main
    from rlhf_pipeline.runs.replay import ReplayOptions, replay_command

    recorded = work / f"recorded-{rows}"
    started = time.perf_counter()
    make_recorded(recorded, rows)
    made_s = time.perf_counter() - started
    home = work / f"home-{rows}"
    assert replay_command(DEFAULT, ReplayOptions(buffer=str(recorded), steps=4, seed=3), home=str(home),
                          run_name="parent", overrides=SETTINGS) == 0
    seconds, totals, news = [], [], []
    for k in range(repeats):
        started = time.perf_counter()
        assert main(["branch", str(home / "parent"), "--from-step", "2", f"branch-{k}"]) == 0
        seconds.append(time.perf_counter() - started)
        total, new = branch_bytes(home / f"branch-{k}")
        totals.append(total)
        news.append(new)
    checkpoint = sum(p.stat().st_size for p in (home / "parent" / "checkpoints").glob("step_00000002*"))
    print(f"[bench-branch] {rows:,} rows: recorded buffer made in {made_s:.1f} s; branches "
          f"{', '.join(f'{s:.2f}' for s in seconds)} s", file=sys.stderr, flush=True)
    return {"rows": rows, "branch_s": seconds, "branch_bytes": totals, "new_bytes": news,
            "parent_checkpoint_bytes": checkpoint}


def spread(values: list[float], fmt: str) -> str:
    median = statistics.median(values)
    median = int(median) if all(isinstance(v, int) for v in values) and median == int(median) else median
    return f"{format(median, fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-branch-") as work:
        results = [measure(rows, args.repeats, Path(work)) for rows in args.rows]
    load_after = os.getloadavg()
    print(f"\nbranch at step 2 of a 4-step replay; median [min-max] of {args.repeats}; load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after\n")
    print("| rows | branch, s | branch directory, bytes | of which new (not hard links) | parent's checkpoint, bytes |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']:,} | {spread(r['branch_s'], '.3f')} | {spread(r['branch_bytes'], ',')} | "
              f"{spread(r['new_bytes'], ',')} | {r['parent_checkpoint_bytes']:,} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"load": [load_before, load_after], "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
