"""Synthetic trajectory data for tests: valid, ragged, with non-ASCII text.

Import from any test as ``from helpers import make_batch`` (``tests/conftest.py``
puts this directory on ``sys.path``). Everything is seeded, so two calls with the
same arguments build equal batches.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Sequence

import pytest
import torch

from rlhf_pipeline.schema import OPTIONAL_FIELDS, TrajectoryBatch
from rlhf_pipeline.schema.ragged import RaggedTensor, lengths_to_offsets
from rlhf_pipeline.schema.termination import TerminationReason
from rlhf_pipeline.schema.turn_messages import encode_turn_messages

# Mixed scripts and an emoji, so text round-trips exercise multi-byte UTF-8.
_WORDS = ("the", "answer", "is", "42", "grüße", "naïve", "日本語", "정답", "λόγος", "🙂", "x=y+1", "")


def _text(gen: torch.Generator, n_words: int) -> str:
    picks = torch.randint(0, len(_WORDS), (n_words,), generator=gen).tolist()
    return " ".join(_WORDS[i] for i in picks)


def _ragged(lengths: torch.Tensor, values: torch.Tensor) -> RaggedTensor:
    return RaggedTensor(values, lengths_to_offsets(lengths))


def make_batch(
    n_groups: int,
    group_size: int,
    *,
    seed: int = 0,
    optional: Sequence[str] = (),
    prompt_len: tuple[int, int] = (2, 12),
    response_len: tuple[int, int] = (1, 20),
    first_group_id: int = 0,
    first_trajectory_id: int = 0,
    policy_version: int = 0,
    vocab_size: int = 50_000,
) -> TrajectoryBatch:
    """A valid ``TrajectoryBatch`` of ``n_groups * group_size`` single-turn rows.

    Rows of a group share ``group_id``, prompt tokens and prompt text, as a GRPO
    collector writes them. Lengths are drawn uniformly from the inclusive ranges
    ``prompt_len`` and ``response_len``. ``optional`` names optional fields to
    include, each filled with valid values (finite, aligned with the response).
    """
    unknown = [n for n in optional if n not in OPTIONAL_FIELDS]
    if unknown:
        raise ValueError(f"unknown optional field(s) {unknown}; choose from {OPTIONAL_FIELDS}")
    gen = torch.Generator().manual_seed(seed)
    n = n_groups * group_size

    group_prompt_len = torch.randint(prompt_len[0], prompt_len[1] + 1, (n_groups,), generator=gen)
    group_prompts = [torch.randint(0, vocab_size, (int(k),), generator=gen, dtype=torch.int32)
                     for k in group_prompt_len]
    p_len = group_prompt_len.repeat_interleave(group_size)
    prompt_values = torch.cat([p for p in group_prompts for _ in range(group_size)])
    r_len = torch.randint(response_len[0], response_len[1] + 1, (n,), generator=gen)
    total_r = int(r_len.sum())
    response_values = torch.randint(0, vocab_size, (total_r,), generator=gen, dtype=torch.int32)
    # log-probs strictly below 0, as a sampler's would be
    log_probs = -torch.rand(total_r, generator=gen) * 8.0 - 1e-3

    terminated = torch.rand(n, generator=gen) < 0.7
    group_text = [f"Q{first_group_id + g}: " + _text(gen, 1 + g % 6) for g in range(n_groups)]
    columns = {
        "prompt_tokens": _ragged(p_len, prompt_values),
        "response_tokens": _ragged(r_len, response_values),
        "response_log_probs": _ragged(r_len, log_probs),
        "group_id": torch.arange(first_group_id, first_group_id + n_groups, dtype=torch.int64)
        .repeat_interleave(group_size),
        "trajectory_id": torch.arange(first_trajectory_id, first_trajectory_id + n, dtype=torch.int64),
        "step": torch.zeros(n, dtype=torch.int32),
        "reward": torch.randn(n, generator=gen),
        "done": torch.ones(n, dtype=torch.bool),
        "terminated": terminated,
        "truncated": ~terminated,
        "policy_version": torch.full((n,), policy_version, dtype=torch.int64),
        "prompt_text": [t for t in group_text for _ in range(group_size)],
        "response_text": [_text(gen, int(k) % 7) for k in r_len],
    }
    if "ref_log_probs" in optional:
        columns["ref_log_probs"] = _ragged(r_len, -torch.rand(total_r, generator=gen) * 8.0)
    if "kl" in optional:
        columns["kl"] = _ragged(r_len, torch.rand(total_r, generator=gen) * 0.1)
    if "token_rewards" in optional:
        columns["token_rewards"] = _ragged(r_len, -torch.rand(total_r, generator=gen) * 0.01)
    if "advantage" in optional:
        columns["advantage"] = torch.randn(n, generator=gen)
    if "termination_reason" in optional:  # from the flags, so no other field's draws change
        columns["termination_reason"] = torch.where(terminated, 1, 5).to(torch.int32)  # env done / length
    if "step_advantage" in optional:  # from the rewards: no draw, so no other field changes
        columns["step_advantage"] = columns["reward"] / 2
    calls = (r_len % 3).to(torch.int32)  # from the lengths: no draw, so no other field changes
    if "tool_calls" in optional:
        columns["tool_calls"] = calls
    if "tool_errors" in optional:
        columns["tool_errors"] = (calls == 2).to(torch.int32)
    if "tool_error_kinds" in optional:  # the failed call (of two) was a timeout
        columns["tool_error_kinds"] = torch.where(calls == 2, 16, 0).to(torch.int32)
    if "turn_messages" in optional:  # the row's texts as a turn's messages
        columns["turn_messages"] = [encode_turn_messages([{"role": "user", "content": p},
                                                          {"role": "assistant", "content": r}])
                                    for p, r in zip(columns["prompt_text"], columns["response_text"], strict=True)]
    return TrajectoryBatch(columns)


def assert_same_padded(got, expected) -> None:
    """Fused read-and-pad output equals pad_batch's: same keys, dtypes, shapes, values, views."""
    assert set(got.keys(True, True)) == set(expected.keys(True, True))
    assert got.batch_size == expected.batch_size
    for key in expected.keys(True, True):
        assert got[key].dtype == expected[key].dtype, key
        assert got[key].shape == expected[key].shape, key
        assert torch.equal(got[key], expected[key]), key
    # prompt / response entries stay views into the (B, T) tensors, as pad_batch documents
    assert got["tokens", "prompt"].data_ptr() == got["tokens", "full"].data_ptr()
    assert got["tokens", "response"].data_ptr() == got["tokens", "full"][:, got["tokens", "prompt"].shape[1]:].data_ptr()


