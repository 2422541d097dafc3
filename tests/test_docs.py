"""The documentation stays true: the pages of ``docs/`` (the site ``mkdocs.yml`` builds) and the READMEs.

What a reader would trip over is checked without MkDocs installed:

* every page is in ``mkdocs.yml``'s nav and every nav entry is a page;
* every relative link resolves, anchors included (the site's heading ids in the pages, GitHub's
  in the READMEs, which GitHub renders);
* every ``rlhf-pipeline`` command in a code block or an inline code span names a real command
  and only flags that command's parser takes, and every ``--set KEY=VALUE`` given to a real
  pipeline file is a setting that file accepts;
* every file path under ``rlhf_pipeline/``, ``tests/``, ``benchmarks/`` or ``pipelines/`` and
  every ``rlhf_pipeline.`` name cited exists;
* every Python block runs as written, against a real store; a block marked
  ``<!-- docs-test: fragment (why) -->`` on the line above it is only compiled, and the names
  it imports must exist;
* the schema table matches ``rlhf_pipeline.schema.FIELDS``.

With ``mkdocs-material`` installed (the ``docs`` extra) the site is also built with ``--strict``,
as CI does, and a page with a broken link is shown to fail that build.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import unicodedata
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.rglob("*.md"))
ON_GITHUB = [README, ROOT / "benchmarks" / "README.md"]  # read where GitHub renders them, not on the site
DOCUMENTS = [*ON_GITHUB, *PAGES]  # everything a reader reads

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
FRAGMENT = "<!-- docs-test: fragment"


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def _blocks(path: Path) -> list[tuple[str, str, str]]:
    """(language, code, the text just above the block) of every fenced block."""
    text = path.read_text(encoding="utf-8")
    return [(m.group(1), m.group(2), text[max(0, m.start() - 300):m.start()]) for m in FENCE.finditer(text)]


def _prose(path: Path) -> str:
    """The text outside fenced blocks."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def _inline_code(path: Path) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _prose(path))


# ============================================================================ nav
def _nav_files() -> list[str]:
    """Pages named in mkdocs.yml's nav (read as text: PyYAML comes only with the docs extra)."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = config[config.index("\nnav:"):]
    return re.findall(r"^\s+-\s+(?:[^:\n]+:\s+)?([\w./-]+\.md)\s*$", nav, re.M)


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    nav = _nav_files()
    assert len(nav) == len(set(nav)), "a page is in the nav twice"
    pages = {str(p.relative_to(DOCS)) for p in PAGES}
    assert pages - set(nav) == set(), "pages missing from mkdocs.yml's nav"
    assert set(nav) - pages == set(), "nav entries without a page"
    assert "architecture.md" in nav


def test_mkdocs_config_is_strict_with_every_check():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert re.search(r"^strict: true$", config, re.M)
    assert re.search(r"^theme:\n  name: material$", config, re.M)
    for check in ("omitted_files", "absolute_links", "unrecognized_links", "anchors"):
        assert re.search(rf"^  {check}: warn$", config, re.M), check


# ============================================================================ links
def _heading_text(line: str) -> str:
    text = line.lstrip("#").strip()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text
    return text.replace("`", "")


def _site_slug(text: str) -> str:
    """Python-Markdown's toc slugify, which MkDocs uses for heading ids."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _github_slug(text: str) -> str:
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path, slug) -> set[str]:
    return {slug(_heading_text(line)) for line in _prose(path).splitlines() if re.match(r"#{1,6} ", line)}


def _links(path: Path) -> list[str]:
    prose = re.sub(r"`[^`\n]*`", "", _prose(path))  # not inside inline code
    return re.findall(r"\]\(([^)\s]+)\)", prose)


@pytest.mark.parametrize("path", DOCUMENTS, ids=_ids(DOCUMENTS))
def test_links_resolve(path):
    # the READMEs are read on GitHub, the pages on the site: each with its heading ids
    slug = _github_slug if path in ON_GITHUB else _site_slug
    for link in _links(path):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.exists(), f"{path.name}: link {link!r}: no file {file}"
        if path not in ON_GITHUB:
            assert DOCS in file.parents, f"{path.name}: link {link!r} leaves docs/ (strict builds refuse it)"
        if anchor:
            assert file.suffix == ".md", f"{path.name}: link {link!r}"
            assert anchor in _anchors(file, slug), f"{path.name}: link {link!r}: no heading with that id"


