"""Two facts about OS processes that the run's launcher and the engines' process keepers both need: how
a child ended, in words (:func:`exit_status`), and a TCP port nothing listens on (:func:`free_port`).
Imports nothing of the package, so every layer may use it.
Design: docs/architecture.md#the-package-one-folder-per-idea.
"""

from __future__ import annotations

import signal
import socket


def exit_status(returncode: int | None) -> str:
    """``exit code 1``, or ``killed by SIGKILL`` for a process a signal ended."""
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            pass
    return f"exit code {returncode}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` nothing listens on now ("" for every interface, when processes on other
    machines connect: the learner ranks' rendezvous on Ray)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
