"""``rlhf-pipeline repair PATH [--apply] [--json]``: rebuild a damaged buffer's published state.

A dry run by default: it says what it found and what it would write. ``--apply`` writes
it, under the store's writer lock (stop the writer first). A memmap store's manifest and
state slots are rebuilt from its segment files; a Zarr store's commit record from its
units. Nothing is deleted: the files it replaces are copied to ``repair-<time>/`` inside
the store. It reports what it could not recover (missing segments, chunks that fail their
checksum), naming files and rows. Works on a single store or every shard of a run's buffer.

Only what a publish record covered is published. With an intact record (a memmap state
slot, a Zarr commit record), rows past it were never acknowledged: a live writer's append in
flight (it holds the writer lock, and the note names its process), or what a killed writer left
(a collector writes that round again, and the next writer discards them). Repair leaves them,
and a note counts them; that alone is nothing to repair. Without a record, every
readable row is kept at its row id, and rows between readable ones that no file holds stay
published as lost (reads of them raise), so no append reuses a row id a readable row holds.

Exit code: 0 when nothing needs repair (or ``--apply`` repaired everything), 1 when
something needs repair (dry run) or cannot be recovered, 2 on errors.

Token ids outside the model's vocabulary (``storage/token_ids.py``; a run directory's model's, or
``--vocab-size N``) are intact bytes that no learner can embed. Their groups cannot be taken out of
the middle of a store: its rows are numbered without gaps, and the learner's sampler positions, its
checkpoints' buffer rows and the collectors' positions all count on those numbers. So repair reports
each such group as not recoverable in place and says how the run goes on without them: a branch from
the newest kept checkpoint whose rows hold none of them (``rlhf-pipeline branch``, continued online
with the run's command: its collectors generate the rows after that step again), or, when no kept
checkpoint precedes them, a saved selection without those groups to train on offline (``filter
--selection``, then ``replay --buffer``).

A Zarr store (or a buffer of shards) at an ``s3://`` or ``az://`` URL is repaired the same way,
under the store's leased writer lock: a live writer keeps ``--apply`` out, and the record is
written only over the version repair read (``storage/zarr/repair.py``). Other URL schemes have no
writer lock across machines: repair reports what it found there but writes nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("path", help="the buffer: a memmap directory, a Zarr store, or a directory of shard-NNNN "
                                     "stores; a Zarr store or a prefix of shards may be an s3:// or az:// URL; or a "
                                     "run directory (its buffer/, its token ids checked against its model)")
    parser.add_argument("--vocab-size", type=int, default=None, metavar="N",
                        help="report groups holding token ids outside [0, N) (default: a run's model's vocabulary, "
                             "read from its newest published weights; a bare buffer's ids are not checked)")
    parser.add_argument("--apply", action="store_true", help="write the repair (default: a dry run)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per store")
    parser.add_argument("--quiet", action="store_true", help="no progress")


def run(args: argparse.Namespace) -> int:
    import json
    import sys
    import warnings

    from rlhf_pipeline.cli.progress import progress_reporter
    from rlhf_pipeline.storage.buffers import repair_buffer
    from rlhf_pipeline.storage.errors import StoreError, StoreLockedError

    from rlhf_pipeline.cli.vocabulary import model_vocabulary
    from rlhf_pipeline.runs.lineage import is_run

    if args.vocab_size is not None and args.vocab_size < 1:
        print(f"rlhf-pipeline repair: --vocab-size must be >= 1, got {args.vocab_size}", file=sys.stderr)
        return 2
    path, run_dir = args.path, None
    if "://" not in str(path):  # a run directory, or a run's buffer/: the run says its model's vocabulary
        if is_run(path):
            path, run_dir = str(Path(path) / "buffer"), Path(path)
        elif Path(path).name == "buffer" and is_run(Path(path).parent):
            run_dir = Path(path).parent
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # repair reports the damage itself
        try:
            reports = repair_buffer(path, apply=args.apply,
                                    progress=progress_reporter("repair", "parts", quiet=args.quiet))
            vocab_size, source = model_vocabulary(args.vocab_size, run_dir)
            if vocab_size is not None:
                _report_token_ids(reports, path, vocab_size, source, run_dir,
                                  progress_reporter("token ids", "parts", quiet=args.quiet))
        except StoreLockedError as exc:
            held = f"{args.path} is being written by {exc.holder}" if exc.holder else str(exc).split(";")[0]
            print(f"rlhf-pipeline repair: {held}; repair --apply needs the store's writer lock: stop that writer (or "
                  f"wait until its lease runs out), then run repair again; nothing was written", file=sys.stderr)
            return 2
        except StoreError as exc:
            print(f"rlhf-pipeline repair: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps([r.to_json() for r in reports]))
    else:
        print("\n".join(r.format() for r in reports))
    if any(r.unrecoverable for r in reports):
        return 1
    return 1 if (not args.apply and any(r.needed for r in reports)) else 0


def _report_token_ids(reports, path: str, vocab_size: int, source: str, run_dir, progress) -> None:
    """Adds to each store's report the groups holding token ids outside the vocabulary (not
    recoverable in place: the module docstring says why) and, once, how the run goes on without them."""
    from rlhf_pipeline.storage.buffers import is_sharded_buffer
    from rlhf_pipeline.storage.token_ids import find_bad_groups

    by_location = {report.location: report for report in reports}
    first_bad: dict[str, int] = {}  # shard key -> first global row holding a bad id
    group_ids: list[int] = []
    for _, location, _, groups in find_bad_groups(path, vocab_size, progress):
        report = by_location.get(location)
        if report is None or not groups:
            continue
        report.notes.append(f"token ids checked against a vocabulary of {vocab_size} ({source})")
        report.unrecoverable += [f"{group.describe(vocab_size)}: rows cannot be taken out of the middle of a store"
                                 for group in groups]
        key = Path(location).name if is_sharded_buffer(path) else ""
        first_bad[key] = min(group.rows[0] for group in groups)
        group_ids += [group.group_id for group in groups]
    if not group_ids:
        return
    reports[0].notes.append(_way_on(path, run_dir, first_bad, group_ids))


def _way_on(path: str, run_dir, first_bad: dict[str, int], group_ids: list[int]) -> str:
    """How training goes on without the groups: a branch from the newest kept checkpoint whose rows
    hold none of them, else a selection without them, trained offline."""
    if run_dir is not None:
        from rlhf_pipeline.runs.lineage import run_lineage

        def below(point) -> bool:  # buffer_rows: shard name (a single store's is "") -> its next row then
            rows = point.get("buffer_rows") or {}
            return all(key in rows and int(rows[key]) <= first for key, first in first_bad.items())

        points = [p for p in run_lineage(run_dir)["rewind_points"] if below(p)]
        if points:
            step = points[-1]["step"]
            branch = f"{Path(run_dir).name}-from-{step}"
            return (f"to go on without them: branch the run at step {step}, whose rows hold none of them, and "
                    f"continue the branch online with the run's command under its name (its collectors generate "
                    f"the rows after step {step} again): rlhf-pipeline branch {run_dir} --from-step {step} "
                    f"{branch}, then rlhf-pipeline run PIPELINE.py --home {Path(run_dir).resolve().parent} "
                    f"--run-name {branch}")
    where = f"group_id not in ({', '.join(str(g) for g in group_ids)}{',' if len(group_ids) == 1 else ''})"
    return (f"{'no kept checkpoint of the run precedes them; ' if run_dir is not None else ''}to train on the "
            f"other rows offline: rlhf-pipeline filter {path} DST --selection --where '{where}', then "
            f"rlhf-pipeline replay PIPELINE.py --buffer DST")

