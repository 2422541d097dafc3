"""``rlhf-pipeline repair PATH [--apply] [--json]``: rebuild a damaged buffer's published state.

A dry run unless ``--apply``, which writes under the store's writer lock (leased at a URL) and
copies what it replaces to ``repair-<time>/``. Only what a publish record covered is published;
token ids outside the vocabulary are reported with how the run goes on without them. Exit code 0
nothing to repair, 1 damage found or unrecoverable, 2 errors. User's guide: docs/buffer-tools.md;
design: docs/architecture.md#the-command-line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.cli.checks import add_run_argument


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    add_run_argument(parser, "path",
                        help="the buffer: a memmap directory, a Zarr store, or a directory of shard-NNNN stores; a Zarr "
                             "store or a prefix of shards may be an s3:// or az:// URL; or a run directory or a run's "
                             "name (its buffer/, its token ids checked against its model)")
    parser.add_argument("--vocab-size", type=int, default=None, metavar="N",
                        help="report groups holding token ids outside [0, N) (default: a run's model's vocabulary, "
                             "read from its newest published weights; a bare buffer's ids are not checked)")
    parser.add_argument("--apply", action="store_true", help="write the repair (default: a dry run)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per store")
    parser.add_argument("--quiet", action="store_true", help="no progress")


def run(args: argparse.Namespace) -> int:
    import json
    import warnings

    from rlhf_pipeline.dataio.progress import progress_reporter
    from rlhf_pipeline.storage.buffers import repair_buffer
    from rlhf_pipeline.storage.errors import StoreError, StoreLockedError

    from rlhf_pipeline.cli.vocabulary import check_vocab_size, model_vocabulary
    from rlhf_pipeline.runs.lineage import KeepsNoBuffer, buffer_of_run, is_run

    check_vocab_size(args.vocab_size)
    path, run_dir = args.path, None
    if "://" not in str(path):  # a run directory, or a run's buffer/: the run says its model's vocabulary
        if is_run(path):
            try:  # its buffer_url, else RUN/buffer
                path, run_dir = buffer_of_run(path) or str(Path(path) / "buffer"), Path(path)
            except KeepsNoBuffer as exc:
                raise CommandRefused(str(exc)) from None
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
            raise CommandRefused(f"{held}; repair --apply needs the store's writer lock: stop that writer (or "
                                 f"wait until its lease runs out), then run repair again; nothing was "
                                 f"written") from None
        except StoreError as exc:
            raise CommandRefused(str(exc)) from None
    if args.json:
        print(json.dumps([r.to_json() for r in reports]))
    else:
        print("\n".join(r.format() for r in reports))
    if any(r.unrecoverable for r in reports):
        return 1
    return 1 if (not args.apply and any(r.needed for r in reports)) else 0


def _report_token_ids(reports, path: str, vocab_size: int, source: str, run_dir, progress) -> None:
    """Adds to each store's report the groups holding token ids outside the vocabulary (not
    recoverable in place: a store's rows are numbered without gaps, and the sampler's positions, the
    checkpoints and the collectors count on those numbers) and, once, how the run goes on without them
    (docs/buffer-tools.md#repair)."""
    from rlhf_pipeline.storage.buffers import is_sharded_buffer
    from rlhf_pipeline.storage.errors import StoreError
    from rlhf_pipeline.storage.token_ids import find_bad_groups

    by_location = {report.location: report for report in reports}
    first_bad: dict[str, int] = {}  # shard key -> first global row holding a bad id
    group_ids: list[int] = []
    try:
        found = find_bad_groups(path, vocab_size, progress)
    except StoreError as exc:  # damage reported above that keeps rows from being read, as inspect --verify says
        # said of the store the error names: every shard's report quoted one shard's damage
        named = [report for report in reports if report.location in str(exc)] or reports
        for report in named:
            report.notes.append("token ids not checked: its rows cannot be read while the damage above stays")
        return
    for _, location, _, groups in found:
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

