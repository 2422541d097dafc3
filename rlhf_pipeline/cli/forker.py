"""The forking process of ``run``: imports torch & co. once, then forks each child into ``main(argv)``.

Started by :func:`rlhf_pipeline.runs.forking.fork_children`, never as a command: it reads the
children's specs (JSON) on stdin, forks one child per spec, reports each pid on ``REPORT_FD`` and
exits; each child waits for that exit before it runs. Design: docs/architecture.md#the-command-line.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from rlhf_pipeline.runs.forking import set_thread_name, thread_name
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
    inherited = {fd for child in spec for fd in (child["stdin"], *child["keep_fds"])}
    for child in spec:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_child(child, inherited, adopted_read, adopted_write, report_fd)  # never returns
        os.write(report_fd, f"{pid}\n".encode())
        os.close(child["stdin"])
    return 0


def run_child(child: dict, inherited: set[int], adopted_read: int, adopted_write: int, report_fd: int) -> None:
    """In a forked child: runs its command line and exits with its code."""
    code = 1
    try:
        # named here, not by the forking process before its fork: it would bear a child's name until
        # its next fork or exit, and whoever looks a role up by name (ps, pkill) would find it
        set_thread_name(thread_name(child["argv"], child["env"]))
        os.close(adopted_write)
        os.close(report_fd)
        for fd in inherited - set(child["keep_fds"]) - {child["stdin"]}:
            try:
                os.close(fd)
            except OSError:  # an earlier child's stdin: this process closed it after that fork
                pass
        os.dup2(child["stdin"], 0)
        os.close(child["stdin"])
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (fd 0 lives as long as the process)
        if child["env"] is not None:
            os.environ.clear()
            os.environ.update(child["env"])
        os.read(adopted_read, 1)  # returns once the forking process has exited
        os.close(adopted_read)
        from rlhf_pipeline.cli.main import main

        code = main(child["argv"])
    except SystemExit as exc:  # argparse's errors, sys.exit(...)
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 (printed as the interpreter would, then exit 1)
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    exit_code = fork_all(int(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # no interpreter teardown (seconds with torch loaded); the children carry on
