"""What a command cannot do, it says at once: one line and exit code 2 before torch is imported
(a missing path, a directory that is no buffer, an extra not installed, a GPU the machine lacks),
not after the seconds of imports and model building it took before (issue 33)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_pipeline.runs.run import no_cuda_reason
from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore

REPO = Path(__file__).resolve().parent.parent
DEFAULT = str(REPO / "pipelines" / "default.py")

# runs main() on each argv in one fresh interpreter with pyarrow hidden (as if the `data` extra were
# not installed); prints each exit code and stderr, and whether torch was imported by any of them
SCRIPT = """
import contextlib, io, json, sys
sys.modules["pyarrow"] = None
from rlhf_pipeline.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, err.getvalue()])
print(json.dumps({"results": results, "torch": "torch" in sys.modules}))
"""


def test_commands_refuse_what_they_cannot_do_before_importing_torch(tmp_path):
    from helpers import make_batch

    store = tmp_path / "buffer"
    with MemmapTrajectoryStore.create(store, segment_rows=8) as writer:
        writer.append(make_batch(1, 2))
    not_a_buffer = tmp_path / "notes"
    not_a_buffer.mkdir()
    (not_a_buffer / "README").write_text("not rows")
    cases = [
        (["inspect", str(not_a_buffer)], f"{not_a_buffer} is not a replay buffer"),
        (["show", str(tmp_path / "missing")], f"{tmp_path / 'missing'} does not exist"),
        (["export", str(store), str(tmp_path / "rows.parquet")],
         "exporting to Parquet needs the optional package 'pyarrow'; install it with `pip install -e '.[data]'`"),
        # an empty argument (`"$RUN"` with RUN unset) named the current directory: `run` wrote its run there,
        # `replay` read it as the buffer, and `branch` named the parent's home
        (["inspect", ""], "a run or path argument is empty: give a run's name, a path or a URL"),
        (["run", DEFAULT, "--home", ""], "--home is empty: give a directory or an s3:// or az:// URL"),
        (["replay", DEFAULT, "--buffer", "", "--steps", "1"], "--buffer is empty"),
        (["branch", str(store), "", "--from-step", "1"], "NEW_RUN is empty"),
        (["import", str(tmp_path / "rows.jsonl"), ""], "BUFFER is empty"),
    ]
    if no_cuda_reason() is not None:  # this machine cannot have a GPU (CI): --device cuda is refused at once
        home = str(tmp_path / "home")
        refused = "'cuda' but this machine has no GPU driver"
        cases += [(["run", DEFAULT, "--device", "cuda", "--home", home], refused),
                  (["run", DEFAULT, "--set", "device=cuda", "--home", home], refused),
                  (["replay", DEFAULT, "--buffer", str(store), "--device", "cuda", "--home", home], refused),
                  (["import", str(tmp_path / "rows.jsonl"), str(tmp_path / "new"), "--pipeline", DEFAULT,
                    "--device", "cuda"], refused)]
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([argv for argv, _ in cases])],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    for (argv, message), (code, err) in zip(cases, report["results"], strict=True):
        assert code == 2 and err.count("\n") == 1 and message in err, (argv, code, err)
    assert not report["torch"]
    assert not (tmp_path / "home").exists() and not (tmp_path / "rows.parquet").exists()


@pytest.mark.parametrize(("platform", "files", "refused"), [
    ("linux", [], True),  # a machine with no GPU driver
    ("linux", ["dev/nvidia0", "dev/nvidiactl"], False),  # NVIDIA's driver, also in a container given a GPU
    ("linux", ["proc/driver/nvidia/version"], False),
    ("linux", ["dev/kfd"], False),  # AMD's, which a ROCm build of torch uses as "cuda"
    ("linux", ["dev/dxg"], False),  # WSL 2
    ("darwin", [], True),
    ("win32", [], False),  # no cheap probe there: torch decides, later
])
def test_a_gpu_is_ruled_out_only_where_no_driver_can_be_seen(tmp_path, monkeypatch, platform, files, refused):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert (no_cuda_reason(platform, root=str(tmp_path)) is not None) == refused
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hides every GPU, whatever the driver
    assert "CUDA_VISIBLE_DEVICES" in no_cuda_reason(platform, root=str(tmp_path))


def test_settings_that_are_not_finite_numbers_are_refused_before_anything_starts(tmp_path):
    """nan and inf pass most range checks (`lr > 0` holds for inf, `temperature <= 0` fails for nan):
    every float setting of every pipeline is refused when not finite, in one line naming it, before
    torch is imported (issue 41); so is an engine's setting given to a run of another engine (issue 42)."""
    home = str(tmp_path / "home")
    tool_use = str(REPO / "pipelines" / "tool_use.py")
    cases = [
        (["run", DEFAULT, "--set", "learner.lr=inf"], "setting 'learner.lr' must be a finite number, got inf: give "
                                                      "one, e.g. its default 0.0003"),
        (["run", DEFAULT, "--set", "temperature=nan"], "setting 'temperature' must be a finite number, got nan"),
        (["run", DEFAULT, "--set", "learner.loss.kl_coef=-inf"], "setting 'learner.loss.kl_coef' must be a finite "
                                                                 "number, got -inf"),
        (["run", DEFAULT, "--set", "learner.adam_betas=0.9,nan"], "setting 'learner.adam_betas' must be a finite "
                                                                  "number, got (0.9, nan)"),
        (["learn", DEFAULT, "--set", "retention.max_age_s=inf"], "setting 'retention.max_age_s' must be a finite "
                                                                 "number or none, got inf"),
        (["run", tool_use, "--set", "max_failed_group_fraction=nan"], "setting 'max_failed_group_fraction' must be a "
                                                                      "finite number or none, got nan"),
        (["run", DEFAULT, "--set", "generation.timeout_s=-5"], "setting 'generation.timeout_s' is for "
                                                                  "generation.engine=vllm or generation.url; this run "
                                                                  "generates with the loop: drop it"),
        # numbers past what the run can derive from them: the collector's process died on each, once the
        # learner had started ("Overflow when unpacking long long"; 2**64 collectors were counted out first)
        (["run", DEFAULT, "--set", "seed=1732900000000000000"], "setting 'seed' must be in [0, 4294967296), got "
                                                                "1732900000000000000"),
        (["run", DEFAULT, "--collectors", str(2**64)], f"--collectors must be in [1, 8388608], got {2**64}"),
        (["collect", DEFAULT, "--collector-index", str(2**23)], "--collector-index must be in [0, 8388608), got "
                                                                "8388608"),
        # an empty name (`--run-name "$NAME"` with NAME unset) ran, and resumed, the pipeline's default run
        (["run", DEFAULT, "--run-name", ""], "--run-name '' is not a plain name"),
        (["learn", DEFAULT, "--run-name", ""], "--run-name '' is not a plain name"),
    ]
    argvs = [[*argv, "--home", home] for argv, _ in cases]
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(argvs)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    for (argv, message), (code, err) in zip(cases, report["results"], strict=True):
        assert code == 2 and err.count("\n") == 1 and message in err, (argv, code, err)
    assert not report["torch"]
    # no run directory, nor the --home a refused command made for it
    assert not (tmp_path / "home").exists()