# multi-turn trajectories, two per group: (turns, termination reason, reward of each turn)
TRAJECTORIES = [(3, TerminationReason.ENV_DONE, 1.0), (1, TerminationReason.TOOL_ERROR, 0.0),
                (4, TerminationReason.MAX_TURNS, 0.25), (2, TerminationReason.ENV_DONE, 0.5),
                (1, TerminationReason.ENV_DONE, 1.0), (5, TerminationReason.TOKEN_BUDGET, 0.0)]


def multi_turn_rows(first_trajectory: int = 0, *, tool_counts: bool = False) -> TrajectoryBatch:
    """The rows of :data:`TRAJECTORIES`, one per turn, as an agent collector writes them (with termination_reason).

    ``tool_counts`` adds ``tool_calls`` / ``tool_errors`` / ``tool_error_kinds``: 2 calls on every
    turn but the last, 1 failed (malformed) call on the last turn of the TOOL_ERROR trajectory, and
    1 of 2 failed (timeout) on turn 2 of the 5-turn one; per trajectory (calls, errors): (4, 0),
    (1, 1), (6, 0), (2, 0), (0, 0), (8, 1)."""
    rows, gen = [], torch.Generator().manual_seed(first_trajectory)
    for t, (turns, reason, reward) in enumerate(TRAJECTORIES):
        for step in range(turns):
            last = step == turns - 1
            response = int(torch.randint(1, 9, (1,), generator=gen))
            rows.append({
                "prompt_tokens": torch.arange(3, dtype=torch.int32) + step,
                "response_tokens": torch.arange(response, dtype=torch.int32),
                "response_log_probs": torch.full((response,), -0.5),
                "group_id": (first_trajectory + t) // 2, "trajectory_id": first_trajectory + t, "step": step,
                "reward": reward, "policy_version": 0, "done": last,
                "terminated": last and reason.terminated, "truncated": last and reason.truncated,
                "termination_reason": int(reason if last else TerminationReason.NOT_ENDED),
                "prompt_text": f"env {step}", "response_text": "x" * response,
            })
            if tool_counts:
                calls = 1 if reason is TerminationReason.TOOL_ERROR else (0 if last else 2)
                failed = calls if reason is TerminationReason.TOOL_ERROR else int(turns == 5 and step == 2)
                kinds = 1 if reason is TerminationReason.TOOL_ERROR else 16 * failed  # malformed / timeout
                rows[-1].update(tool_calls=calls, tool_errors=failed, tool_error_kinds=kinds)
    return TrajectoryBatch.from_rows(rows)


