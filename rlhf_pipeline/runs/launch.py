"""Starting ``run``'s children early, so that their imports overlap the launcher's checks: each waits
for ``go`` on its stdin (its end of file: exit quietly), and all watch one stop pipe whose end of
file means the launcher is gone. The learner child prepares the run and reports on a status pipe
(``prepared``, ``ready`` or ``error``). ``docs/pipelines.md#start-up``.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlhf_pipeline.processes import exit_status, free_port
from rlhf_pipeline.runs.forking import COMMAND_MODULE, ChildSpec, ForkError, can_fork_children, fork_children

GO = "go"
# what the learner child of `run` reports while it prepares the run (LauncherReports)
PREPARED = "prepared"  # settings checked, run directory, settings.json and buffer shards made
READY = "ready"  # weights version 0 published: the collectors can start generating
ERROR = "error"  # a check failed; the report carries the exception's class and message

# what each side imports anyway; the pipeline's own modules come after "go", with its build
_PRELOAD = {
    "collect": ("torch", "tensordict", "transformers", "rlhf_pipeline.models", "rlhf_pipeline.collect",
                "rlhf_pipeline.storage.memmap", "rlhf_pipeline.storage.torchrl_glue", "rlhf_pipeline.transforms"),
    "learn": ("torch", "tensordict", "transformers", "rlhf_pipeline.models", "rlhf_pipeline.storage.memmap",
              "rlhf_pipeline.learn.learner", "torch.utils.tensorboard"),
}


def evaluator_argv(run_location: str, overrides: Sequence[str]) -> list[str]:
    """The evaluator child's command line: ``eval RUN --follow`` with the run's ``eval.*`` settings."""
    argv = ["eval", run_location, "--follow"]
    for item in overrides:
        if item.strip().startswith("eval."):
            argv += ["--set", item]
    return argv


def how_it_ended(code: int) -> str:
    """How a child process ended, for a launcher's line: its exit code, and where to look. A signal's
    death (a negative code) leaves no error of its own: a kill -9, or the kernel's out-of-memory killer."""
    if code < 0:
        return (f"was {exit_status(code)}, leaving no error of its own (a kill -9, or the kernel's out-of-memory "
                f"killer: see `dmesg`)")
    return f"{exit_status(code)}; see its error above"


def evaluator_exited(code: int, run_location: str, *, training_done: bool = False) -> str:
    """What ``run`` says, once, when its evaluator exits early: training goes on (or has ended)."""
    went_on = "training had ended" if training_done else "training goes on without it"
    return (f"[run] the evaluator ended early ({how_it_ended(code)}); {went_on}, "
            f"and `rlhf-pipeline eval {run_location}` evaluates the kept versions")


def preload(command: str) -> None:
    """Imports the heavy modules the ``collect`` or ``learn`` side will need."""
    for name in _PRELOAD.get(command, ()):
        importlib.import_module(name)


def holds_preloaded() -> bool:
    """Whether this process already imported what both sides preload (then ``run`` can fork its
    children from itself: ``forking.fork_children``)."""
    return all(name in sys.modules for names in _PRELOAD.values() for name in names)


def wait_for_launcher(command: str, *, prepares: bool = False) -> bool:
    """Child side: preload, then wait for the launcher. False: the launcher gave up (exit quietly).

    ``prepares``: the learner that prepares the run for the launcher waits for nothing."""
    try:
        preload(command)
        return prepares or sys.stdin.readline().strip() == GO
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the launcher reports it
        return False


