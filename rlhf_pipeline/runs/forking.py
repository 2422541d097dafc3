"""``run``'s children forked from one process (``cli/forker.py``) that imported torch & co. once: ``run``
is their child subreaper, so they are its own once the forking process exits, and each waits for
that before it runs. A launcher that already holds those imports and runs one thread (a Python
process that preloaded them, as the test suite's does) forks its children itself. Either way each
child starts as ``python -m rlhf_pipeline.cli.main ARGV`` would. ``docs/pipelines.md#start-up``.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_CHILD = "--child"  # before each child's command line in the forking process's own (ps shows them)
# what a child runs: `python -m` it, or in a fork its main(argv). By name, as the command line the
# launcher would start: the CLI is the layer above this one
COMMAND_MODULE = "rlhf_pipeline.cli.main"


@dataclass
class ChildSpec:
    """One child: ``rlhf_pipeline.cli.main`` arguments, the file descriptors it keeps (beside the
    stdin pipe the launcher makes for it) and its environment (None: the launcher's)."""

    argv: list[str]
    keep_fds: tuple[int, ...] = ()
    env: Mapping[str, str] | None = None


def set_thread_name(name: str) -> bool:
    """Names the calling thread (``ps -o comm``; at most 15 characters); a thread forked from it
    starts with that name. False where the system does not let it."""
    return _prctl(_PR_SET_NAME, name.encode()[:15])


def _prctl(option: int, value) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _is_subreaper() -> bool:
    flag = ctypes.c_int(0)
    return _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag)) and flag.value != 0


