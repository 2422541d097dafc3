"""What ``rlhf-pipeline branch`` costs as the parent's buffer grows: time and bytes.

    python benchmarks/bench_branch.py                              # 10k, 100k and 1M rows, 3 branches each
    python benchmarks/bench_branch.py --rows 10000 1000000 --repeats 5 --json out.json
    python benchmarks/bench_branch.py --shards 4                   # the collector run's buffer in 4 shards

For each size, a recorded buffer of that many synthetic rows (short prompts and responses of the
default pipeline's character vocabulary, an ``advantage`` column) is replayed 4 steps by the default
pipeline's tiny model (a checkpoint every 2 steps, both kept), then branched at step 2 ``--repeats``
times, each into a new run. Timed: the ``branch`` command in this process (imports already paid; a
fresh ``rlhf-pipeline branch`` adds the CLI's start-up, ~1-16 s by the machine's load). Bytes: what
the branch directory holds in all, and what it holds that is not a hard link to the parent's files
(new bytes on disk). Printed: median [min-max] per size, and the load average before and after.

Two kinds of parent per size. A replay: its branch references the recorded buffer by path (nothing
of it is copied); what grows with the rows is what the checkpoint holds about them (the sampler's
state). A run with collectors: the same run directory (settings without ``replay``, the same
checkpoints) over a ``buffer/`` of ``--shards`` shards holding the rows (synthetic rows appended
straight to the shards, as for the replay), the step-2 rewind record naming every row as published
(``buffer_rows``, what a real run's learner writes). Its branch also writes ``parent-rows/``, the
selection of those rows: per shard a range (storage/row_ranges.py). Also timed for it: opening
that selection (the check that the parent still holds those rows), in this process and in a fresh
one that reports how much its resident memory grew while opening (peak; and held after, as
anonymous memory, where ids built per row would be, and file pages mapped, the source segments
the check reads; the process opens the selection once first, so imports and the page cache are
paid before), and
writing the same rows in the per-row form (8 bytes a row; what ``parent-rows/`` was before ranges)
for comparison. Run it with ``PYTHONPATH`` at another checkout to measure that checkout's opening.
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


def make_recorded(path: Path, rows: int, first: int = 0) -> None:
    import torch

    from rlhf_pipeline.models import char_tokenizer
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.schema.synthetic import synthetic_batches
    from rlhf_pipeline.storage import create_store

    store = None
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


def measure(rows: int, repeats: int, work: Path, shards: int) -> dict:
    from rlhf_pipeline.runs.replay import ReplayOptions, replay_command

    recorded = work / f"recorded-{rows}"
    started = time.perf_counter()
    make_recorded(recorded, rows)
    made_s = time.perf_counter() - started
    home = work / f"home-{rows}"
    assert replay_command(DEFAULT, ReplayOptions(buffer=str(recorded), steps=4, seed=3), home=str(home),
                          run_name="parent", overrides=SETTINGS) == 0
    replay = branches(home / "parent", repeats)
    collectors = make_collector_run(home / "parent", home / "collectors", rows, shards)
    online = branches(collectors, repeats)
    online.update(per_row_selection(collectors, repeats))
    checkpoint = sum(p.stat().st_size for p in (home / "parent" / "checkpoints").glob("step_00000002*"))
    print(f"[bench-branch] {rows:,} rows: recorded buffer made in {made_s:.1f} s; branches of the replay "
          f"{', '.join(f'{s:.3f}' for s in replay['branch_s'])} s, of the collector run "
          f"{', '.join(f'{s:.3f}' for s in online['branch_s'])} s", file=sys.stderr, flush=True)
    return {"rows": rows, "shards": shards, "replay": replay, "collectors": online,
            "parent_checkpoint_bytes": checkpoint}


def branches(parent: Path, repeats: int) -> dict:
    """``repeats`` branches of ``parent`` at step 2: seconds, bytes, new bytes (and for a run with
    collectors the bytes of ``parent-rows/`` and the seconds to open it)."""
    from rlhf_pipeline.cli.main import main
    from rlhf_pipeline.storage import open_buffer

    out = {"branch_s": [], "branch_bytes": [], "new_bytes": [], "parent_rows_bytes": [], "open_parent_rows_s": [],
           "open_fresh_s": [], "open_peak_rss": [], "open_anon_rss": [], "open_file_rss": []}
    for k in range(repeats):
        branch = parent.with_name(f"{parent.name}-branch-{k}")
        started = time.perf_counter()
        assert main(["branch", str(parent), "--from-step", "2", str(branch)]) == 0
        out["branch_s"].append(time.perf_counter() - started)
        total, new = branch_bytes(branch)
        out["branch_bytes"].append(total)
        out["new_bytes"].append(new)
        if (branch / "parent-rows").is_dir():
            out["parent_rows_bytes"].append(branch_bytes(branch / "parent-rows")[0])
            started = time.perf_counter()
            with open_buffer(branch / "parent-rows") as rows:
                assert len(rows) > 0
            out["open_parent_rows_s"].append(time.perf_counter() - started)
            opened = open_in_fresh_process(branch / "parent-rows")
            for key in ("open_fresh_s", "open_peak_rss", "open_anon_rss", "open_file_rss"):
                out[key].append(opened[key])
    return out


OPEN_ONCE = '''
import json, sys, time
from rlhf_pipeline.storage import open_buffer

def rss(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))

with open_buffer(sys.argv[1]) as warm:  # imports, the source's files in the page cache
    len(warm)
del warm  # freed before measuring, not when the name is bound again below
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")  # the peak resident size (VmHWM) starts again from now
before = {field: rss(field) for field in ("VmRSS", "RssAnon", "RssFile")}
started = time.perf_counter()
store = open_buffer(sys.argv[1])
seconds = time.perf_counter() - started
print(json.dumps({"open_fresh_s": seconds, "open_peak_rss": rss("VmHWM") - before["VmRSS"],
                  "open_anon_rss": rss("RssAnon") - before["RssAnon"],
                  "open_file_rss": rss("RssFile") - before["RssFile"], "rows": len(store)}))
'''


def open_in_fresh_process(selection: Path) -> dict:
    """Seconds to open ``selection`` and the growth of resident memory while it opens (peak,
    and what the open selection holds), in a new Python process (Linux: /proc/self)."""
    import subprocess

    # run from the selection's directory: ``-c`` puts the working directory first on sys.path, and a
    # checkout there would be imported instead of the one PYTHONPATH names. A fixed mmap threshold:
    # glibc otherwise serves the measured opening's large arrays from heap pages the first one
    # left resident, and what the opening holds would not show as growth
    ran = subprocess.run([sys.executable, "-c", OPEN_ONCE, str(selection)], capture_output=True, text=True,
                         check=True, cwd=selection, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                         "MALLOC_MMAP_THRESHOLD_": "131072"})
    return json.loads(ran.stdout.strip().splitlines()[-1])


def make_collector_run(replay: Path, target: Path, rows: int, shards: int) -> Path:
    """The replay's run directory as a run with collectors: settings without ``replay``, a
    ``buffer/`` of ``shards`` shards holding ``rows`` rows, the step-2 record naming them published."""
    import shutil

    from rlhf_pipeline.storage.buffers import shard_name, shard_path

    shutil.copytree(replay, target)
    settings = json.loads((target / "settings.json").read_text())
    settings.pop("replay", None)
    (target / "settings.json").write_text(json.dumps(settings, indent=2, sort_keys=True))
    published = {}
    for k in range(shards):
        count = rows // shards + (k < rows % shards)
        make_recorded(shard_path(target / "buffer", k), count, first=k << 40)
        published[shard_name(k)] = count
    record_path = target / "checkpoints" / "step_00000002.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    record["buffer_rows"] = published
    record_path.write_text(json.dumps(record))
    return target


def per_row_selection(run: Path, repeats: int) -> dict:
    """Seconds and bytes to write the same rows as ``parent-rows/`` in the per-row form."""
    import shutil

    import numpy as np

    from rlhf_pipeline.storage import open_buffer
    from rlhf_pipeline.storage.row_keys import parts_of
    from rlhf_pipeline.storage.selection import write_selection

    out = {"per_row_s": [], "per_row_bytes": []}
    for k in range(repeats):
        target = run.with_name(f"{run.name}-per-row-{k}")
        started = time.perf_counter()
        with open_buffer(run / "buffer", mode="r") as source:
            parts = parts_of(source)
            ids = [np.arange(p.first_row, p.next_row, dtype=np.int64) for p in parts]
            index = [np.full(a.size, p.index, dtype=np.int64) for p, a in zip(parts, ids)]
            write_selection(target, source, np.concatenate(index), np.concatenate(ids), source_location=str(run))
        out["per_row_s"].append(time.perf_counter() - started)
        out["per_row_bytes"].append(branch_bytes(target)[0])
        shutil.rmtree(target)
    return out


def spread(values: list[float], fmt: str) -> str:
    median = statistics.median(values)
    median = int(median) if all(isinstance(v, int) for v in values) and median == int(median) else median
    return f"{format(median, fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shards", type=int, default=1, help="shards of the collector run's buffer")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-branch-") as work:
        results = [measure(rows, args.repeats, Path(work), args.shards) for rows in args.rows]
    load_after = os.getloadavg()
    print(f"\nbranch at step 2 of a 4-step run; median [min-max] of {args.repeats}; load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after; collector run's buffer in {args.shards} "
          f"shard(s)\n")
    print("| rows | parent | branch, s | branch directory, bytes | of which new (not hard links) | "
          "parent-rows/, bytes | open parent-rows/, s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        for kind, label in (("replay", "replay"), ("collectors", "run with collectors")):
            m = r[kind]
            rows_bytes = spread(m["parent_rows_bytes"], ",") if m["parent_rows_bytes"] else "-"
            opening = spread(m["open_parent_rows_s"], ".3f") if m["open_parent_rows_s"] else "-"
            print(f"| {r['rows']:,} | {label} | {spread(m['branch_s'], '.3f')} | {spread(m['branch_bytes'], ',')} | "
                  f"{spread(m['new_bytes'], ',')} | {rows_bytes} | {opening} |")
    print("\nthe same rows as a per-row selection (the form parent-rows/ had before ranges); the parent's "
          "step-2 checkpoint\n")
    print("| rows | per-row selection, s | per-row selection, bytes | parent's checkpoint, bytes |")
    print("|---|---|---|---|")
    for r in results:
        m = r["collectors"]
        print(f"| {r['rows']:,} | {spread(m['per_row_s'], '.3f')} | {spread(m['per_row_bytes'], ',')} | "
              f"{r['parent_checkpoint_bytes']:,} |")
    import rlhf_pipeline

    print(f"\nopening parent-rows/ in a fresh process ({Path(rlhf_pipeline.__file__).parent}): seconds, and the "
          f"growth of its resident memory while opening: peak, and held after as anonymous memory and as "
          f"mapped file pages\n")
    print("| rows | open, ms | RSS peak, MiB | held: anonymous, MiB | held: file pages, MiB |")
    print("|---|---|---|---|---|")
    for r in results:
        m = r["collectors"]
        mib = {key: [v / 2**20 for v in m[key]] for key in ("open_peak_rss", "open_anon_rss", "open_file_rss")}
        print(f"| {r['rows']:,} | {spread([s * 1000 for s in m['open_fresh_s']], '.1f')} | "
              f"{spread(mib['open_peak_rss'], '.2f')} | {spread(mib['open_anon_rss'], '.2f')} | "
              f"{spread(mib['open_file_rss'], '.2f')} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"load": [load_before, load_after], "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
