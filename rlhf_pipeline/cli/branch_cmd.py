"""``rlhf-pipeline branch RUN --from-step N|best NEW_RUN [--set KEY=VALUE ...]``: a new run from RUN's step N.

The new run starts from RUN's checkpoint of step N (model, optimizer, RNG, sampler position)
with the settings ``--set`` changes (``learner.*``, ``steps``, ``device``); RUN is only read.
``--from-step best`` starts from RUN's best checkpoint by ``learner.keep_best``, as from its step.
``docs/branching.md`` has the whole story; ``inspect RUN`` lists the steps a run can
be branched from and its branches. Arguments are parsed before torch is imported.
"""

from __future__ import annotations

import argparse

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.cli.checks import refuse_empty, run_or_path, step_or_best, writable_output


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("run", metavar="RUN", help="the parent: a run directory, or a run's name under --home")
    parser.add_argument("--from-step", type=step_or_best, required=True, metavar="N",
                        help="the step whose checkpoint the branch starts from (inspect RUN lists them), or best: "
                             "the run's best checkpoint by learner.keep_best")
    parser.add_argument("new_run", metavar="NEW_RUN",
                        help="the branch: a name (made beside RUN, where inspect RUN finds it) or a new directory")
    parser.add_argument("--home", default=None,
                        help="directory holding run directories, for a RUN given by name (default: storage/ in "
                             "the repo, or $RLHF_PIPELINE_HOME)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="change a setting at the branch point, e.g. --set learner.lr=1e-4 (repeatable; "
                             "what a resume may change: learner.*, max_lag, steps, device, eval.*, ray.*, "
                             "generation.url)")


def run(args: argparse.Namespace) -> int:
    from rlhf_pipeline.files.run_paths import RunLocationError
    from rlhf_pipeline.files.run_store import RunStoreError
    from rlhf_pipeline.files.state_files import StateFileError
    from rlhf_pipeline.runs.branch import BranchError, branch_run, main_message
    from rlhf_pipeline.runs.lineage import resolved_location

    try:
        parent = run_or_path(args.run, args.home).rstrip("/")
        # a name ("NAME/" too, as RUN takes one): beside its parent, in the same home (where `inspect RUN` finds it)
        refuse_empty(args.new_run, "NEW_RUN")  # "" was the parent's home itself
        name = args.new_run.rstrip("/")
        new = args.new_run if "/" in name else f"{resolved_location(parent).rstrip('/').rpartition('/')[0]}/{name}"
        writable_output(new, "NEW_RUN")
        lineage = branch_run(parent, args.from_step, new, args.overrides)
    except (BranchError, RunLocationError, RunStoreError, StateFileError) as exc:
        raise CommandRefused(str(exc)) from None
    main_message(resolved_location(new).rstrip("/"), lineage)
    return 0
