"""``rlhf-pipeline run | collect | learn PIPELINE.py``: one command module, three entry points.

* ``run`` checks the pipeline, prepares the run directory, then starts one collector and
  one learner process that share the buffer through it; it stops the collector when the
  learner has taken ``--steps`` steps.
* ``collect`` / ``learn`` run one side alone against the same run directory (e.g. a
  learner resumed over a recorded buffer, or collectors on another machine).

Running the same command again resumes the run: the learner continues from its newest
checkpoint and the collector appends to the same buffer. Arguments are parsed before
torch is imported, so ``--help`` and argument errors are instant.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("pipeline", metavar="PIPELINE.py", help="path of the pipeline file")
    if name == "collect":
        steps_help = "collection rounds before stopping (default: until the learner is done or Ctrl-C)"
    else:
        steps_help = "learner steps to reach (sets the pipeline's `steps`); a resumed run continues to it"
    parser.add_argument("--steps", type=int, default=None, help=steps_help)
    parser.add_argument("--home", default=None,
                        help="directory holding run directories (default: storage/ in the repo, "
                             "or $RLHF_PIPELINE_HOME)")
    parser.add_argument("--run-name", default=None,
                        help="run directory name under --home (default: the pipeline file's name)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="device for the models (sets the pipeline's `device`)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a pipeline setting, e.g. --set learner.lr=1e-4 (repeatable)")
    parser.add_argument("--list-settings", action="store_true",
                        help="print the pipeline's settings with their documentation and exit")


def run(args: argparse.Namespace) -> int:
    from rlhf_pipeline.pipeline import PipelineError
    from rlhf_pipeline.run import RunError, run_command

    try:
        return run_command(
            args.command,
            pipeline_path=args.pipeline,
            steps=args.steps,
            home=args.home,
            run_name=args.run_name,
            device=args.device,
            overrides=args.overrides,
            list_settings=args.list_settings,
        )
    except (PipelineError, RunError) as exc:
        print(f"rlhf-pipeline {args.command}: error: {exc}", file=sys.stderr)
        return 2
