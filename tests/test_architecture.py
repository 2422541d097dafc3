"""The package's layering rules (docs/architecture.md), checked on every test run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rlhf_pipeline"
LONG_MODULE_LINES = 400
WHY_LONG = "Why one file:"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def test_import_contracts_hold(capsys):
    """The layers, acyclic packages and 'only cluster/ imports Ray' (pyproject's [tool.importlinter])."""
    importlinter_cli = pytest.importorskip("importlinter.cli", reason="needs import-linter: pip install -e '.[test]'")
    code = importlinter_cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    assert code == 0, report
    assert "0 broken" in report


def test_no_module_imports_another_modules_private_names():
    modules = _modules()
    offenders = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                source = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("rlhf_pipeline") or source == name:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and f"{source}.{alias.name}" not in modules:
                    offenders.append(f"{name} imports {source}.{alias.name}")
    assert not offenders, "private names used from another module (make them public or move them):\n" + \
        "\n".join(offenders)


def test_long_modules_say_why_they_are_one_file():
    unexplained = []
    for name, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        if lines <= LONG_MODULE_LINES:
            continue
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if WHY_LONG not in docstring:
            unexplained.append(f"{name}: {lines} lines")
    assert not unexplained, (f"modules over {LONG_MODULE_LINES} lines must split, or say at the top of their "
                             f"docstring why not ('{WHY_LONG} ...'):\n" + "\n".join(unexplained))


def test_the_architecture_page_names_every_top_level_package():
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    missing = [p for p in packages if f"`{p}/`" not in page]
    assert not missing, f"docs/architecture.md does not describe {missing}"


def test_test_modules_have_distinct_names():
    """pytest imports test modules by basename (no packages under tests/): two files with one name
    in different folders stop the whole suite at collection, so a clash fails here, naming both."""
    by_name: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert clashes == {}, f"rename one of each: {clashes}"
