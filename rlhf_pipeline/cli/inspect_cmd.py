"""``rlhf-pipeline inspect PATH [--json] [--verify]``: what a replay buffer or a run holds.

Reads metadata with numpy, json and zarr only (no torch, no lock): rows, groups, tokens, rewards,
sizes, versions; a run's rewind points, lineage and retention first. ``--verify`` checks every byte
and exits 1 on damage. User's guide: docs/buffer-tools.md; design: docs/architecture.md#the-command-line.
"""

from __future__ import annotations

import argparse

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.cli.checks import add_run_argument


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    add_run_argument(parser, "path",
                        help="the buffer: a memmap directory, a Zarr store, or a directory of shard-NNNN stores; or a "
                             "run directory or a run's name (its rewind points, parent and branches, then its buffer)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (a list with --verify)")
    parser.add_argument("--verify", action="store_true",
                        help="check every segment file or chunk against its checksum; exit code 1 on damage")
    parser.add_argument("--quiet", action="store_true", help="no progress bar with --verify")
    parser.add_argument("--vocab-size", type=int, default=None, metavar="N",
                        help="with --verify: report token ids outside [0, N) (default: a run directory's model's "
                             "vocabulary, read from its newest published weights; a bare buffer's are not checked)")


def run(args: argparse.Namespace) -> int:
    import json
    import sys
    import warnings

    from rlhf_pipeline.dataio.progress import progress_reporter
    from rlhf_pipeline.cli.vocabulary import check_vocab_size, model_vocabulary
    from rlhf_pipeline.storage.buffers import buffer_stats, verify_buffer
    from rlhf_pipeline.storage.errors import StoreError

    from rlhf_pipeline.files.run_paths import RUN_URL_SCHEMES
    from rlhf_pipeline.runs.lineage import (KeepsNoBuffer, buffer_of_run, format_lineage, is_run, run_lineage,
                                            run_store_at)
    from rlhf_pipeline.runs.run_directory import HOLDER_FILE

    check_vocab_size(args.vocab_size)
    if args.vocab_size is not None and not args.verify:
        raise CommandRefused(f"--vocab-size {args.vocab_size}: token ids are checked against it with --verify; "
                             f"give that too")
    lineage, path = None, args.path
    if "://" not in str(path) or str(path).startswith(RUN_URL_SCHEMES):  # a run (or a buffer) here or at a URL
        try:
            if is_run(path):
                lineage = run_lineage(path)
                best = best_checkpoint(lineage["run"])
                if best is not None:
                    lineage["best"] = best
                try:  # its buffer_url, else RUN/buffer
                    run_buffer = buffer_of_run(lineage["run"]) or f"{lineage['run']}/buffer"
                except KeepsNoBuffer:
                    run_buffer = None
                own = run_buffer == f"{lineage['run']}/buffer"
                # no buffer of its own: a replay, a branch not continued online
                if (run_buffer is None or own and not run_store_at(path).list("buffer")) and not args.verify:
                    print(json.dumps({"run": lineage}) if args.json else format_lineage(lineage) + format_best(best))
                    return 0
                path = run_buffer or f"{lineage['run']}/buffer"
            elif run_store_at(path).exists(HOLDER_FILE):
                raise CommandRefused(f"{path} holds a run whose first start has not written its settings.json (only its "
                                     f"{HOLDER_FILE} is there): one is preparing it, or one stopped first; nothing was "
                                     f"trained, so if none is running, run its command again, or delete {path}")
        except (ValueError, OSError) as exc:
            raise CommandRefused(str(exc)) from None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if args.verify:
                reports = verify_buffer(path, progress=progress_reporter("verify", "parts", quiet=args.quiet))
                vocabulary = model_vocabulary(args.vocab_size, args.path if lineage is not None else None)
                _check_token_ids(reports, path, vocabulary, progress_reporter("token ids", "parts", quiet=args.quiet))
            else:
                stats = buffer_stats(path)
        except StoreError as exc:
            raise CommandRefused(str(exc)) from None
    for warning in caught:
        print(f"rlhf-pipeline inspect: warning: {warning.message}", file=sys.stderr)
    if args.verify:
        if args.json:
            print(json.dumps([r.to_json() for r in reports]))
        else:
            print("\n".join(r.format() for r in reports))
        return 0 if all(r.ok for r in reports) else 1
    if lineage is None:
        print(json.dumps(stats.to_json()) if args.json else format_stats(stats))
        return 0
    from rlhf_pipeline.runs.retention import format_retention, run_retention

    retention = run_retention(lineage["run"])
    if args.json:
        print(json.dumps({"run": {**lineage, "retention": retention}, "buffer": stats.to_json()}))
    else:
        kept = format_retention(retention, stats)
        print(format_lineage(lineage) + format_best(lineage.get("best")) + ("\n" + kept if kept else "")
              + "\n\nbuffer\n" + format_stats(stats))
    return 0


