"""Every command words a failure alike: one line, ``rlhf-pipeline COMMAND: error: ...``, exit code 2,
no traceback, including failures it did not word itself (``cli/main.py`` catches those)."""

from __future__ import annotations

import sys

import pytest

from rlhf_pipeline.cli.main import main


@pytest.mark.parametrize("argv", [
    ["inspect", "s3://some-bucket/run"],  # a run at a URL
    ["inspect", "s3://some-bucket/run/buffer"],
    ["export", "s3://some-bucket/run/buffer", "rows.jsonl"],  # was a traceback (RunStoreError)
    ["filter", "s3://some-bucket/run/buffer", "kept", "--where", "response_length <= 3"],
], ids=["inspect-run", "inspect-buffer", "export", "filter"])
def test_a_url_without_its_cloud_package_is_one_error_line(argv, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if the `s3` extra were not installed
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlhf-pipeline {argv[0]}: error: ") and err.count("\n") == 1, err
    assert "s3fs" in err and "pip install -e '.[s3]'" in err
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("argv, words", [
    (["filter", "./buffer", "kept"], "give SRC, DST (or --dry-run) and --where"),
    (["import", "rows.jsonl", "buffer", "--rows-per-chunk", "0"], "--rows-per-chunk must be >= 1"),
    # -1 was refused by the write path after the rows were read, as a fault of the source; past int64, a traceback
    (["import", "rows.jsonl", "buffer", "--policy-version", "-1"], "--policy-version must be in [0, 2**63), got -1"),
    (["import", "rows.jsonl", "buffer", "--policy-version", str(2**64)],
     f"--policy-version must be in [0, 2**63), got {2**64}"),
    (["export-model", "./run"], "OUT is required"),
    (["replay", "pipelines/default.py"], "--buffer PATH is required"),
    (["show", "no-such-buffer"], "no-such-buffer does not exist"),
    # without a reference model nothing recomputes the KL these two shape: they were ignored
    (["replay", "pipelines/default.py", "--buffer", ".", "--kl-coef", "0.1"],
     "--kl-coef shapes the KL recomputed with a reference model: give --ref-model MODEL_DIR|RUN_DIR too, or drop it"),
    (["replay", "pipelines/default.py", "--buffer", ".", "--kl-coef", "nan", "--ref-model", "."],
     "--kl-coef must be a finite number >= 0, got nan"),
    (["replay", "pipelines/default.py", "--buffer", ".", "--seed", "-1"], "--seed must be in [0, 4294967296), got -1"),
    # these three printed their own line, without "error:"
    (["inspect", ".", "--vocab-size", "0"], "--vocab-size must be in [1, 2147483648] (token ids are stored as int32), "
                                            "got 0"),
    (["inspect", ".", "--vocab-size", "151"], "--vocab-size 151: token ids are checked against it with --verify"),
    (["repair", ".", "--vocab-size", "0"], "--vocab-size must be in [1, 2147483648] (token ids are stored as int32), "
                                           "got 0"),
    # past int64 torch raised OverflowError comparing the ids with it: a traceback
    (["repair", ".", "--vocab-size", str(2**64)], f"--vocab-size must be in [1, 2147483648] (token ids are stored as "
                                                  f"int32), got {2**64}"),
    (["convert", "no-such-buffer", "out", "--to", "zarr"], "no-such-buffer does not exist"),
    # a flag and the --set of its setting: the one given later silently won
    (["run", "default.py", "--steps", "3000", "--set", "steps=320"],
     "--steps 3000 and --set steps=320 disagree (--steps sets steps): give one of them"),
    (["learn", "default.py", "--set", "device=cuda", "--device", "cpu"],
     "--device cpu and --set device=cuda disagree (--device sets device): give one of them"),
    (["replay", "default.py", "--buffer", ".", "--set", "steps=3"],
     "--set steps: a replay's length is --steps N (or --epochs N); give that instead"),
    # the replay replaced each by its own value, silently: a prioritized or sequential replay was a shuffled one
    (["replay", "default.py", "--buffer", ".", "--set", "learner.sampler=prioritized"],
     "--set learner.sampler: a replay walks the buffer in epochs (learner.sampler=epoch, which it sets)"),
    (["replay", "default.py", "--buffer", ".", "--set", "learner.epoch_order=sequential"],
     "--set learner.epoch_order: a replay's order is --order shuffle|sequential|with-replacement"),
    (["replay", "default.py", "--buffer", ".", "--set", "learner.epoch_rows=100"],
     "--set learner.epoch_rows: a replay walks every row the buffer holds when it starts"),
], ids=["filter", "import", "import-version-below-0", "import-version-past-int64", "export-model", "replay", "show", "replay-kl-alone", "replay-kl-nan", "replay-seed",
        "inspect", "inspect-without-verify", "repair", "repair-past-int64",
        "convert", "run-steps-twice", "learn-device-twice", "replay-set-steps", "replay-set-sampler",
        "replay-set-epoch-order", "replay-set-epoch-rows"])
def test_a_commands_own_refusal_of_its_arguments_is_the_same_one_line(argv, words, monkeypatch, capsys, tmp_path):
    # each command refuses through one exception main words (cli.CommandRefused); filter once printed its own
    # line without "error:"
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlhf-pipeline {argv[0]}: error: ") and err.count("\n") == 1, err
    assert words in err
    assert not any(tmp_path.iterdir())  # nothing written


REPO_PIPELINE = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "pipelines" / "default.py")