def run_child_pids(role: str, *needles: str) -> list[int]:
    """The children of a ``run`` in the role ``role`` (``"collect"``, ``"collect-1"`` for collector 1,
    ``"learn"``; ``"replay"``, ``"replay-1"`` for a replay's ranks) whose command line holds every
    needle (e.g. the run's home and name).

    ``run`` forks its children from one process (``rlhf_pipeline/runs/forking.py``): they share that
    process's command line, which holds every child's arguments (or ``run``'s own, where ``run`` forked
    them itself: ``tests/preloaded.py``), and each names its thread after its role (``rlhf-collect``,
    ``rlhf-collect-1``, ``rlhf-learn``). A child started with an interpreter of its own (where ``run``
    cannot fork) is told by its own command line."""
    from pathlib import Path

    command, _, index = role.partition("-")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0")]
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if not all(any(n in w for w in words) for n in needles):
            continue
        if comm.startswith("rlhf-"):
            if comm == f"rlhf-{role}":
                found.append(int(entry.name))
        elif "rlhf_pipeline.cli.main" in words and command in words:
            at = words.index("--collector-index") + 1 if "--collector-index" in words else None
            if (words[at] if at is not None else "0") == (index or "0"):
                found.append(int(entry.name))
    return found


def kill_when(process, condition, *, victims=None, whole_group: bool = False, timeout: float = 300,
              poll_s: float = 0.05, wait_s: float = 240):
    """Waits until ``condition()`` is true, then sends SIGKILL to ``process``, or to the one pid that
    ``victims()`` returns (a child of it: ``run_child_pids``), and returns what ``process`` printed
    (its stdout, or its stderr where only that was piped).

    The kill and resume tests differ only in what they wait for (a metrics line, a checkpoint at a URL,
    a collector round, rows in a shard) and whom they kill. Waiting also ends when ``process`` exits or
    after ``timeout`` s; the kill is sent then too, and the test's own checks (the return code, how
    far the run got) say what went wrong. ``whole_group``: the kill goes to ``process``'s process group
    (a launcher started with ``start_new_session=True``, its learner and collectors at once).
    ``process`` is killed if it still runs when this returns.
    Keep ``condition`` cheap: it runs every ``poll_s`` s."""
    import os
    import signal
    import time

    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and process.poll() is None and not condition():
            time.sleep(poll_s)
        if whole_group:
            os.killpg(process.pid, signal.SIGKILL)
        elif victims is None:
            process.send_signal(signal.SIGKILL)  # a no-op once it has exited: its return code tells
        else:
            pids = victims()
            assert len(pids) == 1, (pids, process.poll())
            os.kill(pids[0], signal.SIGKILL)
        out, err = process.communicate(timeout=wait_s)
    finally:
        if process.poll() is None:
            process.kill()
    return out if out is not None else err


def process_running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited: its parent may be slow to reap it)."""
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@contextlib.contextmanager
def killed_with_next_request(engine):
    """Within it, the next request ``engine`` is sent finds its server killed (kill -9) with that
    request unanswered: the server is stopped (SIGSTOP) before the request goes, so no reply can
    come, and killed once it is submitted. The kill lands inside the round (or turn) that sends the
    request by construction, whatever the machine's load: counting the server's CPU time raced the
    round's end. Yields an event set once the kill is sent."""
    import os
    import signal
    import threading

    pid, submit, killed = engine.pid, engine.submit, threading.Event()

    def submit_to_a_server_killed_meanwhile(*args, **kwargs):
        if killed.is_set():
            return submit(*args, **kwargs)
        os.kill(pid, signal.SIGSTOP)
        try:
            return submit(*args, **kwargs)
        finally:
            os.kill(pid, signal.SIGKILL)
            killed.set()

    engine.submit = submit_to_a_server_killed_meanwhile  # the instance's: the collector calls engine.submit
    try:
        yield killed
    finally:
        del engine.submit


def import_benchmark(name: str):
    """The module of ``benchmarks/<name>.py`` (scripts, not a package: imported by path for the test)."""
    import importlib
    import sys
    from pathlib import Path

    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(benchmarks)


