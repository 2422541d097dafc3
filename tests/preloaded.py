"""The tests' ``rlhf-pipeline`` commands, forked from a Python process that imported torch & co. once.

``preloaded.run(command, ...)`` and ``preloaded.Popen(command, ...)`` take what ``subprocess.run`` and
``subprocess.Popen`` take. A command ``[sys.executable, "-m", "rlhf_pipeline.cli.main", ...]`` runs
as a fork of a preloaded process; any other command, or an option a fork cannot honour
(``pass_fds``, another ``PYTHONPATH``, a working directory with a package of its own), runs as a real
subprocess.

Why: a short run spends most of its CPU importing torch, tensordict (which imports
``torch._dynamo``) and transformers, once in ``run`` and once in the process that forks its children
(docs/development.md#how-long-it-takes). A process per pytest worker pays that once; each command is a
fork of it, and a ``run`` forked so forks its own children without importing again
(``rlhf_pipeline/runs/forking.py``).

What a forked command gets is what ``exec`` would give it: its arguments (``sys.argv`` and
``/proc/PID/cmdline``, which ``ps`` and ``tests/helpers.run_child_pids`` read), working directory,
environment, standard streams and no other descriptor, signals at their defaults, a session of its
own with ``start_new_session``, and its exit code, or minus the signal that ended it, as
``returncode``. What differs: its parent is the preloaded process, not the test; and the variables a
Python process or torch reads once at start (threads, locale, offline switches) are those the
preloaded process started with, so each distinct set of them gets a preloaded process of its own.
Tests whose subject is the start itself (signals to ``run``, the README's commands, start-up time)
use ``subprocess``.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib.util
import io
import json
import locale
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = [sys.executable, "-m", "rlhf_pipeline.cli.main"]
REPO = Path(__file__).resolve().parents[1]
# read once when Python or torch starts: a command that sets them differently gets a preloaded
# process started with its values
START_VARIABLES = ("OMP_", "MKL_", "OPENBLAS_", "TORCH", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "LANG", "LC_",
                   "PYTHON")
MOST_PRELOADED = 3  # a test process's preloaded processes; past that, a command runs as a subprocess
# which code runs: a command that changes these runs as a subprocess
CODE_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONSTARTUP", "PYTHONUSERBASE")
COMMAND_LINE_ROOM = 32768  # bytes of /proc/PID/cmdline a forked command can show: the preloaded
# process's last argument, which each fork overwrites with its own command line
POPEN_OPTIONS = {"cwd", "env", "stdin", "stdout", "stderr", "text", "universal_newlines", "encoding", "errors",
                 "start_new_session", "bufsize"}
DISABLE = "RLHF_PIPELINE_TESTS_SUBPROCESS"  # =1: every command a real subprocess (to compare the two)


def Popen(command, **options):  # noqa: N802 (subprocess's name)
    """``subprocess.Popen(command, **options)``, forked from a preloaded process where it can be."""
    preloaded = _preloaded_for(command, options)
    if preloaded is None:
        return subprocess.Popen(command, **options)
    return ForkedCommand(preloaded, command, **options)


def run(command, *, input=None, capture_output=False, timeout=None, check=False,  # noqa: A002
        **options) -> subprocess.CompletedProcess:
    """``subprocess.run(command, ...)``, forked from a preloaded process where it can be."""
    if capture_output:
        options["stdout"] = options["stderr"] = subprocess.PIPE
    if input is not None:
        options["stdin"] = subprocess.PIPE
    with Popen(command, **options) as process:
        try:
            out, err = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
    if check and process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command, out, err)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _preloaded_for(command, options: dict) -> _Preloaded | None:
    """The preloaded process that can run ``command`` as a fork (started on first use); None: a
    real subprocess must."""
    if os.environ.get(DISABLE) == "1" or not sys.platform.startswith("linux"):
        return None
    if not isinstance(command, (list, tuple)) or list(command[:3]) != CLI or set(options) - POPEN_OPTIONS:
        return None
    if len("\0".join(map(str, command)).encode()) >= COMMAND_LINE_ROOM:
        return None
    env = os.environ if options.get("env") is None else options["env"]
    if any(env.get(name) != os.environ.get(name) for name in CODE_VARIABLES):
        return None
    package = Path(options.get("cwd") or os.getcwd()) / "rlhf_pipeline"
    if package.is_dir() and package.resolve() != REPO / "rlhf_pipeline":  # `-m` would import that one
        return None
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(START_VARIABLES)))
    if key not in _started:
        if len(_started) == MOST_PRELOADED:
            return None
        _started[key] = _Preloaded(dict(key))
    return _started[key]


class _Preloaded:
    """The test process's handle on one preloaded process: started with the test process's
    environment but for ``start_variables``; it exits when the test process does (its watch pipe
    closes)."""

    def __init__(self, start_variables: dict[str, str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(START_VARIABLES)} | start_variables
        self.socket_path = os.path.join(tempfile.mkdtemp(prefix="preloaded-"), "socket")
        watch_read, self._watch = os.pipe()
        try:
            self._process = subprocess.Popen([sys.executable, __file__, self.socket_path, str(watch_read),
                                              "-" * COMMAND_LINE_ROOM], env=env, cwd=REPO, pass_fds=(watch_read,),
                                             stdout=subprocess.PIPE, text=True)
        finally:
            os.close(watch_read)
        if self._process.stdout.readline() != "ready\n":  # its error is on the test's stderr
            self._process.wait()
            raise RuntimeError(f"the preloaded process failed to start (exit code {self._process.returncode})")
        atexit.register(self.close)

    def close(self) -> None:
        os.close(self._watch)  # it exits on the end of file
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        shutil.rmtree(os.path.dirname(self.socket_path), ignore_errors=True)


_started: dict[tuple, _Preloaded] = {}


class ForkedCommand:
    """A command forked by a preloaded process: what ``subprocess.Popen`` offers a test (``pid``,
    ``args``, ``stdin``/``stdout``/``stderr``, ``poll``, ``wait``, ``communicate``, ``send_signal``,
    ``terminate``, ``kill``, ``returncode``, a context manager). Its code comes on a socket from the
    preloaded process, which reaps it; signals go through a pidfd, so none can reach another
    process that took its pid."""

    def __init__(self, preloaded: _Preloaded, command, *, cwd=None, env=None, stdin=None, stdout=None,
                 stderr=None, text=None, universal_newlines=None, encoding=None, errors=None,
                 start_new_session=False, bufsize=-1) -> None:
        self.args = command
        self.returncode: int | None = None
        self._text = bool(text or universal_newlines or encoding or errors)
        self._encoding = encoding or locale.getpreferredencoding(False)
        self._errors = errors or "strict"
        self.stdin = self.stdout = self.stderr = None
        theirs: list[int] = []  # the command's fds 0-2, sent to the preloaded process then closed here
        try:
            theirs.append(self._end(stdin, 0, bufsize, reading=False))
            theirs.append(self._end(stdout, 1, bufsize, reading=True))
            theirs.append(os.dup(theirs[1]) if stderr == subprocess.STDOUT else self._end(stderr, 2, bufsize,
                                                                                           reading=True))
            request = {"words": [str(w) for w in command], "argv": [str(w) for w in command[3:]],
                       "cwd": str(cwd or os.getcwd()), "env": dict(os.environ if env is None else env),
                       "new_session": bool(start_new_session)}
            self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._connection.connect(preloaded.socket_path)
            socket.send_fds(self._connection, [json.dumps(request).encode()], theirs)
        finally:
            for fd in theirs:
                os.close(fd)
        self._received = b""
        started = self._line(None)
        if not started.isdigit():  # its start failed as exec would have: chdir, ...
            self._connection.close()
            raise OSError(started)
        self.pid = int(started)
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:  # it already ended (and was reaped): its code is on the way
            self._pidfd = None

    def _end(self, spec, fd: int, bufsize: int, *, reading: bool) -> int:
        """The command's end of one standard stream, as ``subprocess`` makes it; a pipe's other end
        becomes ``self.stdin``/``stdout``/``stderr``."""
        if spec == subprocess.PIPE:
            read, write = os.pipe()
            mine, theirs = (read, write) if reading else (write, read)
            stream = io.open(mine, "rb" if reading else "wb", bufsize)  # noqa: SIM115
            if self._text:
                stream = io.TextIOWrapper(stream, encoding=self._encoding, errors=self._errors,
                                          write_through=not reading)
            setattr(self, ("stdin", "stdout", "stderr")[fd], stream)
            return theirs
        if spec == subprocess.DEVNULL:
            return os.open(os.devnull, os.O_RDWR)
        if spec is None:
            return os.dup(fd)
        return os.dup(spec if isinstance(spec, int) else spec.fileno())

    def _line(self, timeout: float | None) -> str | None:
        """The preloaded process's next line about this command; None if none came in ``timeout``."""
        while b"\n" not in self._received:
            ready, _, _ = select.select([self._connection], [], [], timeout)
            if not ready:
                return None
            chunk = self._connection.recv(256)
            if not chunk:
                raise RuntimeError(f"the preloaded process that ran {self.args} ended before the command")
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._ended(self._line(0))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._ended(self._line(timeout)):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _ended(self, line: str | None) -> bool:
        if line is None:
            return False
        self.returncode = int(line)
        self._connection.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return True

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:  # it ended meanwhile: its code tells
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input=None, timeout: float | None = None):  # noqa: A002
        """As ``Popen.communicate``: writes ``input``, reads the piped streams to their end, waits."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = b""
        if self.stdin is not None:
            if input:
                pending = input.encode(self._encoding, self._errors) if self._text else input
            self.stdin.flush()
        streams = (self.stdout, self.stderr)
        fds = [None if s is None or s.closed else s.fileno() for s in streams]
        readers = {fd: s for fd, s in zip(fds, streams) if fd is not None}
        chunks: dict[int, list[bytes]] = {fd: [] for fd in readers}
        writing = self.stdin is not None and not self.stdin.closed
        while readers or writing:
            if not pending and writing:
                self.stdin.close()
                writing = False
                continue
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            readable, writable, _ = select.select(list(readers), [self.stdin.fileno()] if writing else [], [], left)
            for fd in writable:
                try:
                    pending = pending[os.write(fd, pending[:65536]):]
                except BrokenPipeError:  # it stopped reading: as Popen, the rest is dropped
                    pending = b""
            for fd in readable:
                data = os.read(fd, 65536)
                if data:
                    chunks[fd].append(data)
                else:
                    readers.pop(fd).close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return tuple(None if stream is None else self._decoded(chunks.get(fd, [])) for stream, fd in zip(streams, fds))

    def _decoded(self, chunks: list[bytes]):
        data = b"".join(chunks)
        if not self._text:
            return data
        return data.decode(self._encoding, self._errors).replace("\r\n", "\n").replace("\r", "\n")

    def __enter__(self) -> ForkedCommand:
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None and not stream.closed:
                try:
                    stream.close()
                except BrokenPipeError:
                    pass
        self.wait()


# ---------------------------------------------------------------------------------------------------
# The preloaded process (this file run as a script)


def serve(socket_path: str, watch_fd: int) -> None:
    """Imports what ``run``'s children import, then forks a command for each request on
    ``socket_path`` and reports its exit code there; exits when ``watch_fd`` reaches its end."""
    from rlhf_pipeline.runs.forking import runs_one_thread
    from rlhf_pipeline.runs.launch import preload

    import rlhf_pipeline.cli.main  # noqa: F401

    preload("collect")
    preload("learn")
    if not runs_one_thread():
        raise RuntimeError("importing started a Python thread: forks of this process could inherit a lock it held")
    gc.freeze()  # what every fork shares stays out of their collections (and unwritten: shared pages)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    print("ready", flush=True)
    running: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the connection that asked)
    while True:
        readable, _, _ = select.select([listener, watch_fd, *running], [], [])
        if watch_fd in readable:
            return
        for fd in readable:
            if fd in running:
                pid, connection = running.pop(fd)
                _, status = os.waitpid(pid, 0)
                os.close(fd)
                try:
                    connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:  # the test gave up on it
                    pass
                connection.close()
            elif fd is listener:
                connection, _ = listener.accept()
                started = _fork_command(connection)
                if started is not None:
                    running[os.pidfd_open(started)] = (started, connection)


def _fork_command(connection: socket.socket) -> int | None:
    """Forks the command ``connection`` asks for; replies its pid once it has started (or why it
    could not), and returns the pid."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    request = json.loads(message)
    started_read, started_write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _become_command(request, fds, started_write)
    os.close(started_write)
    for fd in fds:
        os.close(fd)
    with os.fdopen(started_read, "rb") as started:
        failed = started.read().decode()  # nothing: it started (the pipe closed on its own)
    if failed:
        os.waitpid(pid, 0)
        connection.sendall(f"{failed.replace(chr(10), ' ')}\n".encode())
        connection.close()
        return None
    connection.sendall(f"{pid}\n".encode())
    return pid


