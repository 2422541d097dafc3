"""``export-model``: a run's policy as a save_pretrained directory with the run's logits, bit for bit."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from dataio_setup import REPO
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.dataio.model_export import VersionNotFoundError, available_versions, export_model
from rlhf_pipeline.dataio.run_pipeline import load_run_pipeline
from rlhf_pipeline.coordination.weights import load_weights, weights_path

CHAT = [{"role": "user", "content": "12+7="}]


def run_policy(run, version):
    model = load_run_pipeline(run).make_model()
    model.load_state_dict(load_weights(run, version)[0])
    return model.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def test_exported_model_has_the_runs_logits_tokenizer_and_sampling(tiny_run, tmp_path):
    out = tmp_path / "model"
    assert main(["export-model", str(tiny_run), str(out), "--version", "2"]) == 0
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "rlhf_pipeline_export.json"} <= {p.name for p in out.iterdir()}
    exported = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(6, 100, (3, 17), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(exported, ids), logits(run_policy(tiny_run, 2), ids))
    assert not torch.equal(logits(exported, ids), logits(run_policy(tiny_run, 3), ids))  # versions differ

    tokenizer = AutoTokenizer.from_pretrained(out)
    original = load_run_pipeline(tiny_run).tokenizer
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == \
        original.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert tokenizer.encode("12+7=19", add_special_tokens=False) == original.encode("12+7=19", add_special_tokens=False)
    # what users load with: AutoTokenizer takes a Qwen2 config's own tokenizer class, which once lost every space
    spaced = [{"role": "user", "content": "What is 12 * 34?"}, {"role": "assistant", "content": "It is 408."}]
    ids = original.apply_chat_template(spaced, tokenize=True, return_dict=True)["input_ids"]
    assert tokenizer.apply_chat_template(spaced, tokenize=True, return_dict=True)["input_ids"] == ids
    assert len(tokenizer.encode("What is 12 * 34?", add_special_tokens=False)) == 16
    assert tokenizer.decode(ids, skip_special_tokens=True) == "What is 12 * 34?It is 408."
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == \
        {p.name: 0o666 & ~umask for p in out.iterdir()}  # model.safetensors was 0600
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["do_sample"] is True and generation["temperature"] == 1.0
    assert generation["eos_token_id"] == original.eos_token_id
    assert json.loads((out / "rlhf_pipeline_export.json").read_text())["version"] == 2


def test_versions_on_disk_come_from_weights_and_checkpoints(tiny_run, tmp_path):
    # weights/ keeps the last 3 of v0..v3, and v0 too: the collector held it at the rows the kept
    # checkpoints name, so a branch from them samples with it. Checkpoints at steps 2 and 3 hold v2 and v3
    found = available_versions(tiny_run)
    assert sorted(found) == [0, 1, 2, 3] and all(v.kind == "weights" for v in found.values())
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    for version in (0, 1, 2, 3):
        weights_path(run, version).unlink()
    found = available_versions(run)
    assert {v: s.kind for v, s in found.items()} == {2: "checkpoint", 3: "checkpoint"}
    result = export_model(run, tmp_path / "from_checkpoint", version=2)
    assert result.source.endswith("step_00000002.pt")
    ids = torch.randint(6, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "from_checkpoint")
    assert torch.equal(logits(exported, ids), logits(run_policy(tiny_run, 2), ids))

    with pytest.raises(VersionNotFoundError, match=r"version 1 .* is no longer on disk .*available: "
                                                    r"v2 \(checkpoint step_00000002.pt\), v3 \(checkpoint"):
        export_model(run, tmp_path / "gone", version=1)
    assert not (tmp_path / "gone").exists()


def test_export_model_default_version_and_refusals(tiny_run, tmp_path, capsys):
    assert main(["export-model", str(tiny_run), str(tmp_path / "newest")]) == 0
    said = capsys.readouterr()
    assert "policy version 3" in said.out
    assert "Writing model shards" not in said.err, said.err  # save_pretrained's bar, amid the command's output
    assert main(["export-model", str(tiny_run), str(tmp_path / "newest")]) == 2
    assert "already exists" in capsys.readouterr().err
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("buffer", "tensorboard"))
    (run / "pipeline.py").unlink()  # a run started before runs kept their pipeline file
    assert main(["export-model", str(run), str(tmp_path / "m")]) == 2
    assert "pass --pipeline PIPELINE.py" in capsys.readouterr().err
    assert main(["export-model", str(run), str(tmp_path / "m"), "--pipeline", str(tiny_run / "pipeline.py")]) == 0
    # a run that keeps its copy: another file exported its weights under that file's tokenizer, with a note
    other = REPO / "pipelines" / "examples" / "reverse_words.py"
    assert main(["export-model", str(tiny_run), str(tmp_path / "other"), "--pipeline", str(other)]) == 2
    assert f"--pipeline {other} differs from the copy run {tiny_run} was started with" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


class RunsCode:
    """Unpickles as a call to ``os.system``: what someone handing over a run directory could plant."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_planted_checkpoint_runs_no_code_when_listed_or_exported(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("buffer", "tensorboard"))
    marker = tmp_path / "ran"
    model = torch.load(run / "checkpoints" / "step_00000003.pt", weights_only=True)["model"]
    torch.save({"progress": {"seed": 0, "step": 4, "policy_version": 4}, "model": model, "x": RunsCode(marker)},
               run / "checkpoints" / "step_00000004.pt")

    assert main(["export-model", str(run), "--list-versions"]) == 0
    assert "v4 (checkpoint step_00000004.pt)" in capsys.readouterr().out
    assert not marker.exists()
    assert main(["export-model", str(run), str(tmp_path / "m"), "--version", "4"]) == 2
    err = capsys.readouterr().err
    assert "refusing to load the learner checkpoint" in err and "step_00000004.pt" in err and "posix.system" in err
    assert len(err.strip().splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "m").exists()


def test_missing_run_and_versions_that_never_existed_say_so(tiny_run, tmp_path, capsys):
    assert main(["export-model", str(tmp_path / "nowhere"), str(tmp_path / "m")]) == 2
    assert f"{tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["export-model", str(tmp_path / "empty"), str(tmp_path / "m")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    for version, expected in (("9999", "policy version 9999 of .* does not exist: the newest is v3"),
                              ("-1", "policy version -1 does not exist: versions count from 0")):
        assert main(["export-model", str(tiny_run), str(tmp_path / "m"), "--version", version]) == 2
        err = capsys.readouterr().err
        assert re.search(expected, err) and "no longer on disk" not in err, err
    assert not (tmp_path / "m").exists()


def test_list_versions_needs_no_output_path_and_imports_no_torch(tiny_run):
    listing = subprocess.run(
        [sys.executable, "-c", "import sys; from rlhf_pipeline.cli.main import main; code = main(sys.argv[1:]); "
                               "print('torch' in sys.modules, 'transformers' in sys.modules); sys.exit(code)",
         "export-model", str(tiny_run), "--list-versions"], capture_output=True, text=True, check=True)
    assert listing.stdout.splitlines() == ["v0 (weights policy_00000000.safetensors)",
                                           "v1 (weights policy_00000001.safetensors)",
                                           "v2 (weights policy_00000002.safetensors)",
                                           "v3 (weights policy_00000003.safetensors)", "False False"]


def test_export_model_without_output_path_is_a_usage_error(tiny_run, capsys):
    assert main(["export-model", str(tiny_run)]) == 2
    assert "OUT is required (unless --list-versions)" in capsys.readouterr().err