def command_here(capsys, *args: str):
    """``rlhf-pipeline ARGS`` run in this process (``main``), its exit code and what it printed as a
    ``subprocess.CompletedProcess``: for a command of one process (one that reads or evaluates a run,
    or refuses), which a new process would pay seconds of CPU to import torch and the pipeline for."""
    import subprocess

    from rlhf_pipeline.cli.main import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def run_on_terminal(argv: Sequence[str], *, cwd=None, timeout: float = 300, columns: int = 120) -> tuple[int, bytes]:
    """Runs ``argv`` with stdin, stdout and stderr on a new pseudo-terminal of ``columns`` columns
    (what a user at a terminal sees: tqdm bars, colours); returns its exit code and every byte it
    wrote there. Killed after ``timeout`` seconds (exit code then negative)."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import subprocess
    import termios
    import time

    master, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    process = subprocess.Popen(list(argv), cwd=cwd, stdin=follower, stdout=follower, stderr=follower,
                               start_new_session=True)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer of the terminal is gone
                    break
                if not data:
                    break
                chunks.append(data)
            elif process.poll() is not None:
                break
        else:
            process.kill()
    finally:
        os.close(master)
    return process.wait(), b"".join(chunks)


def screen_lines(shown: bytes) -> list[str]:
    """The lines a terminal shows after receiving ``shown``: ``\\r`` returns to the line's start,
    later characters overwrite earlier ones, ``ESC[K`` erases to the end of the line; other
    escape sequences are dropped."""
    import re

    text = shown.decode("utf-8", errors="replace")
    lines: list[str] = []
    line: list[str] = []
    column = 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]", text):
        if token == "\x1b[K":
            del line[column:]
        elif token.startswith("\x1b"):
            continue
        elif token == "\r":
            column = 0
        elif token == "\n":
            lines.append("".join(line))
            line, column = [], 0
        else:
            if column < len(line):
                line[column] = token
            else:
                line.append(token)
            column += 1
    if line:
        lines.append("".join(line))
    return lines


def into(rows: list) -> Callable[..., None]:
    """A collector's sink that keeps the rows of each call in ``rows``, its writer state aside."""
    def sink(batch: TrajectoryBatch | None, writer_state: dict | None = None) -> None:
        if batch is not None:
            rows.append(batch)
    return sink


class Crash(Exception):
    """Stands for kill -9: nothing after the raise point runs."""


def store_sink(store, *, crash_before: int | None = None, crash_after: int | None = None) -> Callable[..., None]:
    """A collector's sink as a run's: ``make_replay_buffer(store).extend``, each call publishing its
    rows with the collector's state; ``crash_before`` / ``crash_after=k``: :class:`Crash` before or
    after the k-th call's append."""
    from rlhf_pipeline.storage import make_replay_buffer

    buffer, calls = make_replay_buffer(store), 0

    def sink(batch: TrajectoryBatch | None, writer_state: dict) -> None:
        nonlocal calls
        calls += 1
        if calls == crash_before:
            raise Crash
        buffer.extend(batch, writer_state=writer_state)
        if calls == crash_after:
            raise Crash
    return sink


def resume(collector, store) -> dict | None:
    """Restores ``collector`` from the state ``store``'s last append published, as ``collect_main``
    does; returns that state (None: none, a new collector)."""
    from rlhf_pipeline.storage.writer_state import decode

    published = decode(store.writer_state, store.location)
    if published is not None:
        collector.load_state_dict(published["writer"])
    return None if published is None else published["writer"]


def different_weights(model, seed: int):
    """``model``'s weights moved by a seeded noise (a tied head with its embedding): another version's."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return {k: v.clone() for k, v in model.state_dict().items()}


needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="LoRA needs peft: pip install -e '.[lora]'")
"""For a test of LoRA (learner.lora.rank > 0): peft is the optional [lora] extra."""


@contextlib.contextmanager
def a_holder_that_dies_once_waited_on(renew: Callable[[], None], *, every_s: float = 0.5):
    """A writer lock held by a process on another machine: ``renew`` (a PUT of its ``writer.lock``) is
    called now and every ``every_s`` until a writer logs that it waits for it, then never again, as if
    that process died then. However loaded the machine, the writer finds the lock live and waits out its
    lease (a lock written once could run out before the writer first looks)."""
    import logging
    import threading

    waited_on = threading.Event()

    class WaitSeen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for the writer lock" in record.getMessage():
                waited_on.set()

    log = logging.getLogger("rlhf_pipeline.storage.zarr.object_store")
    handler, level = WaitSeen(logging.WARNING), log.level
    log.addHandler(handler)
    log.setLevel(logging.WARNING if level in (logging.NOTSET,) or level > logging.WARNING else level)

    def keep_renewing() -> None:
        while not waited_on.wait(every_s):
            renew()

    renew()
    renewer = threading.Thread(target=keep_renewing, name="dead-holder", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        waited_on.set()
        renewer.join()
        log.removeHandler(handler)
        log.setLevel(level)


def fill(disk, leave_bytes: int):
    """A file taking all of ``disk``'s free space but ``leave_bytes`` (``small_disk``, tests/conftest.py)."""
    import os

    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    filler = disk / "filler"
    with open(filler, "wb") as out:
        os.posix_fallocate(out.fileno(), 0, max(free - leave_bytes, 1))
    return filler
