"""Argument checks that commands make before their heavy imports, so a typo is answered at once.
Design: docs/architecture.md#the-command-line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Literal

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.files.atomic import why_unwritable
from rlhf_pipeline.files.run_paths import HOME_ENV_VAR, RunLocationError, is_url, run_paths


def buffer_path_problem(location: str) -> str | None:
    """What is wrong with ``location`` as a buffer to read, when a look at the file system tells: a
    local path that does not exist; else None (URLs and everything else are checked when opened)."""
    if "://" not in location and not Path(location).exists():
        return f"{location} does not exist"
    return None


def writable_output(location: str, what: str, *, kind: Literal["file", "directory"] | None = None) -> None:
    """Refuses, before any work, an output ``location`` (the argument ``what``: ``OUT``, ``--out``) that
    cannot be made: a part of its path that is a file, a read-only or foreign file system, no
    permission, or a directory where a ``kind="file"`` that may be replaced goes (a file where a
    ``"directory"`` goes). URLs are the store's to refuse when written."""
    if is_url(location):
        return
    there = Path(location)
    if kind == "directory" and there.exists() and not there.is_dir():
        why = f"{location} is a file, not a directory"
    elif kind == "file" and there.is_dir():
        why = f"{location} is a directory"
    else:
        why = why_unwritable(location)
    if why is not None:
        raise CommandRefused(f"{what} {location} cannot be written: {why}; choose another {what}")


def buffer_given(location: str, command: str) -> str:
    """A command's buffer argument as the buffer to read: a run (its directory or URL; a name is one by
    :func:`run_or_path`) stands for the buffer its learner read, and one line on stderr says so. A
    replay's run, which keeps none, is refused in one line naming the buffer it read."""
    import sys

    from rlhf_pipeline.runs.lineage import KeepsNoBuffer, buffer_of_run

    try:
        run_buffer = buffer_of_run(location)
    except KeepsNoBuffer as exc:
        raise CommandRefused(str(exc)) from None
    if run_buffer is None:
        return location
    print(f"[{command}] {location} is a run: its buffer {run_buffer}", file=sys.stderr, flush=True)
    return run_buffer


def refuse_empty(text: str, what: str) -> None:
    """An empty argument (``inspect "$RUN"`` with RUN unset) named the current directory, or the home."""
    if not text.strip():
        raise CommandRefused(f"{what or 'a run or path argument'} is empty: give a run's name, a path or a URL")


def _given_as_a_path(text: str) -> bool:
    """Whether a command's argument is a path or URL as given, not the bare name of a run: a URL, a
    ``/`` inside it, or a path that exists here."""
    return is_url(text) or "/" in text.strip("/") or Path(text).exists()


def store_or_run(text: str, home: str | None, what: str) -> str:
    """An argument naming where rows are written that may be a run (``import``'s BUFFER): a path or URL
    as given. A bare name (no ``/``, no such path here) is the run of that name under ``home`` when
    ``--home`` is given (refused when there is none), else a new store here, as it always was; but a
    run of that name under the default home makes it ambiguous, refused naming both ways to say it."""
    refuse_empty(text, what)
    if _given_as_a_path(text):
        return text
    from rlhf_pipeline.files.run_store import RunStoreError
    from rlhf_pipeline.runs.lineage import is_run

    name = text.strip("/")
    try:
        location = run_paths(name, home).location
        there = is_run(location)
    except (RunLocationError, RunStoreError) as exc:  # an unsupported scheme; a store that would not answer
        raise CommandRefused(str(exc)) from None
    if home is not None:
        if not there:
            raise CommandRefused(f"{what} {text}: no run of that name is under --home {home} ({location}); give a "
                                 f"path (./{name}) for a new store")
        return location
    if there:
        raise CommandRefused(f"{what} {text} could be a new store in this directory or the run {location} (under "
                             f"${HOME_ENV_VAR} or storage/): give ./{name} for the store, or {location} for the run")
    return text


HOME_HELP = ("directory holding run directories, or an s3:// or az:// URL holding runs, for a run given by its "
             "name (default: storage/ in the repo, or $RLHF_PIPELINE_HOME)")


def add_run_argument(parser: argparse.ArgumentParser, dest: str, **options: Any) -> None:
    """A positional that names a run, a buffer or a file (``add_argument``'s ``options``), and ``--home``
    beside it: a bare name is a run under the home, resolved by :func:`resolve_run_arguments` once the
    whole command line is parsed (``--home`` may come after it)."""
    parser.add_argument(dest, **options)
    parser.set_defaults(_run_arguments=[*(parser.get_default("_run_arguments") or []), dest])
    try:
        parser.add_argument("--home", default=None, help=HOME_HELP)
    except argparse.ArgumentError:  # a second run argument of the same command
        pass


def resolve_run_arguments(args: argparse.Namespace) -> None:
    """Each argument :func:`add_run_argument` added, as :func:`run_or_path` resolves it under ``args.home``."""
    for dest in getattr(args, "_run_arguments", ()):
        value = getattr(args, dest)
        if isinstance(value, list):
            setattr(args, dest, [run_or_path(item, args.home) for item in value])
        elif value is not None:
            setattr(args, dest, run_or_path(value, args.home))


def run_or_path(text: str, home: str | None = None, what: str = "") -> str:
    """A command's RUN argument: a path or URL as given, or else a bare name (no ``/``, no such path
    here): the run ``run`` made under that name in ``home`` (``--home``; else ``$RLHF_PIPELINE_HOME``
    or ``storage/``), so that ``rlhf-pipeline inspect default`` finds what ``run pipelines/default.py``
    wrote, from any directory. As argparse's ``type``, it refuses a name that is neither before any
    heavy import, through :class:`CommandRefused` (one line, as every refusal, naming the option
    ``what`` where there is one)."""
    refuse_empty(text, what)
    if _given_as_a_path(text):
        return text
    try:
        location = run_paths(text.strip("/"), home).location
    except RunLocationError as exc:
        raise CommandRefused(str(exc)) from None
    if is_url(location) or Path(location).exists():  # a run at a URL is looked for when the command opens it
        return location
    where = f"--home {home}" if home is not None else f"${HOME_ENV_VAR} or storage/"
    raise CommandRefused(f"{what + ' ' if what else ''}{text} does not exist, and no run of that name is under "
                         f"{Path(location).parent} ({where})")


def step_or_best(text: str) -> int | str:
    """``--from-step`` / ``--step``: a learner step, or ``best`` (the run's best checkpoint by learner.keep_best)."""
    if text == "best":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a step number nor best") from None
