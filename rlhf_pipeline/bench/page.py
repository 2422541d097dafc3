"""The benchmarks page's figures, kept by the commands that measure them.

``rlhf-pipeline bench NAME ... --page docs/benchmarks.md``, or a script of ``benchmarks/`` run with
``--page docs/benchmarks.md`` (:func:`script_main`), runs the benchmark as usual, then puts what it
printed on the page, in a block that also says when, on which commit and machine, and under what
load it ran. A block belongs to its command line: the same command again replaces it; another adds
its own block after the opening text of the section whose heading names the benchmark
(``rlhf-pipeline bench NAME`` or ``benchmarks/<script>.py``). Prose around the blocks is left alone.
Design: docs/benchmarks.md#how-the-page-is-kept."""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import subprocess
import sys
import textwrap
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


PAGE_HELP = ("also keep what this prints on the benchmarks page PAGE (docs/benchmarks.md), with the date, "
             "commit, machine and load: it replaces this command's block there, or adds one to the section "
             "whose heading names this benchmark")


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


def command_line(words: list[str]) -> str:
    """The command a block belongs to: ``words`` without ``--page PAGE`` (or an abbreviation of it,
    which argparse took for it)."""
    kept, skip = [], False
    for word in words:
        option = word.split("=", 1)[0]
        if skip:
            skip = False
        elif len(option) > 2 and "--page".startswith(option):
            skip = "=" not in word
        else:
            kept.append(word)
    return shlex.join(kept)


def section_name(command: str) -> str:
    """What the heading of ``command``'s section names: ``rlhf-pipeline bench NAME`` for a ``bench``
    command, the script's path for ``python benchmarks/<script>.py ...``."""
    words = shlex.split(command)
    return " ".join(words[:3]) if words[0] == "rlhf-pipeline" else words[1]


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
    paragraph (Markdown would run them together). Output with no Markdown table (``--json``, a script's
    fixed-width columns) goes in a fence, as printed."""
    output = output.strip("\n")
    is_json = output.startswith(("[", "{"))
    if is_json or not any(line.startswith("|") for line in output.splitlines()):
        fence = "```"
        while fence in output:  # a printed fence must not close ours
            fence += "`"
        return f"{fence}{'json' if is_json else 'text'}\n{output}\n{fence}\n"
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


def section_of(page_text: str, name: str) -> tuple[int, int]:
    """Start and end offsets of the opening text of the section whose heading names ``name`` in
    backticks (:func:`section_name`): up to the next heading, its first subsection's or another's."""
    headings = list(_HEADING.finditer(page_text))
    named = re.compile(rf"`{re.escape(name)}[` ]")
    for index, heading in enumerate(headings):
        if named.search(heading["title"]):
            end = headings[index + 1].start() if index + 1 < len(headings) else len(page_text)
            return heading.start(), end
    title = name.rsplit(" ", 1)[-1].removesuffix(".py").removeprefix("benchmarks/")
    raise PageError(f"no heading names `{name}`: add a section headed, say, '## {title}: `{name}`' and run "
                    f"the command again")


def keep_on_page(page: Path, command: str, new_block: str) -> str:
    """Puts ``new_block`` on ``page``: in place of the block of the same command, or after the opening
    text of the command's section. The page is replaced whole or not at all. Returns what was done."""
    text = page.read_text()
    same_command = _block_matches(text).get(command)
    if same_command is not None:
        updated = text[:same_command.start()] + new_block + text[same_command.end():]
        done = "replaced its block"
    else:
        _, end = section_of(text, section_name(command))
        before = text[:end].rstrip("\n") + "\n\n"
        after = text[end:]
        updated = before + new_block + ("\n" + after if after else "")
        done = "added a block"
    write_atomic(page, lambda file: file.write(updated.encode()), durable=False)
    return done


def run_and_keep(run_benchmark, *, command: str, page: Path) -> int:
    """Runs ``run_benchmark()`` with its stdout kept, then records it on ``page`` as ``command``'s
    block when it succeeded."""
    if not page.is_file():  # said before the benchmark runs, not after it
        raise PageError(f"--page {page}: no such file; name the benchmarks page, docs/benchmarks.md in the "
                        f"repository")
    section = section_name(command)
    text = page.read_text()
    section_of(text, section)  # a page without the section, or with a block left open: said before the run too
    blocks(text)
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
        print(f"{section}: exited {code}; {page} not changed", file=sys.stderr)
        return code
    run = conditions(started, time.time() - started, watch.samples, page)
    done = keep_on_page(page, command, block(command, tee.text(), run))
    print(f"{section}: {done} on {page} ({command})", file=sys.stderr)
    return 0


def script_main(script: str, main, argv: list[str]) -> int:
    """A script of ``benchmarks/`` as a command: ``main(argv)``, and with ``--page PAGE`` among
    ``argv`` (taken out before ``main`` parses the rest) its output recorded on PAGE as
    ``python benchmarks/<script>.py ...``'s block. A refused page is one line and exit code 2."""
    taker = argparse.ArgumentParser(prog=Path(script).name, add_help=False, allow_abbrev=False, exit_on_error=False)
    taker.add_argument("--page", type=Path)
    try:
        page, rest = taker.parse_known_args(argv)
    except argparse.ArgumentError as error:  # --page without the page
        print(f"{Path(script).name}: {error}; e.g. --page docs/benchmarks.md", file=sys.stderr)
        return 2
    page = page.page
    if page is None:
        if "-h" in rest or "--help" in rest:  # the script's own options, then the one added here
            try:
                main(rest)
            finally:
                print("\nrecording (every benchmarks/ script):\n  --page PAGE\n"
                      + textwrap.fill(PAGE_HELP, width=78, initial_indent=" " * 8, subsequent_indent=" " * 8))
        return int(main(rest) or 0)
    path = Path(script).resolve()
    shown = f"benchmarks/{path.name}" if path.parent.name == "benchmarks" else str(path)
    try:
        return run_and_keep(lambda: int(main(rest) or 0), command=shlex.join(["python", shown, *rest]), page=page)
    except PageError as exc:
        print(f"{shown}: {exc}", file=sys.stderr)
        return 2
