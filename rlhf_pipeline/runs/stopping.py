"""Stopping a run cleanly: signals, the launcher's stop pipe, and waiting for children.

A child of ``run`` (collector or learner), or a rank of ``replay``, stops cleanly on its first
SIGINT/SIGTERM, on a byte from the launcher's stop pipe, or when that pipe closes because the
launcher died (even by ``kill -9``): :class:`StopFlag`. The launcher itself turns its first signal
into a request to every child and its second into a kill (:class:`LauncherSignals`,
:func:`stop_children`). Design: docs/pipelines.md#stopping.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence


class StopFlag:
    """Set by SIGINT/SIGTERM (first one: finish cleanly), by the launcher, or by the ``STOP`` file.

    A child of ``run`` or a rank of ``replay`` watches the launcher's pipe (``launcher_fd``, from
    ``--stop-fd``): a byte on it is a stop request, end-of-file means the launcher died (even by
    ``kill -9``); both stop cleanly. Neither counts as a signal, so one Ctrl-C (which reaches the
    launcher and the children alike) never looks like two.

    ``role`` names the process in its messages (``collector 1``, ``learner``): the caller says it,
    since a child forked by ``run`` (``cli/forker.py``) has the forking process's ``sys.argv``, which
    holds every child's command line, so a collector guessing from it called itself the learner.

    ``finish_allowance_s``: a child that stops between rounds (a collector, the evaluator) and whose
    launcher died ends itself with SIGKILL if it is still running this long, plus ``KILLED_AFTER_S``,
    after: what a live launcher gives it (``wait_for_children``). One stuck in a round (a reward or an
    environment that never returns) outlived a killed launcher for ever, holding the run directory,
    which refused the rerun. The learner has none: it stops at a step, with a checkpoint whose save a
    bound would cut short on a large model.
    """

    launcher_fd: int | None = None

    def __init__(self, role: str, *, finish_allowance_s: float | None = None) -> None:
        self.role = role
        self.finish_allowance_s = finish_allowance_s
        self.event = threading.Event()
        self.signal: int | None = None  # the first signal received
        self.launcher_stopped = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        if self.launcher_fd is not None:
            threading.Thread(target=self._watch_launcher, args=(self.launcher_fd,), daemon=True,
                             name="launcher-watch").start()

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal = signum
        say_in_handler(f"[{self.role}] stopping cleanly ({signal.Signals(signum).name}); press Ctrl-C again to abort")
        self.event.set()

    def _watch_launcher(self, fd: int) -> None:
        try:
            asked = os.read(fd, 1)  # blocks until the launcher writes, or its end closes
        except OSError:
            asked = b""
        self.launcher_stopped = True
        told = self.event.is_set()
        # set first: with the launcher gone, its stderr pipe may be gone too and the print fail
        self.event.set()
        if not told:
            why = "the launcher asked to stop" if asked else "the launcher is gone"
            if not say_in_handler(f"[{self.role}] {why}; stopping cleanly") and not asked:
                _silence_output()  # nobody reads the dead launcher's log: a print must not end us mid-stop
        if not asked and self.finish_allowance_s is not None:  # this thread is a daemon: a clean end ends it
            limit_s = self.finish_allowance_s + KILLED_AFTER_S
            time.sleep(limit_s)
            say_in_handler(f"[{self.role}] still running {limit_s:g} s after its launcher ended: ending it (SIGKILL); "
                           f"what it committed stays, and the next start resumes from it")
            os.kill(os.getpid(), signal.SIGKILL)

    def exit_code(self) -> int:
        """0 unless stopped early: 128 + the signal's number, or 143 when the launcher stopped us."""
        if self.signal is not None:
            return 128 + self.signal
        return 128 + signal.SIGTERM if self.launcher_stopped else 0

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def say_in_handler(message: str) -> bool:
    """Prints from a signal handler or the launcher watcher: a raw write, since the main thread
    may be inside a print (sys.stderr's buffer would raise "reentrant call"), and no exception:
    stderr may be a pipe whose reader is gone. Returns whether it was written."""
    try:
        os.write(sys.stderr.fileno(), (message + "\n").encode())
        return True
    except (OSError, ValueError):
        return False