def best_checkpoint(run: str) -> dict | None:
    """``learner.keep_best``'s best checkpoint of ``run`` as JSON (``{"metric", "step": None}`` before
    any kept checkpoint has a score); None for a run that keeps no best."""
    from rlhf_pipeline.files.run_paths import RunPaths
    from rlhf_pipeline.learn.checkpoint import kept_best

    keep_best, best = kept_best(RunPaths.at(run))
    if keep_best is None:
        return None
    return best.to_json() if best is not None else {"metric": keep_best.metric, "step": None}


def format_best(best: dict | None) -> str:
    """The line ``inspect`` prints under a run's rewind points for its best checkpoint."""
    if best is None:
        return ""
    if best["step"] is None:
        return f"\nbest checkpoint  none yet (no kept checkpoint's version has a score of {best['metric']})"
    return (f"\nbest checkpoint  step {best['step']} (policy version {best['policy_version']}): "
            f"{best['metric']} {best['value']:.4g}")


def _check_token_ids(reports, path, vocabulary: tuple[int | None, str], progress) -> None:
    """Adds to each store's report the groups holding token ids outside the vocabulary."""
    vocab_size, source = vocabulary
    if vocab_size is None:
        for report in reports:
            report.notes.append(f"token ids not checked: {source}")
        return
    from rlhf_pipeline.storage.errors import StoreError
    from rlhf_pipeline.storage.token_ids import check_token_ids  # reads rows through the store: torch

    try:
        found = {r.location: r for r in check_token_ids(str(path), vocab_size, progress)}
    except StoreError as exc:  # damage the checksums report above keeps the store from opening
        for report in reports:
            report.notes.append(f"token ids not checked: {exc}")
        return
    for report in reports:
        checked = found.get(report.location)
        if checked is None:
            continue
        report.checked.update(checked.checked)
        report.problems.extend(checked.problems)
        report.notes.append(f"token ids checked against a vocabulary of {vocab_size} ({source})")


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} TiB"


def describe_ratio(ratio: float, stored_as: str = "the files") -> str:
    """Bytes on disk per raw byte, said as what it means for this value (``stored_as``: what holds the
    bytes, the files of a directory or the objects at a URL)."""
    if ratio != ratio:  # NaN: an empty store has no raw payload
        return "-"
    if round(ratio, 3) == 1:
        return f"{ratio:.3f}  ({stored_as} take what the raw payload does)"
    if ratio >= 2:  # small stores: metadata and allocation blocks outweigh the rows
        return f"{ratio:.3f}  ({stored_as} take {ratio:.1f} times the raw payload)"
    if ratio > 1:
        return f"{ratio:.3f}  ({stored_as} take {ratio - 1:.0%} more than the raw payload)"
    return f"{ratio:.3f}  ({stored_as} take {1 - ratio:.0%} less than the raw payload: compressed)"


def format_stats(stats) -> str:
    """A two-column table of a ``StoreStats`` (what ``inspect`` prints without ``--json``)."""
    from rlhf_pipeline.storage.summary import describe_trajectories, describe_versions

    ratio = stats.disk_bytes_per_raw_byte
    at_a_url = "://" in str(stats.location)
    counted = "the objects' sizes" if at_a_url else "as du counts the store's files and directories"
    rows = [
        ("location", stats.location),
        ("backend", stats.backend),
        ("rows held", f"{stats.rows}  (global ids {stats.first_row}..{stats.next_row - 1})"
         if stats.rows else "0"),
        ("rows ever written", str(stats.next_row)),
        ("groups", str(stats.groups)),
        ("trajectories", describe_trajectories(stats.trajectories)),
        ("prompt tokens", str(stats.prompt_tokens)),
        ("response tokens", str(stats.response_tokens)),
        ("reward mean / std", f"{_number(stats.reward_mean)} / {_number(stats.reward_std)}"),
        ("reward min / max", f"{_number(stats.reward_min)} / {_number(stats.reward_max)}"),
        ("policy versions", describe_versions(stats.policy_versions)),
        ("segments", str(stats.segments)),
        ("bytes on disk", f"{_bytes(stats.bytes_on_disk)}  ({counted})"),
        ("raw payload", f"{_bytes(stats.raw_bytes)}  (token values, row fields, UTF-8 text)"),
        ("disk/raw", describe_ratio(ratio, "the objects" if at_a_url else "the files")),
        ("optional fields", ", ".join(stats.optional_fields) or "-"),
    ]
    rows += [(key.replace("_", " "), str(value)) for key, value in sorted(stats.extra.items())]
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)
