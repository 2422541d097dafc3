"""The benchmarks page's figures, kept by the commands that measure them.

``rlhf-pipeline bench NAME ... --page docs/benchmarks.md`` runs the benchmark as usual, then puts
what it printed on the page, in a block that also says when, on which commit and machine, and
under what load it ran. A block belongs to its command line: running the same command again
replaces it; another command adds its own block after the opening text of the section whose heading
names ``rlhf-pipeline bench NAME`` (before its first subsection). Prose around the blocks is left
alone. Design: docs/benchmarks.md#how-the-page-is-kept."""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rlhf_pipeline.files.atomic import write_atomic

BLOCK_OPEN = "<!-- bench-record: {command} -->"
BLOCK_CLOSE = "<!-- /bench-record -->"
_BLOCK = re.compile(r"^<!-- bench-record: (?P<command>.+?) -->\n(?P<body>.*?)^<!-- /bench-record -->\n",
                    re.M | re.S)
CHECKOUT = Path(__file__).resolve().parents[2]  # the repository, when the package runs from one
_HEADING = re.compile(r"^(?P<hashes>#{1,6}) (?P<title>.*)$", re.M)


class PageError(ValueError):
    """The page cannot take the record (no section for the benchmark, a block left unclosed)."""


@dataclass
class RunConditions:
    """What a figure depends on besides the code: the machine, the install and its load."""

    started_utc: str
    commit: str
    machine: str
    install: str
    wall_s: float
    load_low: float
    load_high: float

    def sentence(self) -> str:
        return (f"{self.started_utc}, {self.commit}; {self.machine}; {self.install}; "
                f"load average {self.load_low:.1f}-{self.load_high:.1f} over its {self.wall_s:.0f} s")


class LoadWatch:
    """Samples the 1-minute load average every ``every_s`` while a benchmark runs: the range is
    what a reader compares their own run's conditions against."""

    def __init__(self, every_s: float = 2.0) -> None:
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="bench-load-watch", daemon=True)

    def _watch(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> LoadWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])


class Tee:
    """Writes to the terminal's stream and keeps a copy: the benchmark's printed output, unchanged."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):  # isatty, encoding, fileno: the terminal's
        return getattr(self.stream, name)

    def text(self) -> str:
        return "".join(self.parts)


def command_line(argv: list[str]) -> str:
    """The command a block belongs to: ``argv`` (after ``rlhf-pipeline``) without ``--page``."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--page":
            skip = True
        elif not arg.startswith("--page="):
            kept.append(arg)
    return "rlhf-pipeline " + shlex.join(kept)


def conditions(started: float, wall_s: float, loads: list[float], page: Path) -> RunConditions:
    return RunConditions(
        started_utc=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        commit=_commit(page), machine=_machine(), install=_install(), wall_s=wall_s,
        load_low=min(loads), load_high=max(loads))


def _commit(page: Path, checkout: Path = CHECKOUT) -> str:
    """The checkout's commit, and whether files other than the page differ from it (the page itself
    does from the second record on)."""
    page = page.resolve()
    not_the_page = [f":(exclude){page}"] if checkout in page.parents else []
    git = ["git", "-C", str(checkout)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short=8", "HEAD"],
                              capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", ".", *not_the_page],
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"rlhf-pipeline {version('rlhf-pipeline')} (not a git checkout)"
        except PackageNotFoundError:
            return "not a git checkout"
    return f"commit {head}" + (" with uncommitted changes" if changed else "")


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} CPU cores ({model})"


def _install() -> str:
    import torch

    return f"Python {platform.python_version()}, torch {torch.__version__}"


def block(command: str, output: str, run: RunConditions) -> str:
    return (f"{BLOCK_OPEN.format(command=command)}\n"
            f"*Recorded by `{command} --page docs/benchmarks.md`* ({run.sentence()}); another machine of this "
            f"kind gives other absolute figures, so compare the ratios, at a similar load.\n\n"
            f"{as_markdown(output)}\n{BLOCK_CLOSE}\n")


