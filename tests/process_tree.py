"""What is left of a process tree after a kill, read from ``/proc``: the tests that kill a run, a
collector or an engine's owner check that none of its processes, nor any of their process groups (a
vLLM server runs in a session of its own), outlives it.

A process is named by (pid, start time), so a pid the system hands out again is not taken for it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

Process = tuple[int, int]
"""(pid, start time in clock ticks since boot: field 22 of ``/proc/PID/stat``)."""


def _stat(pid: int) -> list[str] | None:
    """Fields 3 on of ``/proc/PID/stat`` (state, ppid, pgrp, ...); None for a process gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else fields


def _all() -> dict[int, list[str]]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                found[int(entry.name)] = fields
    return found


def tree(root: int) -> dict[Process, int]:
    """``root`` and every process below it now, each with its process group."""
    running = _all()
    children: dict[int, list[int]] = {}
    for pid, fields in running.items():
        children.setdefault(int(fields[1]), []).append(pid)
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in running:
            found[(pid, int(running[pid][19]))] = int(running[pid][2])
            todo += children.get(pid, [])
    return found


def left_of(processes: dict[Process, int]) -> list[str]:
    """What still runs of ``processes`` (``tree``'s) or of their process groups: one line each."""
    groups = set(processes.values()) - {os.getpgid(0)}  # the caller's own group is not what was killed
    left = []
    for pid, fields in _all().items():
        if (pid, int(fields[19])) in processes or int(fields[2]) in groups:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
            except OSError:  # it ended meanwhile
                continue
            left.append(f"{pid} (group {fields[2]}): {command.decode(errors='replace')}")
    return left


def wait_gone(processes: dict[Process, int], deadline_s: float = 120.0) -> list[str]:
    """Polls until nothing of ``processes`` or their groups runs, at most ``deadline_s`` (a bound on a
    hang, not a timing); what is left then (empty: all gone)."""
    deadline = time.monotonic() + deadline_s
    while (left := left_of(processes)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def kill_left(processes: dict[Process, int]) -> None:
    """SIGKILLs what still runs of ``processes`` (a test's cleanup after a failed check): only a pid
    whose start time is still the one recorded, so a pid handed out again is left alone."""
    for pid, fields in _all().items():
        if (pid, int(fields[19])) in processes:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