@pytest.mark.parametrize("command", [["run"], ["learn"], ["replay", "--buffer", "."]], ids=["run", "learn", "replay"])
def test_a_lora_learner_without_peft_is_refused_before_any_process_starts(command, monkeypatch, capsys, tmp_path):
    """The learner's process found peft missing with a traceback, once the collectors were sampling."""
    monkeypatch.setitem(sys.modules, "peft", None)  # as if the `lora` extra were not installed
    monkeypatch.chdir(tmp_path)
    assert main([command[0], REPO_PIPELINE, *command[1:], "--home", "runs", "--set", "learner.lora.rank=8"]) == 2
    err = capsys.readouterr().err
    assert err == (f"rlhf-pipeline {command[0]}: error: setting 'learner.lora.rank' is 8: a LoRA learner trains its "
                   f"adapter with peft, which is not installed; install it with `pip install -e '.[lora]'` (from a "
                   f"checkout) or `pip install 'rlhf-pipeline[lora]'`\n")
    assert not any(tmp_path.iterdir())  # nothing written

# each command's output argument, named as its refusal names it; "{out}" is where it is asked to write. The
# inputs need only exist: the output is checked before any of them is read (which made each of these a
# traceback once the work was done, or a misleading line: convert said the path "already holds a buffer")
OUTPUTS = {
    "export-model": (["export-model", "run", "{out}"], "OUT"),
    "plot": (["plot", "run", "--out", "{out}"], "--out"),
    "export": (["export", "run", "{out}.jsonl"], "OUT"),
    "show": (["show", "run", "--html", "{out}.html"], "--html"),
    "convert": (["convert", "run", "{out}", "--to", "zarr"], "DST"),
    "filter": (["filter", "run", "{out}", "--where", "reward > 0", "--selection"], "DST"),
    "import": (["import", "rows.jsonl", "{out}"], "BUFFER"),
    "setup-vllm": (["setup-vllm", "--cpu", "--path", "{out}"], "--path"),
    "branch": (["branch", "run", "{out}", "--from-step", "1"], "NEW_RUN"),
    "run": (["run", REPO_PIPELINE, "--home", "{out}", "--steps", "1"], "the run directory"),
    "replay": (["replay", REPO_PIPELINE, "--buffer", "run", "--home", "{out}", "--steps", "1"], "the run directory"),
}


@pytest.mark.parametrize("place", ["under-a-file", "in-proc"])
@pytest.mark.parametrize("command", list(OUTPUTS))
def test_an_output_that_cannot_be_made_is_refused_before_any_work_naming_its_argument(command, place, monkeypatch,
                                                                                     capsys, tmp_path):
    if place == "in-proc" and not __import__("os").path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc, where nothing can be made whatever a user's rights")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n')
    (tmp_path / "a-file").write_text("not a directory")
    out = "a-file/out" if place == "under-a-file" else "/proc/rlhf-pipeline-out"
    argv, argument = OUTPUTS[command]
    before = sorted(tmp_path.rglob("*"))

    assert main([word.replace("{out}", out) for word in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlhf-pipeline {command}: error: ") and err.count("\n") == 1, err
    assert f"{argument} " in err and "cannot be written: " in err, err
    assert ("a-file is a file, not a directory" if place == "under-a-file" else "nothing can be made in /proc") in err
    assert sorted(tmp_path.rglob("*")) == before  # nothing made, here or beside


@pytest.mark.parametrize("argv, words", [
    (["plot", "run", "--out", "a-file"], "--out a-file cannot be written: a-file is a file, not a directory"),
    (["show", "run", "--html", "run"], "--html run cannot be written: run is a directory"),
], ids=["plot-out-a-file", "show-html-a-directory"])
def test_an_output_of_the_wrong_kind_is_refused_naming_its_argument(argv, words, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "a-file").write_text("not a directory")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlhf-pipeline {argv[0]}: error: ") and err.count("\n") == 1, err
    assert words in err, err
    assert (tmp_path / "a-file").read_text() == "not a directory" and not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("argv, instead", [
    (["export-model", "run", "out", "--best"], "give --version N (--list-versions lists them) instead"),
    (["branch", "run", "--from-step", "best", "new"], "give --from-step N (inspect RUN lists the kept steps) instead"),
], ids=["export-model", "branch"])
def test_best_of_a_run_that_keeps_none_names_what_the_command_takes_instead(argv, instead, monkeypatch, capsys,
                                                                             tmp_path):
    """It said "name a step or a version", whichever of the two the command took."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "settings.json").write_text("{}")  # a run not made with learner.keep_best
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlhf-pipeline {argv[0]}: error: ") and err.count("\n") == 1, err
    assert "keeps no best checkpoint: it was not run with learner.keep_best" in err and err.rstrip().endswith(instead)
    # the shape of the setting, not one evaluation's name: tool_use.py's is held_out-k4-t1, and held_out is refused
    assert "--set learner.keep_best=eval/<evaluation>/pass@1" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
