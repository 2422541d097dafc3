"""``rlhf-pipeline run | collect | learn PIPELINE.py``: one command module, three entry points.

``run`` starts ``--collectors N`` collector processes (default 1; collector k writes its own buffer
shard) and one learner process that reads all shards, and stops the collectors when the learner has
taken ``--steps`` steps. ``collect`` / ``learn`` run one side alone against the same run directory
(e.g. a learner resumed over a recorded buffer, or ``collect --collector-index K`` on another machine,
writing shard K). Running the same command again resumes the run. Arguments are parsed before torch
is imported, so ``--help`` and argument errors are instant. Design: docs/pipelines.md#the-commands.
"""

from __future__ import annotations

import argparse
import errno
import sys

from rlhf_pipeline.cli import CommandRefused


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("pipeline", metavar="PIPELINE.py", help="path of the pipeline file")
    if name == "collect":
        steps_help = "collection rounds before stopping (default: until the learner is done or Ctrl-C)"
    else:
        steps_help = "learner steps to reach (sets the pipeline's `steps`); a resumed run continues to it"
    parser.add_argument("--steps", type=int, default=None, help=steps_help)
    if name == "run":
        parser.add_argument("--collectors", type=int, default=1, metavar="N",
                            help="collector processes to start; collector k writes buffer/shard-k and "
                                 "the learner reads all shards (default: 1)")
    if name == "collect":
        parser.add_argument("--collector-index", type=int, default=None, metavar="K",
                            help="which collector this is: it writes buffer/shard-K, keeps its own state, "
                                 "its ids carry K and its lines say [collector K] (default: 0, the run's only "
                                 "collector, whose lines say [collector])")
    parser.add_argument("--home", default=None,
                        help="directory holding run directories, or an s3:// or az:// URL holding runs "
                             "(every piece of run state there; endpoint and credentials from AWS_ENDPOINT_URL, "
                             "AWS_ACCESS_KEY_ID, ... or AZURE_STORAGE_CONNECTION_STRING) "
                             "(default: storage/ in the repo, or $RLHF_PIPELINE_HOME)")
    parser.add_argument("--run-name", default=None,
                        help="run directory name under --home (default: the pipeline file's name)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="device for the models (sets the pipeline's `device`)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a pipeline setting, e.g. --set learner.lr=1e-4 (repeatable)")
    parser.add_argument("--list-settings", action="store_true",
                        help="print the pipeline's settings with their documentation and exit")
    if name in ("run", "learn"):
        parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                            help="run the collectors and the learner as Ray actors: on the cluster at ADDRESS "
                                 "(e.g. 10.0.0.1:6379, or auto), or a local one started for this run; "
                                 "needs pip install -e '.[ray]'")
    if name in ("collect", "learn"):
        # set by `run` for its children (rlhf_pipeline/runs/launch.py): the launcher's stop pipe, and
        # "import, then wait for the launcher's go"
        parser.add_argument("--stop-fd", type=int, default=None, help=argparse.SUPPRESS)
        parser.add_argument("--wait-for-launcher", action="store_true", help=argparse.SUPPRESS)
    if name == "learn":
        # set by `run` for its learner, which prepares the run for `run`'s collectors and
        # reports on this pipe (rlhf_pipeline/runs/launch.py)
        parser.add_argument("--status-fd", type=int, default=None, help=argparse.SUPPRESS)
        parser.add_argument("--collectors", type=int, default=1, help=argparse.SUPPRESS)


# OS errors a user can cause and fix (a read-only or full disk, a path that is a file...):
# one line naming the path instead of a traceback
_USER_OS_ERRORS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.ENOTDIR,
                   errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP}


def run(args: argparse.Namespace) -> int:
    from rlhf_pipeline.pipeline import PipelineError
    from rlhf_pipeline.runs.run import run_command
    from rlhf_pipeline.runs.run_directory import RunError
    from rlhf_pipeline.files.run_paths import RunLocationError
    from rlhf_pipeline.files.run_store import RunStoreError, StaleWriterError
    from rlhf_pipeline.files.state_files import StateFileError

    try:
        on_ray = None
        if getattr(args, "ray", None) is not None:
            from rlhf_pipeline.cluster.driver import ray_launcher

            on_ray = ray_launcher(args.command, address=args.ray)
        code = run_command(
            args.command,
            pipeline_path=args.pipeline,
            steps=args.steps,
            home=args.home,
            run_name=args.run_name,
            device=args.device,
            overrides=args.overrides,
            list_settings=args.list_settings,
            collectors=getattr(args, "collectors", 1),
            collector_index=getattr(args, "collector_index", None),
            stop_fd=getattr(args, "stop_fd", None),
            wait_for_launcher=getattr(args, "wait_for_launcher", False),
            on_ray=on_ray,
            status_fd=getattr(args, "status_fd", None),
        )
    except (PipelineError, RunError, StateFileError, RunLocationError, RunStoreError, StaleWriterError) as exc:
        raise CommandRefused(str(exc)) from None
    except OSError as exc:
        if exc.errno not in _USER_OS_ERRORS or exc.filename is None:
            raise
        raise CommandRefused(_describe_os_error(exc)) from None
    if args.command == "run" or getattr(args, "wait_for_launcher", False) or getattr(args, "ray", None) is not None:
        _exit_without_teardown(code)
    return code


def _describe_os_error(exc: OSError) -> str:
    path = exc.filename
    hint = {
        errno.EROFS: "the file system is read-only; choose a writable --home (or $RLHF_PIPELINE_HOME)",
        errno.EACCES: "no permission; choose a --home you can write to, or fix its permissions",
        errno.EPERM: "no permission; choose a --home you can write to, or fix its permissions",
        errno.ENOSPC: "the disk is full; free space (nothing written so far is lost) and rerun to resume",
        errno.EDQUOT: "the disk quota is exceeded; free space and rerun to resume",
        errno.EFBIG: "a file size limit is exceeded (ulimit -f); raise it and rerun to resume",
        errno.ENOTDIR: "a part of this path is a file, not a directory; choose another --home or --run-name",
    }.get(exc.errno, "check the path, --home and --run-name")
    return f"{path}: {exc.strerror}; {hint}"


def _exit_without_teardown(code: int) -> None:
    """Ends ``run`` and its children at once. Tearing down an interpreter that loaded torch and
    transformers took ~4 s per process here with the machine's load at 15 (0.2 s this way), and
    does nothing for us: every store, checkpoint, metrics file and TensorBoard writer is closed
    (and what must be durable fsynced) before ``run_command`` returns."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
