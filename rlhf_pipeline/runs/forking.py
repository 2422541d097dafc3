"""``run``'s children forked from one process (``cli/forker.py``) that imported torch & co. once: ``run``
is their child subreaper, so they are its own once the forking process exits, and each waits for
that before it runs. ``docs/pipelines.md#start-up``.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_CHILD = "--child"  # before each child's command line in the forking process's own (ps shows them)


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
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


class ForkError(RuntimeError):
    """The forking process ended before it forked every child (its error is printed above)."""


def fork_children(children: Sequence[ChildSpec], *, pass_fds: Sequence[int] = ()) -> list[ForkedChild]:
    """Launcher side: starts the forking process, which imports once and forks ``children``;
    returns them, adopted. ``pass_fds``: every descriptor any child keeps (the forking process
    gets them all; each child closes those not its own). Raises :class:`ForkError` when the
    forking process fails before it has forked them all (the ones it forked are killed)."""
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


def thread_name(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """``rlhf-collect``, ``rlhf-collect-K`` (collector K), ``rlhf-learn``, ``rlhf-learn-R`` (rank R),
    ``rlhf-eval`` (the evaluator): what ``ps -o comm`` shows of a forked child (at most 15 characters)."""
    if argv[0] == "eval":
        return "rlhf-eval"
    if argv[0] == "collect":
        k = argv[argv.index("--collector-index") + 1] if "--collector-index" in argv else "0"
        return "rlhf-collect" if k == "0" else f"rlhf-collect-{k}"[:15]
    rank = (env or {}).get("RANK", "0")
    return "rlhf-learn" if rank == "0" else f"rlhf-learn-{rank}"[:15]
