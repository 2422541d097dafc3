"""``rlhf-pipeline detach BRANCH``: copies the parent rows a branch reads into its own store, so
that the parent may be deleted or pruned (``docs/branching.md#making-a-branch-self-contained``).

A command of its own rather than an option of ``branch``: it takes no parent and no step, only the
branch, at any time after it was made (also after it trained), and running it again is safe.
"""

from __future__ import annotations

import argparse
import sys

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.cli.checks import add_run_argument


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    add_run_argument(parser, "branch", metavar="BRANCH",
                        help="the branch: a run directory, its name or its s3:// or az:// URL, made by rlhf-pipeline "
                             "branch")


def run(args: argparse.Namespace) -> int:
    from rlhf_pipeline.files.run_store import RunStoreError
    from rlhf_pipeline.runs.branch import BranchError
    from rlhf_pipeline.runs.detach import detach
    from rlhf_pipeline.storage.errors import StoreError

    try:
        detached, now = detach(args.branch)
    except (BranchError, RunStoreError, StoreError) as exc:
        raise CommandRefused(str(exc)) from None
    copied = (f"{detached['rows_copied']} parent rows copied into {detached['rows_in']}" if detached["rows_copied"]
              else "it read no parent rows (a branch of a replay holds its own checkpoint and weights)")
    if now:
        print(f"[detach] {args.branch} is self-contained: {copied}; its lineage stays in branch.json "
              f"(detached {detached['at']})", file=sys.stderr)
    else:
        print(f"[detach] {args.branch} was already self-contained, detached {detached['at']} ({copied}); nothing "
              f"to do", file=sys.stderr)
    return 0
