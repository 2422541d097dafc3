"""``rlhf-pipeline import`` as a command: argument errors before heavy imports, advice that holds."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from conftest import DEFAULT_PIPELINE, REPO, SMALL

from rlhf_pipeline.cli.main import main


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def toy_rows(groups: int, group_size: int = 4):
    return [{"messages": [{"role": "user", "content": f"{g % 10}+1="}], "group_id": f"g{g}", "completion": str(g % 10 + k),
             "reward": float(k == 1), "log_probs": [-0.5] * (len(str(g % 10 + k)) + 1)}
            for g in range(groups) for k in range(group_size)]


def test_a_missing_source_is_reported_before_torch_is_imported(tmp_path):
    code = ("import sys; from rlhf_pipeline.cli.main import main; "
            f"rc = main(['import', {str(tmp_path / 'nope.jsonl')!r}, {str(tmp_path / 'buf')!r}, "
            f"'--pipeline', {str(DEFAULT_PIPELINE)!r}]); print(rc, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert "nope.jsonl' does not exist" in done.stderr


def test_group_size_advice_in_a_run_does_not_suggest_set(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    source = write_jsonl(tmp_path / "threes.jsonl", toy_rows(2, group_size=3))
    assert main(["import", str(source), str(run), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "takes groups of 4" in err and "settings.json fixes it" in err and "--set" not in err
    assert main(["import", str(source), str(tmp_path / "store"), "--quiet", "--pipeline", str(DEFAULT_PIPELINE),
                 *[a for s in SMALL for a in ("--set", s)]]) == 2
    assert "--set group_size=3" in capsys.readouterr().err