def _become_command(request: dict, fds: list[int], started_write: int) -> None:
    """In the fork: sets itself up as ``exec`` would have, says so on ``started_write``, runs the
    command line and exits with its code."""
    from rlhf_pipeline.runs.forking import (close_descriptors_but, exit_at_once, run_command,
                                            start_as_a_new_interpreter)

    code = 1
    try:
        try:
            if request["new_session"]:
                os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            close_descriptors_but({started_write})
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            _show_command_line(request["words"])
            sys.argv = [importlib.util.find_spec("rlhf_pipeline.cli.main").origin, *request["argv"]]
            sys.path[0] = request["cwd"]  # where `python -m` looks first
            tempfile.tempdir = None  # found again from the command's TMPDIR, had an import asked for it
            start_as_a_new_interpreter()
        except OSError as exc:
            os.write(started_write, f"{type(exc).__name__}: {exc}".encode())
            os._exit(1)
        os.close(started_write)
        code = run_command(request["argv"])
        atexit._run_exitfuncs()  # what the interpreter runs on its way out (logging's flush, ...)
    finally:
        exit_at_once(code)


def _show_command_line(words: list[str]) -> None:
    """Writes ``words`` over this process's argument area, which ``/proc/PID/cmdline`` (and ``ps``)
    read: the preloaded process's room, left by its last argument."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49
    shown = "\0".join(words).encode() + b"\0"
    ctypes.memmove(start, shown.ljust(end - start, b"\0")[:end - start], end - start)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
