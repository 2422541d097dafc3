"""``rlhf-pipeline replay PIPELINE.py --buffer PATH``: train a new run from a recorded buffer.

No collector and no generation: the learner walks the buffer in epochs (``--order``),
from ``--init-from`` (a run directory or a ``save_pretrained`` directory) or the
pipeline's initial policy, optionally re-scoring advantages and reference log-probs on
the way (``docs/replay.md`` has the whole story). Running the same command
again resumes. Arguments are parsed before torch is imported.
"""

from __future__ import annotations

import argparse

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.cli.checks import run_or_path

ORDERS = ("shuffle", "sequential", "with-replacement")


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("pipeline", metavar="PIPELINE.py", help="path of the pipeline file (model, loss, learner)")
    parser.add_argument("--buffer", metavar="PATH",
                        help="(required) the recorded buffer: a memmap or Zarr store (directory, .zip, file:// "
                             "URL), a run's buffer/ of shards, or a run (its directory, URL or name): its buffer; "
                             "opened read-only, never modified")
    parser.add_argument("--init-from", default=None, metavar="RUN_DIR_OR_MODEL_DIR",
                        help="starting weights: a run directory, its name or its s3:// / az:// URL (its newest "
                             "weights) or a save_pretrained directory (default: the pipeline's initial policy, warm start "
                             "included)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, default=None, metavar="E",
                        help="passes over every row (default 1); the last batch of an epoch is partial")
    length.add_argument("--steps", type=int, default=None, metavar="N", help="learner steps instead of epochs")
    parser.add_argument("--order", choices=ORDERS, default="shuffle",
                        help="shuffle: reshuffled each epoch, storage unit window by window (default); "
                             "sequential: store order; with-replacement: uniform draws")
    parser.add_argument("--shuffle-window", type=int, default=None, metavar="ROWS", dest="shuffle_window_rows",
                        help="--order shuffle: shuffle within windows of whole storage units of at least ROWS "
                             "rows (default: learner.shuffle_window_rows; 0: the whole buffer). Keep a window "
                             "within a Zarr store's cache")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the row order and the learner (default: the pipeline's seed)")
    rescoring = parser.add_argument_group("re-scoring while replaying (the source is not touched)")
    rescoring.add_argument("--ref-model", default=None, metavar="MODEL_DIR|RUN_DIR",
                           help="recompute reference log-probs and KL with this model (a run: by its directory or "
                                "its name)")
    # None when not given: alone, without --ref-model, they would be silently ignored
    rescoring.add_argument("--kl-estimator", choices=("k1", "k2", "k3"), default=None,
                           help="with --ref-model: per-token KL of the recomputed 'kl' field (default k1)")
    rescoring.add_argument("--kl-coef", type=float, default=None,
                           help="with --ref-model: coefficient of the recomputed KL-shaped token rewards (default "
                                "0.05)")
    rescoring.add_argument("--advantage-std", choices=("on", "off"), default=None,
                           help="recompute advantages from the stored rewards, dividing by the group std (on, "
                                "GRPO) or not (off, Dr. GRPO)")
    rescoring.add_argument("--advantage-baseline", choices=("mean", "leave-one-out"), default=None,
                           help="recompute advantages from the stored rewards against the group mean or the "
                                "mean of the other completions (leave-one-out, RLOO)")
    parser.add_argument("--home", default=None,
                        help="directory holding run directories, or an s3:// or az:// URL (the whole replay run "
                             "there; default: storage/ in the repo, or $RLHF_PIPELINE_HOME)")
    parser.add_argument("--run-name", default=None,
                        help="the new run's directory name under --home (default: <pipeline>-replay)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="device for the models (sets the pipeline's `device`)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a pipeline setting, e.g. --set learner.loss.clip_eps_high=0.28 (repeatable)")
    parser.add_argument("--list-settings", action="store_true",
                        help="print the pipeline's settings with their documentation and exit")
    # given by a replay of several ranks to each of them (rlhf_pipeline/runs/launch.py, start_ranks)
    parser.add_argument("--stop-fd", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from rlhf_pipeline.pipeline import PipelineError
    from rlhf_pipeline.runs.replay import ReplayError, ReplayOptions, replay_command
    from rlhf_pipeline.runs.replay_options import REFERENCE_ONLY
    from rlhf_pipeline.files.run_paths import RunLocationError
    from rlhf_pipeline.files.run_store import RunStoreError, StaleWriterError
    from rlhf_pipeline.files.state_files import StateFileError
    from rlhf_pipeline.runs.run_directory import RunError

    if args.buffer is None and not args.list_settings:
        raise CommandRefused("--buffer PATH is required (the recorded buffer to train on)")
    given_alone = [] if args.ref_model is not None else \
        ["--" + name.replace("_", "-") for name in REFERENCE_ONLY if getattr(args, name) is not None]
    if given_alone:
        shape, them = ("shape", "them") if len(given_alone) > 1 else ("shapes", "it")
        raise CommandRefused(f"{' and '.join(given_alone)} {shape} the KL recomputed with a reference model: give "
                             f"--ref-model MODEL_DIR|RUN_DIR too, or drop {them}")
    # a run named by its name, under this replay's --home
    init_from, ref_model = (None if value is None else run_or_path(value, args.home, what=flag)
                            for value, flag in ((args.init_from, "--init-from"), (args.ref_model, "--ref-model")))
    # a run by its name, too
    buffer = None if args.buffer is None else run_or_path(args.buffer, args.home, what="--buffer")
    options = ReplayOptions(
        buffer=buffer or "", init_from=init_from, epochs=args.epochs, steps=args.steps, order=args.order,
        seed=args.seed, shuffle_window_rows=args.shuffle_window_rows, ref_model=ref_model,
        # not given: ReplayOptions' defaults, which a resumed replay compares with its record
        **{name: getattr(args, name) for name in REFERENCE_ONLY if getattr(args, name) is not None},
        advantage_std=None if args.advantage_std is None else args.advantage_std == "on",
        advantage_baseline=args.advantage_baseline,
    )
    try:
        return replay_command(args.pipeline, options, home=args.home, run_name=args.run_name, device=args.device,
                              overrides=args.overrides, list_settings=args.list_settings,
                              stop_fd=args.stop_fd)
    # a run at a URL: an object store that refuses (credentials, no bucket, retries spent) or a
    # start elsewhere that took the run over is one line, as for `run`
    except (PipelineError, ReplayError, RunError, RunLocationError, RunStoreError,
            StaleWriterError, StateFileError) as exc:
        raise CommandRefused(str(exc)) from None