def can_fork_children() -> bool:
    """Whether this system lets ``run`` adopt the children of its forking process (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


class ForkedChild:
    """``run``'s handle on a child forked by the forking process and re-parented to ``run``."""

    def __init__(self, pid: int, stdin, args: Sequence[str]) -> None:
        self.pid = pid
        self.stdin = stdin  # the write end of the child's stdin pipe (text)
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._reap(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                self._reap(0)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped elsewhere: as Popen does, its code is unknown (0)
            self.returncode = 0
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not yet reaped: the pid is still this child's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkError(RuntimeError):
    """The forking process ended before it forked every child (its error is printed above)."""


def fork_children(children: Sequence[ChildSpec], *, pass_fds: Sequence[int] = (),
                  holds_imports: bool = False) -> list[ForkedChild]:
    """Launcher side: starts the forking process, which imports once and forks ``children``;
    returns them, adopted. ``pass_fds``: every descriptor any child keeps (the forking process
    gets them all; each child closes those not its own). ``holds_imports``: this process already
    imported what the forking process would; if it also runs one thread, it forks the children
    itself. Raises :class:`ForkError` when the forking process fails before it has forked them all
    (the ones it forked are killed)."""
    if holds_imports and runs_one_thread():
        return _fork_from_here(children)
    was_subreaper = _is_subreaper()  # e.g. a test harness's: left as it was
    if not _prctl(_PR_SET_CHILD_SUBREAPER, 1):
        raise ForkError("prctl(PR_SET_CHILD_SUBREAPER) failed: run cannot adopt its children")
    stdins = [os.pipe() for _ in children]
    writers = [os.fdopen(w, "w") for _, w in stdins]
    report_read, report_write = os.pipe()
    spec = [{"argv": c.argv, "keep_fds": list(c.keep_fds), "stdin": r, "env": dict(c.env) if c.env else None}
            for c, (r, _) in zip(children, stdins)]
    words = [w for c in children for w in (_CHILD, *c.argv)]  # for ps: each child's arguments
    forker: subprocess.Popen | None = None
    forked: list[ForkedChild] = []
    try:
        try:
            forker = subprocess.Popen([sys.executable, "-m", "rlhf_pipeline.cli.forker", str(report_write), *words],
                                      stdin=subprocess.PIPE, text=True,
                                      pass_fds=(*pass_fds, report_write, *(r for r, _ in stdins)))
        finally:
            os.close(report_write)
            for r, _ in stdins:
                os.close(r)
        try:
            forker.stdin.write(json.dumps(spec))
            forker.stdin.close()
        except BrokenPipeError:  # it failed at once; its exit code says so below
            pass
        with os.fdopen(report_read, "r") as reports:  # a pid a line, as each child is forked
            for line, child, writer in zip(reports, children, writers):
                forked.append(ForkedChild(int(line), writer, child.argv))
        code = forker.wait()  # its children are ours from here on
        if code != 0 or len(forked) != len(children):
            raise ForkError(f"the process that starts the collectors and the learner failed (exit code {code}); "
                            f"see its error above")
    except BaseException:
        if forker is not None and forker.poll() is None:  # still importing: it forks nothing now
            forker.kill()
            forker.wait()
        for child in forked:
            child.kill()
            child.wait()
        for writer in writers:
            writer.close()
        raise
    finally:
        _prctl(_PR_SET_CHILD_SUBREAPER, int(was_subreaper))
    return forked


def runs_one_thread() -> bool:
    """Whether this process runs no Python thread but its main one: only then may a fork of it go on
    running Python, since a lock another thread held would stay held there. Native pools are the
    libraries' own concern, as in the forking process: OpenBLAS's, which numpy starts on import, and
    torch's shut down or start anew across a fork."""
    return threading.active_count() == 1


def _fork_from_here(children: Sequence[ChildSpec]) -> list[ForkedChild]:
    forked: list[ForkedChild] = []
    try:
        for child in children:
            stdin_read, stdin_write = os.pipe()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                run_child(child, stdin_read)
            os.close(stdin_read)
            forked.append(ForkedChild(pid, os.fdopen(stdin_write, "w"), child.argv))
    except BaseException:
        for started in forked:
            started.kill()
            started.wait()
            started.stdin.close()
        raise
    return forked


def run_child(child: ChildSpec, stdin: int, *, after: int | None = None) -> NoReturn:
    """In a forked child: becomes what ``python -m rlhf_pipeline.cli.main ARGV`` would start (its
    thread named after its role, only its own descriptors open: ``keep_fds`` and ``stdin`` as fd 0,
    signals and standard streams as a new interpreter has them, its environment), runs the command
    and exits with its code. ``after``: a pipe whose end of file it waits for first (the forking
    process's exit: then it is the launcher's child)."""
    code = 1
    try:
        # named here, not by the forking process before its fork: it would bear a child's name until
        # its next fork or exit, and whoever looks a role up by name (ps, pkill) would find it
        set_thread_name(thread_name(child.argv, child.env))
        close_descriptors_but({*child.keep_fds, stdin, *([] if after is None else [after])})
        os.dup2(stdin, 0)
        os.close(stdin)
        start_as_a_new_interpreter()
        if child.env is not None:
            os.environ.clear()
            os.environ.update(child.env)
        if after is not None:
            os.read(after, 1)
            os.close(after)
        code = run_command(child.argv)
    except BaseException:  # noqa: BLE001 (before the command ran: printed, then exit 1)
        traceback.print_exc()
    finally:
        exit_at_once(code)


def exit_at_once(code: int) -> NoReturn:
    """Ends this process with ``code`` once its standard streams are flushed, without the interpreter's
    teardown (seconds with torch loaded; and in a fork, the parent's objects are not this process's to
    finalize)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def run_command(argv: Sequence[str]) -> int:
    """Runs a command line of the CLI in this process and returns its exit code, as the interpreter
    would have ended on it: ``sys.exit``'s code (a message printed), 130 on Ctrl-C, 1 on an error,
    whose traceback is printed."""
    try:
        return importlib.import_module(COMMAND_MODULE).main(list(argv)) or 0
    except SystemExit as exc:  # argparse's errors, sys.exit(...)
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BaseException:  # noqa: BLE001 (printed as the interpreter would, then exit 1)
        traceback.print_exc()
        return 1


def close_descriptors_but(keep: set[int]) -> None:
    """Closes every file descriptor above 2 that is not in ``keep``, as ``subprocess`` does for a
    child it starts (``close_fds``): a pipe end left open in a child would keep its reader from
    ever seeing end of file."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:  # the descriptor listdir itself had open
                pass


def start_as_a_new_interpreter() -> None:
    """What ``exec`` of a new Python would give a forked process: the signals this process handles
    back to their defaults (ignored ones stay ignored; SIGINT raises KeyboardInterrupt, as Python
    sets it), and standard streams made anew on fds 0-2, so that nothing the parent put in
    ``sys.stdout`` or left in its buffers carries over."""
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115 (fds 0-2 live as long as the process)
    sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)  # noqa: SIM115 (line-buffered on a terminal)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, errors="backslashreplace",  # noqa: SIM115
                                       closefd=False)


def thread_name(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """``rlhf-collect``, ``rlhf-collect-K`` (collector K), ``rlhf-learn``, ``rlhf-learn-R`` (rank R),
    ``rlhf-replay``, ``rlhf-replay-R`` (a replay's rank R), ``rlhf-eval`` (the evaluator): what
    ``ps -o comm`` shows of a forked child (at most 15 characters)."""
    if argv[0] == "eval":
        return "rlhf-eval"
    if argv[0] == "collect":
        number = argv[argv.index("--collector-index") + 1] if "--collector-index" in argv else "0"
    else:
        number = (env or {}).get("RANK", "0")
    role = "rlhf-replay" if argv[0] == "replay" else "rlhf-collect" if argv[0] == "collect" else "rlhf-learn"
    return role if number == "0" else f"{role}-{number}"[:15]
