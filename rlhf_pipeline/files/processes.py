"""Whether a process of this host still runs: what every lock and lease of ours asks before it
takes over from a holder on the same host (a file lock's, a store's writer lock, a run's lease);
and which processes hold a lock file open, to name them when a lock outlives its recorded holder.

Design: docs/object-storage.md#how-the-guarantees-hold-without-a-file-system.
"""

from __future__ import annotations

import os


def pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")"
            state = f.read().rpartition(b")")[2].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def processes_with_open(path: str | os.PathLike) -> list[int]:
    """Pids of this host's other processes that have ``path`` open (scans ``/proc``; best effort):
    who still holds a lock whose recorded holder has ended, having inherited its descriptor."""
    target = os.path.realpath(path)
    found = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
    except OSError:
        return found
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    found.append(pid)
                    break
        except OSError:
            continue
    return found