def as_markdown(output: str) -> str:
    """The benchmarks print Markdown tables between lines of text: each text line becomes its own
    paragraph (Markdown would run them together); ``--json`` output goes in a fence."""
    output = output.strip("\n")
    if output.startswith(("[", "{")):
        fence = "```"
        while fence in output:  # a printed fence must not close ours
            fence += "`"
        return f"{fence}json\n{output}\n{fence}\n"
    paragraphs, table = [], []
    for line in output.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            paragraphs.append("\n".join(table))
            table = []
        if line.strip():
            paragraphs.append(line.rstrip())
    if table:
        paragraphs.append("\n".join(table))
    return "\n\n".join(paragraphs) + "\n"


def blocks(page_text: str) -> dict[str, str]:
    """Every recorded block on a page: command line -> body. Raises :class:`PageError` on a block
    opened and never closed (a hand edit), which the next record would otherwise swallow."""
    return {command: match["body"] for command, match in _block_matches(page_text).items()}


def _block_matches(page_text: str) -> dict[str, re.Match]:
    found = {match["command"]: match for match in _BLOCK.finditer(page_text)}
    opened = page_text.count("<!-- bench-record: ")
    if opened != len(found) or page_text.count(BLOCK_CLOSE) != len(found):
        raise PageError(f"{opened} '<!-- bench-record: ... -->' lines but {len(found)} whole blocks: "
                        f"each needs its own '{BLOCK_CLOSE}' line after it")
    return found


def section_of(page_text: str, benchmark: str) -> tuple[int, int]:
    """Start and end offsets of the opening text of the section whose heading names
    ``rlhf-pipeline bench BENCHMARK``: up to the next heading, its first subsection's or another's."""
    headings = list(_HEADING.finditer(page_text))
    named = re.compile(rf"`rlhf-pipeline bench {re.escape(benchmark)}[` ]")
    for index, heading in enumerate(headings):
        if named.search(heading["title"]):
            end = headings[index + 1].start() if index + 1 < len(headings) else len(page_text)
            return heading.start(), end
    raise PageError(f"no heading names `rlhf-pipeline bench {benchmark}`: add a section headed, say, "
                    f"'## {benchmark}: `rlhf-pipeline bench {benchmark}`' and run the command again")


def keep_on_page(page: Path, benchmark: str, command: str, new_block: str) -> str:
    """Puts ``new_block`` on ``page``: in place of the block of the same command, or after the opening
    text of the benchmark's section. The page is replaced whole or not at all. Returns what was done."""
    text = page.read_text()
    same_command = _block_matches(text).get(command)
    if same_command is not None:
        updated = text[:same_command.start()] + new_block + text[same_command.end():]
        done = "replaced its block"
    else:
        _, end = section_of(text, benchmark)
        before = text[:end].rstrip("\n") + "\n\n"
        after = text[end:]
        updated = before + new_block + ("\n" + after if after else "")
        done = "added a block"
    write_atomic(page, lambda file: file.write(updated.encode()), durable=False)
    return done


def run_and_keep(run_benchmark, *, argv: list[str], benchmark: str, page: Path) -> int:
    """Runs ``run_benchmark()`` with its stdout kept, then records it on ``page`` when it succeeded."""
    if not page.is_file():  # said before the benchmark runs, not after it
        raise PageError(f"--page {page}: no such file; name the benchmarks page, docs/benchmarks.md in the "
                        f"repository")
    blocks(page.read_text())
    command = command_line(argv)
    tee = Tee(sys.stdout)
    started = time.time()
    watch = LoadWatch()
    with watch:
        sys.stdout = tee
        try:
            code = run_benchmark()
        finally:
            sys.stdout = tee.stream
    if code != 0:
        print(f"rlhf-pipeline bench {benchmark}: exited {code}; {page} not changed", file=sys.stderr)
        return code
    run = conditions(started, time.time() - started, watch.samples, page)
    done = keep_on_page(page, benchmark, command, block(command, tee.text(), run))
    print(f"rlhf-pipeline bench {benchmark}: {done} on {page} ({command})", file=sys.stderr)
    return 0
