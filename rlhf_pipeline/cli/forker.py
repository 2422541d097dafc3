"""The forking process of ``run``: imports torch & co. once, then forks each child into ``main(argv)``.

Started by :func:`rlhf_pipeline.runs.forking.fork_children`, never as a command: it reads the
children's specs (JSON) on stdin, forks one child per spec, reports each pid on ``REPORT_FD`` and
exits; each child waits for that exit before it runs. Design: docs/architecture.md#the-command-line.
"""

from __future__ import annotations

import json
import os
import sys

from rlhf_pipeline.runs.forking import ChildSpec, exit_at_once, run_child, set_thread_name
from rlhf_pipeline.runs.launch import preload


def fork_all(report_fd: int) -> int:
    set_thread_name("rlhf-forker")
    spec = json.loads(sys.stdin.read())
    try:
        preload("collect")
        preload("learn")
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the launcher reports it
        return 130
    adopted_read, adopted_write = os.pipe()  # its end of file: this process is gone, the child adopted
    for child in spec:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # waits for this process's exit, then runs its command line and exits
            run_child(ChildSpec(child["argv"], tuple(child["keep_fds"]), child["env"]), child["stdin"],
                      after=adopted_read)
        os.write(report_fd, f"{pid}\n".encode())
        os.close(child["stdin"])
    return 0


if __name__ == "__main__":
    exit_at_once(fork_all(int(sys.argv[1])))  # the children carry on
