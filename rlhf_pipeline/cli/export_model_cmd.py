"""``rlhf-pipeline export-model RUN_DIR OUT [--version N | --best] [--adapter]``: a run's policy for
``transformers``.

Writes a ``save_pretrained`` directory (config, safetensors weights, tokenizer with its chat
template, generation config) that ``AutoModelForCausalLM.from_pretrained(OUT)`` loads with
the same logits as the run's policy of that version. See :mod:`rlhf_pipeline.dataio.model_export`.
``--list-versions`` needs no OUT and imports no torch. A LoRA run's version is merged into its base;
``--adapter`` writes the adapter alone, a PEFT directory. Design: docs/datasets.md#export-model.
"""

from __future__ import annotations

import argparse

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.cli.checks import add_run_argument, writable_output


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    add_run_argument(parser, "run_dir",
                        help="the run directory (holds settings.json, weights/, checkpoints/), a run's name, or a run at "
                             "an s3:// or az:// URL (only the version exported is read)")
    parser.add_argument("out", nargs="?", metavar="OUT",
                        help="directory to write (must not exist); not needed with --list-versions")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--version", type=int, default=None,
                       help="policy version to export (default: the newest on disk)")
    which.add_argument("--best", action="store_true",
                       help="the policy of the run's best checkpoint by learner.keep_best (inspect RUN shows it)")
    parser.add_argument("--pipeline", metavar="PIPELINE.py", default=None,
                        help="pipeline file to rebuild the model with (default: the run's copy, pipeline.py)")
    parser.add_argument("--list-versions", action="store_true", help="list the versions on disk and exit")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run: write the version's adapter alone (adapter_model.safetensors, "
                             "adapter_config.json) instead of the merged model")


def run(args: argparse.Namespace) -> int:
    from rlhf_pipeline.dataio.model_export import (
        RunNotFoundError,
        VersionNotFoundError,
        available_versions,
        export_adapter,
        export_model,
    )
    from rlhf_pipeline.pipeline import PipelineError
    from rlhf_pipeline.files.run_paths import RunLocationError, RunPaths
    from rlhf_pipeline.learn.checkpoint import run_best
    from rlhf_pipeline.learn.keep_best import NoBestCheckpoint
    from rlhf_pipeline.files.run_store import RunStoreError
    from rlhf_pipeline.files.state_files import StateFileError

    if args.out is None and not args.list_versions:
        raise CommandRefused("OUT is required (unless --list-versions): the directory to write the model to")
    if not args.list_versions:
        writable_output(args.out, "OUT")
    try:
        if args.list_versions:
            versions = available_versions(args.run_dir)
            print("\n".join(v.describe() for v in versions.values()) or "no versions on disk")
            return 0
        best = run_best(RunPaths.at(args.run_dir), "--version N (--list-versions lists them)") if args.best else None
        version = best.policy_version if best is not None else args.version
        if args.adapter:
            result = export_adapter(args.run_dir, args.out, version=version)
        else:
            result = export_model(args.run_dir, args.out, version=version, pipeline_path=args.pipeline)
    except (VersionNotFoundError, RunNotFoundError, PipelineError, FileExistsError, StateFileError,
            RunLocationError, RunStoreError, NoBestCheckpoint) as exc:
        raise CommandRefused(str(exc)) from None
    chosen = f"; the best checkpoint, {best.describe()}" if best is not None else ""
    print(f"{result.out}: {result.model_class}, policy version {result.version} (from {result.source}{chosen})")
    return 0