def _silence_output() -> None:
    """Points stdout and stderr at /dev/null, so later prints cannot fail with a broken pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)


# a launcher's children: what its first signal asks to stop, and what its second kills
_CHILDREN = {"run": ("the learner (it saves a checkpoint) and the collectors (they finish their round)",
                     "the learner and collectors"),
             "replay": ("the ranks (they save a checkpoint at the same step)", "the ranks")}


class LauncherSignals:
    """SIGINT/SIGTERM to a launcher (``run``, or a ``replay`` of several ranks): the first asks the
    children to stop, a second kills them."""

    def __init__(self, command: str = "run") -> None:
        self.command = command
        self.received: list[int] = []
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame) -> None:
        self.received.append(signum)
        if len(self.received) == 1:
            say_in_handler(f"[{self.command}] {signal.Signals(signum).name}: stopping {_CHILDREN[self.command][0]}; "
                           f"again to stop them at once")

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def stop_children(stop_write: int, children: Sequence[subprocess.Popen], signals: LauncherSignals,
                  bounded: Mapping[subprocess.Popen, tuple[str, float]] | None = None) -> None:
    """Asks every child to stop through the stop pipe and waits for them (:func:`wait_for_children`)."""
    try:
        os.write(stop_write, b"s" * len(children))  # each child's watcher reads one byte (or EOF)
    except OSError:  # every child is gone already
        pass
    wait_for_children(children, signals, bounded)


def wait_for_children(children: Sequence[subprocess.Popen], signals: LauncherSignals,
                      bounded: Mapping[subprocess.Popen, tuple[str, float]] | None = None) -> set[subprocess.Popen]:
    """Waits for ``children``, asked to stop, to end; a second signal meanwhile kills the ones still
    running. A child in ``bounded`` (its name and allowance: a collector, the evaluator) still running
    past its allowance is asked again, then killed (:class:`StopDeadline`), each on its own clock: one
    stuck in a round held the launcher for ever when no second signal came (a scheduler's one SIGTERM,
    or a run stopping because its other collector died). The learner is never bounded: it stops at a
    step, with a checkpoint. Returns the children killed past their allowance."""
    deadlines = [StopDeadline(p, allowance_s, name) for p, (name, allowance_s) in (bounded or {}).items()]
    while any(p.poll() is None for p in children):
        if len(signals.received) >= 2:
            print(f"[{signals.command}] stopping now: killing {_CHILDREN[signals.command][1]}", file=sys.stderr,
                  flush=True)
            for p in children:
                if p.poll() is None:
                    p.kill()
            for p in children:
                p.wait()
            break
        for deadline in deadlines:
            if deadline.process.poll() is None:
                deadline.enforce()
        time.sleep(0.1)
    return {deadline.process for deadline in deadlines if deadline.killed}


# How long each child may take to stop, past which it is asked again (SIGTERM) and then killed: by its
# launcher (``wait_for_children``, ``wait_quietly``), or by itself when the launcher died (``StopFlag``)
COLLECTOR_FINISH_S = 120.0
"""Once the learner is done, how long each collector may take to finish its round."""
EVALUATOR_FINISH_S = 600.0
"""After the last step, how long the evaluator may take over the versions left (what it did not
evaluate, ``rlhf-pipeline eval RUN`` does)."""
KILLED_AFTER_S = 30.0
"""How long a child asked to stop by SIGTERM (past its allowance) may take before it is killed: one stuck
in a round (a reward or an environment that never returns) held its launcher for ever. A kill loses
nothing committed: every process of a run resumes exactly after ``kill -9``."""


class StopDeadline:
    """A child asked to stop, with ``allowance_s`` to do it: past it, the launcher asks again (SIGTERM,
    which a child honours only between rounds), and past ``KILLED_AFTER_S`` more it kills it, saying
    each in a line naming it (``name``: "the collector", "learner rank 1")."""

    def __init__(self, process: subprocess.Popen, allowance_s: float, name: str) -> None:
        self.process, self.allowance_s, self.name = process, allowance_s, name
        self.killed_after_s = KILLED_AFTER_S  # read at each start: a test shortens it
        self.act_at: float | None = time.monotonic() + allowance_s
        self.asked = self.killed = False

    def seconds_left(self) -> float | None:
        """Until the next step; None once killed."""
        return None if self.act_at is None else max(0.0, self.act_at - time.monotonic())

    def enforce(self) -> None:
        """Takes the step that is due, if one is."""
        if self.act_at is None or time.monotonic() < self.act_at:
            return
        if not self.asked:
            print(f"[run] {self.name} did not stop within {self.allowance_s:g} s: asking it again (SIGTERM)",
                  file=sys.stderr, flush=True)
            self.process.terminate()
            self.asked, self.act_at = True, time.monotonic() + self.killed_after_s
        else:
            print(f"[run] {self.name} did not stop within {self.killed_after_s:g} s of SIGTERM: killing it (SIGKILL); "
                  f"what it committed stays, and the next start resumes from it", file=sys.stderr, flush=True)
            self.process.kill()
            self.killed, self.act_at = True, None


def wait_quietly(process: subprocess.Popen, timeout: float | None = None, *, name: str = "a child") -> bool:
    """Waits for ``process`` to exit, through Ctrl-C (the launcher's own handling says what that does),
    past ``timeout`` asking it again and then killing it (:class:`StopDeadline`). Returns whether it
    had to be killed."""
    deadline = StopDeadline(process, timeout, name) if timeout is not None else None
    while True:
        try:
            process.wait(timeout=deadline.seconds_left() if deadline is not None else None)
            return deadline is not None and deadline.killed
        except KeyboardInterrupt:
            continue
        except subprocess.TimeoutExpired:
            deadline.enforce()