@pytest.mark.parametrize("command", ["run", "replay"])
def test_more_processes_than_the_open_file_limit_allows_pipes_for_are_refused_in_one_line(tmp_path, command):
    """Each child gets a pipe from its launcher: past the open-file limit ``run`` (its collectors) and
    ``replay`` (its data-parallel ranks) ended in a traceback (OSError: Too many open files). Now one
    line names the limit, and ``run`` leaves no run directory."""
    home = tmp_path / "home"
    if command == "run":
        argv, processes = ["run", DEFAULT, "--collectors", "40", "--steps", "1"], 41
    else:
        from rlhf_pipeline.models import char_tokenizer
        from rlhf_pipeline.schema import StoreSchema
        from rlhf_pipeline.schema.synthetic import synthetic_batch
        from rlhf_pipeline.storage import create_store

        rows = synthetic_batch(16, group_size=4, prompt_len=(3, 8), response_len=(1, 6), seed=0,
                               optional_fields=("advantage",), vocab_size=len(char_tokenizer()))
        with create_store(tmp_path / "recorded", "memmap", schema=StoreSchema.for_batch(rows)) as store:
            store.append(rows)
        argv = ["replay", DEFAULT, "--buffer", str(tmp_path / "recorded"), "--steps", "1",
                "--set", "warm_start_steps=0", "--set", "learner.world_size=40"]
        processes = 40
    done = subprocess.run(["bash", "-c", 'ulimit -n 64 && exec "$@"', "bash", sys.executable, "-m",
                           "rlhf_pipeline.cli.main", *argv, "--home", str(home)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        f"rlhf-pipeline {command}: error: could not start {processes} processes, a pipe each: Too many open files "
        "(this shell's limit is 64, `ulimit -n`); raise it, or start fewer (--collectors, learner.world_size)")
    if command == "run":
        assert not home.exists() or not any(home.iterdir())
