"""``--ray`` where Ray is missing: one line naming the extra, whether or not Ray is installed here."""

from __future__ import annotations

import os
import sys
from pathlib import Path
import preloaded

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")


def test_without_ray_the_flag_says_how_to_install_it(tmp_path):
    """Where ray cannot be imported, ``--ray`` is a one-line error naming the extra, before any work."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    done = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--ray",
                           "--home", str(tmp_path / "home")], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "rlhf-pipeline run: error: --ray needs Ray, which is not installed here (No module named 'ray'): "
        "pip install -e '.[ray]'"]
    assert not (tmp_path / "home").exists()