MODULE_DOCSTRING_LINES = 10
DESIGN_NOTE = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+))?")


def test_module_docstrings_say_what_the_module_is_and_link_a_design_note():
    """A module's docstring says what it is in a few lines and points to the design note that
    explains it (docs/...md, an anchor when it names one): the essay lives on that page, once."""
    too_long, unlinked, broken = [], [], []
    for path in sorted((ROOT / "rlhf_pipeline").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        docstring = (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").strip()
        if len(docstring.splitlines()) > MODULE_DOCSTRING_LINES:
            too_long.append(f"{name}: {len(docstring.splitlines())} lines")
        notes = DESIGN_NOTE.findall(docstring)
        if not notes:
            unlinked.append(name)
        for page, heading in notes:
            if not (DOCS / page).exists():
                broken.append(f"{name}: docs/{page}")
            elif heading and heading not in _anchors(DOCS / page, _site_slug):
                broken.append(f"{name}: docs/{page}#{heading}")
    assert not broken, "design notes that are not there:\n" + "\n".join(broken)
    assert not too_long, f"over {MODULE_DOCSTRING_LINES} lines (move the rest to its design note):\n" + \
        "\n".join(too_long)
    assert not unlinked, "no design note named (docs/PAGE.md#heading):\n" + "\n".join(unlinked)


def test_readme_links_to_every_page():
    linked = {(README.parent / link.partition("#")[0]).resolve() for link in _links(README)}
    assert {p.resolve() for p in PAGES} - linked == set(), "pages the README's reading list leaves out"


# ============================================================================ commands
def _parsers():
    from rlhf_pipeline.cli.main import build_parser

    def choices(parser):
        actions = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        return actions[0].choices if actions else {}

    return choices, choices(build_parser())


def _options(parser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def _command_lines(path: Path) -> list[str]:
    """Each ``rlhf-pipeline ...`` command of a page: code block lines (continuations joined, a
    leading ``$ `` dropped) and inline code spans."""
    commands = []
    for language, code, _ in _blocks(path):
        if language not in ("", "bash", "sh", "console"):
            continue
        for line in code.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if re.search(r"(^|/|\s)rlhf-pipeline\s|rlhf_pipeline\.cli\.main\s", line):
                commands.append(line)
    commands += [span for span in _inline_code(path) if re.match(r"(\.venv/bin/)?rlhf-pipeline [a-z]", span)]
    return commands


def _words(command: str) -> list[str]:
    try:
        words = shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote in an elided example: split plainly
        words = command.split("#")[0].split()
    for i, word in enumerate(words):
        if word.endswith("rlhf-pipeline") or word == "rlhf_pipeline.cli.main":
            return words[i + 1:]
    raise AssertionError(f"not a command: {command!r}")


def _pipeline_module(words: list[str]):
    from rlhf_pipeline.pipeline import load_pipeline_module

    for word in words:
        if word.endswith(".py") and (ROOT / word).is_file() and word.startswith("pipelines/"):
            return load_pipeline_module(ROOT / word)
    return None


def _check_command(command: str, choices, commands) -> None:
    from rlhf_pipeline.pipeline import make_settings

    words = _words(command)
    assert words and words[0] in commands, f"{command!r}: no command {words[:1]}"
    parser = commands[words[0]]
    rest = words[1:]
    subcommands = choices(parser)
    if subcommands and rest and not rest[0].startswith(("-", "[")) and rest[0] != "...":
        assert rest[0] in subcommands, f"{command!r}: no {words[0]} {rest[0]!r}"
        parser, rest = subcommands[rest[0]], rest[1:]
    options = _options(parser)
    for word in rest:
        for flag in re.findall(r"(?:^|[\[|(])(--[a-z][a-z0-9-]*)", word):
            assert flag in options, f"{command!r}: {words[0]} has no option {flag}"
    module = _pipeline_module(rest)
    if module is None:
        return
    overrides = []
    for i, word in enumerate(rest[:-1]):
        if word.lstrip("[") == "--set":
            key, _, value = rest[i + 1].rstrip("]").partition("=")
            if key.lower() == "key":  # the placeholder of a synopsis
                continue
            overrides.append(f"{key}={value}")
    # together, as the command gives them: a rule between settings sees them all (buffer_url with zarr)
    make_settings(module, overrides)  # an unknown key or a bad value raises


@pytest.mark.parametrize("path", DOCUMENTS, ids=_ids(DOCUMENTS))
def test_commands_name_real_commands_flags_and_settings(path):
    choices, commands = _parsers()
    for command in _command_lines(path):
        _check_command(command, choices, commands)


def test_the_command_check_catches_what_it_should():
    choices, commands = _parsers()
    _check_command("rlhf-pipeline replay pipelines/default.py --buffer b --epochs 1 --set learner.lr=1e-4",
                   choices, commands)
    for wrong in ("rlhf-pipeline replay pipelines/default.py --buffer b --epoch 1",   # no such flag
                  "rlhf-pipeline replays pipelines/default.py",                        # no such command
                  "rlhf-pipeline bench storag --json",                                 # no such benchmark
                  "rlhf-pipeline run pipelines/default.py --set learner.lrr=1e-4"):    # no such setting
        with pytest.raises((AssertionError, ValueError)):
            _check_command(wrong, choices, commands)


def test_the_commands_page_names_every_command_and_benchmark():
    """A command or benchmark added to the CLI's registries is added to the page (two benchmarks
    were missing from it and from `bench`'s help, issue 33)."""
    from rlhf_pipeline.cli.bench_cmd import BENCHMARKS
    from rlhf_pipeline.cli.main import COMMANDS

    page = (DOCS / "commands.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([a-z-]+)` \| (.*?) \|", page, re.M))
    assert set(rows) == set(COMMANDS)
    for name in BENCHMARKS:
        assert f"`{name}`" in rows["bench"], name
        assert re.search(rf"^rlhf-pipeline bench {name}( |$)", page, re.M), name


def test_every_recorded_block_on_the_benchmarks_page_sits_in_its_benchmarks_section():
    """``--page`` replaces a block by its command line and adds one to the section whose heading names
    the benchmark (``rlhf-pipeline bench NAME`` or ``benchmarks/<script>.py``): a block moved by hand, or
    left unclosed, would be doubled or swallowed by the next record. A script's block names a script
    that exists; the commands inside are checked with the page's other commands above."""
    from rlhf_pipeline.bench.page import BLOCK_OPEN, blocks, section_name, section_of

    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    recorded = blocks(text)
    assert recorded, "the page keeps at least one benchmark's output as its command printed it"
    for command in recorded:
        if section_name(command).startswith("benchmarks/"):
            assert (ROOT / section_name(command)).is_file(), command
        start, end = section_of(text, section_name(command))
        assert start < text.index(BLOCK_OPEN.format(command=command)) < end, command


def test_every_benchmark_has_the_section_its_page_records_go_to():
    """``--page`` puts a benchmark's output in the section whose heading names it: each ``bench`` command
    and each script of ``benchmarks/`` has one on the benchmarks page, so that none is refused there."""
    from rlhf_pipeline.bench.page import PageError, section_of
    from rlhf_pipeline.cli.bench_cmd import BENCHMARKS

    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    names = [f"rlhf-pipeline bench {name}" for name in BENCHMARKS]
    names += [f"benchmarks/{script.name}" for script in sorted((ROOT / "benchmarks").glob("bench_*.py"))]
    homeless = []
    for name in names:
        try:
            section_of(text, name)
        except PageError:
            homeless.append(name)
    assert homeless == [], "benchmarks without a section on docs/benchmarks.md"


def test_every_benchmark_script_is_in_the_table_of_benchmarks_readme():
    listed = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    scripts = [script.name for script in sorted((ROOT / "benchmarks").glob("bench_*.py"))]
    assert [name for name in scripts if f"| `{name}` |" not in listed] == []


# ============================================================================ paths and names
PATH = re.compile(r"(?<![\w/.-])((?:rlhf_pipeline|tests|benchmarks|pipelines)/[\w./-]*[\w/])")
NAME = re.compile(r"(?<![\w.])(rlhf_pipeline(?:\.\w+)+)")


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():  # a page may name a deprecated module to say where it went
                warnings.simplefilter("ignore", FutureWarning)
                obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("path", DOCUMENTS, ids=_ids(DOCUMENTS))
def test_cited_paths_and_names_exist(path):
    text = path.read_text(encoding="utf-8")
    missing = sorted(cited for cited in set(PATH.findall(text)) if not (ROOT / cited).exists())
    assert missing == [], f"{path.name} cites paths that do not exist"
    unresolved = sorted(dotted for dotted in set(NAME.findall(text)) if not _resolves(dotted))
    assert unresolved == [], f"{path.name} names what does not import"


# ============================================================================ python blocks
PYTHON_BLOCKS = [(path, number, code, FRAGMENT in above.rsplit("```", 1)[-1])
                 for path in DOCUMENTS
                 for number, (language, code, above) in enumerate(b for b in _blocks(path) if b[0] == "python")]


# the packages of the optional extras (pyproject.toml): a block importing one is skipped without it,
# as the tests of that extra are; any other name that does not import fails
OPTIONAL_MODULES = {"verifiers": "verifiers", "matplotlib": "plot", "pyarrow": "data", "datasets": "data",
                    "ray": "ray", "trl": "bench-trl", "s3fs": "s3", "adlfs": "azure"}


def _imported_names(code: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


@pytest.mark.parametrize(("path", "number", "code", "fragment"), PYTHON_BLOCKS,
                         ids=[f"{p.relative_to(ROOT)}-{n}" for p, n, _, _ in PYTHON_BLOCKS])
def test_python_blocks_run(path, number, code, fragment, tmp_path, monkeypatch):
    """Every Python block runs as written, against a real store; a fragment compiles and its
    imports exist."""
    compiled = compile(code, f"{path.name} python block {number}", "exec")
    for name in _imported_names(code):
        top = name.split(".")[0]
        if top in OPTIONAL_MODULES and importlib.util.find_spec(top) is None:
            pytest.skip(f"{path.name} python block {number} imports {top}: pip install -e '.[{OPTIONAL_MODULES[top]}]'")
    for name in _imported_names(code):
        assert _resolves(name) or importlib.util.find_spec(name) is not None, f"{name} does not import"
    if fragment:
        return
    import torch

    from helpers import make_batch
    from rlhf_pipeline.models import tiny_causal_lm

    torch.set_num_threads(1)
    monkeypatch.chdir(tmp_path)
    # the names examples take as given: a batch of whole groups of 8 (with advantages unless the
    # example computes them on the write path) and a reference model
    computes_advantage = "GroupAdvantage(" in code
    namespace = {
        "batch": make_batch(2, 8, vocab_size=64, optional=() if computes_advantage else ("advantage",)),
        "ref_model": tiny_causal_lm(64, hidden_size=16, num_layers=1, num_heads=2),
    }
    exec(compiled, namespace)
    if "create_store(" in code:
        stores = [v for v in namespace.values() if type(v).__name__.endswith("TrajectoryStore")]
        assert any(len(s) > 0 for s in stores), "an example that builds a store should write rows to it"


def test_python_blocks_are_found():
    assert sum(1 for *_, fragment in PYTHON_BLOCKS if not fragment) >= 4
    assert any(path == README for path, *_ in PYTHON_BLOCKS)


# ============================================================================ the schema table
def test_schema_table_matches_fields():
    from rlhf_pipeline.schema import FIELDS

    rows = {}
    for line in (DOCS / "schema.md").read_text(encoding="utf-8").splitlines():
        match = re.match(r"\| `(\w+)` \| (token|row|text) \| (\w+(?:-\w+)?) \|", line)
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3))
    assert set(rows) == {f.name for f in FIELDS}
    for spec in FIELDS:
        kind, dtype = rows[spec.name]
        assert kind == spec.kind, spec.name
        expected = "utf-8" if spec.kind == "text" else str(spec.dtype).removeprefix("torch.")
        assert dtype == expected, spec.name


# ============================================================================ the site
def _mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})


needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs-material is not installed (pip install -e '.[docs]')",
)


@needs_mkdocs
def test_site_builds_strict(tmp_path):
    result = _mkdocs_build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").exists()


@needs_mkdocs
def test_strict_build_fails_on_a_broken_link(tmp_path):
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "replay.md"
    page.write_text(page.read_text(encoding="utf-8") + "\nSee [nowhere](storage.md#no-such-heading).\n",
                    encoding="utf-8")
    result = _mkdocs_build(tmp_path, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-heading" in result.stdout + result.stderr


@pytest.mark.parametrize("path", PAGES, ids=_ids(PAGES))
def test_headings_carry_no_issue_numbers(path):
    """A reader does not know the tracker: "Agents (issue 19)" says nothing to them (issue 33)."""
    headings, in_code = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        in_code ^= line.lstrip().startswith("```")
        if not in_code and line.startswith("#"):
            headings.append(line)
    assert not [h for h in headings if re.search(r"\bissue \d+", h, re.I)]