def rank_environments(world_size: int) -> list[dict[str, str]]:
    """The environment of each data-parallel learner rank, as ``torchrun`` would set it (one
    machine): ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and the rendezvous on a free local port.
    One rank: the environment as it is (no process group)."""
    if world_size == 1:
        return [dict(os.environ)]
    port = str(free_port())
    return [{**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size),
             "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            for r in range(world_size)]


def start_processes(specs: Sequence[ChildSpec], *, pass_fds: Sequence[int] = ()) -> list:
    """A process for each of ``specs``, each with a pipe as its stdin (the handle's ``stdin``):
    forked from one process that imports torch & co. once where the system allows it
    (``forking.fork_children``), else each a new interpreter. ``pass_fds``: every descriptor any of
    them keeps. If one cannot be started, those started are killed; ForkError when this process may
    not open a pipe for each."""
    started: list[subprocess.Popen] = []
    try:
        if can_fork_children():
            return fork_children(specs, pass_fds=pass_fds, holds_imports=holds_preloaded())
        for spec in specs:
            started.append(subprocess.Popen([sys.executable, "-m", COMMAND_MODULE, *spec.argv], stdin=subprocess.PIPE,
                                            text=True, pass_fds=spec.keep_fds, env=spec.env))
    except BaseException as exc:
        for process in started:
            process.kill()
            process.wait()
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            raise ForkError(f"could not start {len(specs)} processes, a pipe each: {exc.strerror} (this shell's "
                            f"limit is {limit}, `ulimit -n`); raise it, or start fewer (--collectors, learner.world_size)"
                            ) from None
        raise
    return started


def start_ranks(argv: Sequence[str], world_size: int, keep_fds: Sequence[int] = ()) -> tuple[list, int]:
    """``world_size`` data-parallel ranks each running the command line ``argv`` (``rank_environments``)
    with ``--stop-fd`` of one stop pipe, as ``run``'s children have: a byte on it asks them to stop, its
    end of file (this process gone, even by ``kill -9``) stops them too, each at its next step. Returns
    the ranks and the pipe's write end, which only this process holds (the caller closes it when done);
    every rank inherits ``keep_fds`` too (the run directory's holder lock)."""
    stop_read, stop_write = os.pipe()
    specs = [ChildSpec([*argv, "--stop-fd", str(stop_read)], keep_fds=(stop_read, *keep_fds), env=env)
             for env in rank_environments(world_size)]
    try:
        ranks = start_processes(specs, pass_fds=(stop_read, *keep_fds))
    except BaseException:
        os.close(stop_write)
        raise
    finally:
        os.close(stop_read)
    for rank in ranks:
        rank.stdin.close()  # a rank reads nothing from its launcher but the stop pipe
    return ranks, stop_write


def stop_ranks(ranks: Sequence[subprocess.Popen], grace_s: float = 20.0) -> None:
    """After one rank failed: the others wait in a collective that never completes, so they
    get SIGTERM, and SIGKILL after ``grace_s``."""
    for process in ranks:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in ranks:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class LauncherReports:
    """Learner side of the status pipe: one JSON line per event (``PREPARED``, ``READY``, ``ERROR``)."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def send(self, event: str, **fields: object) -> bool:
        """False when the launcher is gone (the stop pipe then stops this process)."""
        if self._fd is None:
            return False
        line = json.dumps({"event": event, **fields}) + "\n"
        try:
            os.write(self._fd, line.encode())
            return True
        except OSError:
            return False

    def error(self, exc: BaseException) -> bool:
        """Reports a failed check; True when the launcher got it (and will print it)."""
        fields: dict[str, object] = {"kind": type(exc).__name__, "message": str(exc)}
        if isinstance(exc, OSError):
            fields.update(errno=exc.errno, strerror=exc.strerror, filename=exc.filename and str(exc.filename))
        return self.send(ERROR, **fields)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class Children:
    """``run``'s child processes, started before the run directory is ready."""

    collectors: dict[int, subprocess.Popen] = field(default_factory=dict)
    learners: list[subprocess.Popen] = field(default_factory=list)  # one per data-parallel rank
    evaluator: subprocess.Popen | None = None  # with eval.every_steps > 0: `eval RUN --follow`
    stop_write: int = -1  # the launcher's end of the stop pipe; the caller closes it when done
    reports: object | None = None  # the launcher's end of the learner's status pipe (a text file)

    @property
    def learner(self) -> subprocess.Popen | None:
        """Rank 0: the learner that writes the run's files."""
        return self.learners[0] if self.learners else None

    @classmethod
    def start(cls, common: Sequence[str], learner_args: Sequence[str],
              collectors: int, learner_ranks: int = 1, keep_fds: Sequence[int] = (),
              evaluator: Sequence[str] | None = None) -> Children:
        """Collector ``k`` writes shard ``k`` (no ``--steps``: it runs until the learner's STOP; with
        several, each is given its index, which names it in its lines: ``[collector 0]``, ``[collector 1]``);
        ``learner_ranks`` learner processes train as data-parallel ranks (``rank_environments``);
        every child inherits ``keep_fds`` (open, unused: the run directory's holder lock); ``evaluator``:
        the arguments of the evaluator child, which goes with the collectors and stops with them."""
        children = cls()
        stop_read, children.stop_write = os.pipe()
        status_read, status_write = os.pipe()
        children.reports = os.fdopen(status_read, "r")
        wait = ["--wait-for-launcher", "--stop-fd", str(stop_read)]
        specs = [ChildSpec(["collect", *common, *(["--collector-index", str(k)] if collectors > 1 else []), *wait],
                           keep_fds=(stop_read, *keep_fds)) for k in range(collectors)]
        # rank 0 prepares the run for all collectors' shards and says how it went; the other
        # ranks wait for "go", given once weights version 0 is published
        prepare = ["--status-fd", str(status_write), "--collectors", str(collectors)]
        for rank, env in enumerate(rank_environments(learner_ranks)):
            extra, fds = (prepare, (stop_read, status_write)) if rank == 0 else ([], (stop_read,))
            specs.append(ChildSpec(["learn", *common, *learner_args, *wait, *extra], keep_fds=(*fds, *keep_fds),
                                   env=env if learner_ranks > 1 else None))
        if evaluator is not None:  # last: the slices below find it there
            specs.append(ChildSpec([*evaluator, *wait], keep_fds=(stop_read, *keep_fds)))
        try:
            started = start_processes(specs, pass_fds=(stop_read, status_write, *keep_fds))
        except BaseException:  # none of them runs: nobody will read or write the pipes
            children.reports.close()
            os.close(children.stop_write)
            raise
        finally:
            os.close(stop_read)  # only the children read it: its end of file must mean we are gone
            os.close(status_write)  # only the learner writes: end of file means it exited
        children.collectors = dict(enumerate(started[:collectors]))  # by kind, in the order of specs
        children.learners = started[collectors:collectors + learner_ranks]
        children.evaluator = next(iter(started[collectors + learner_ranks:]), None)
        return children

    def wait_for_learner(self, event: str) -> dict | None:
        """Blocks until the learner reports ``event`` or an ``ERROR`` and returns that report; None
        when the learner exited without either (its traceback, if any, is above)."""
        while True:
            line = self.reports.readline()
            if not line:
                return None
            report = json.loads(line)
            if report["event"] in (event, ERROR):
                return report

    def _all(self) -> list[subprocess.Popen]:
        return [*self.collectors.values(), *self.learners, *self.helpers]

    @property
    def helpers(self) -> list[subprocess.Popen]:
        """The children that go with the collectors but whose exit stops nothing: the evaluator."""
        return [self.evaluator] if self.evaluator is not None else []

    def go(self, processes: Sequence[subprocess.Popen] | None = None) -> None:
        """The run directory is ready: ``processes`` (default: every child) carry on; a child told
        before is skipped."""
        for process in self._all() if processes is None else processes:
            if not process.stdin.closed:
                self._tell(process, GO + "\n")

    def abandon(self) -> None:
        """A check failed or a signal came while the learner prepared the run: every child ends at
        once. Collectors have created nothing yet (importing, waiting for "go" or for weights
        version 0: they stop cleanly, with a line each); the learner has created nothing or
        only what a rerun resumes from (settings, empty shards; weights are published atomically),
        and SIGTERM ends it without a word."""
        for process in self._all():
            if process.poll() is None:
                process.terminate()
        for process in self._all():
            if not process.stdin.closed:
                self._tell(process, "")
            process.wait()
        if self.reports is not None:
            self.reports.close()
            self.reports = None
        if self.stop_write >= 0:
            os.close(self.stop_write)
            self.stop_write = -1

    @staticmethod
    def _tell(process: subprocess.Popen, line: str) -> None:
        try:
            if line:
                process.stdin.write(line)
            process.stdin.close()
        except (BrokenPipeError, OSError):  # the child already ended; run reports its exit code
            pass
