"""``pipelines/qwen_math.py`` on a tiny Qwen2 saved to disk and a GSM8K-style JSONL written here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import preloaded

from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm
from rlhf_pipeline.pipeline import PipelineError
from rlhf_pipeline.runs.run import run_command
from rlhf_pipeline.storage import open_buffer

REPO = Path(__file__).resolve().parents[2]
QWEN_MATH = str(REPO / "pipelines" / "qwen_math.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = char_tokenizer()
    model = tiny_causal_lm(len(tokenizer), arch="qwen2", hidden_size=32, num_layers=1, num_heads=2,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def cli(*args: str) -> subprocess.CompletedProcess:
    return preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=300)


SMALL = ["--device", "cpu", "--set", "max_new_tokens=8", "--set", "prompts_per_round=2", "--set", "group_size=4",
         "--set", "learner.batch_size=8", "--set", "learner.sample_window=16",
         "--set", "learner.new_rows_per_step=8", "--set", "learner.micro_batch_tokens=128"]


def test_runs_on_a_tiny_model_and_jsonl_with_a_kl_penalty(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "gsm.jsonl", [
        {"question": f"Tom has {a} apples and buys {b} more. How many apples?", "answer": f"... #### {a + b}"}
        for a, b in [(2, 3), (10, 7), (4, 4), (21, 9)]
    ])
    result = cli("run", QWEN_MATH, "--steps", "2", "--home", str(tmp_path), *SMALL,
                 "--set", f"model_path={model_dir}", "--set", f"data_path={data}",
                 "--set", "learner.loss.kl_coef=0.05")
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "qwen_math" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["charts/rows"] == 8 for r in records)
    assert all(math.isfinite(r["losses/kl"]) and r["losses/kl"] >= 0 for r in records)

    # the write path scored every row under the reference model (the model at model_path)
    store = open_buffer(tmp_path / "qwen_math" / "buffer")
    rows = store.read(range(len(store)), fields=["response_tokens", "ref_log_probs"])
    assert torch.equal(rows["ref_log_probs"].lengths(), rows["response_tokens"].lengths())
    assert bool((rows["ref_log_probs"].values < 0).all())


def test_a_model_whose_head_size_vllm_cannot_take_on_a_cpu_is_refused_by_name(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "ok.jsonl", [{"question": "1+1?", "answer": "2"}])
    with pytest.raises(PipelineError, match=r"this model's is 16 \(model_path's config.json\)"):
        run_command("run", pipeline_path=QWEN_MATH, home=str(tmp_path), device="cpu",
                    overrides=[f"model_path={model_dir}", f"data_path={data}", "generation.engine=vllm"])
    assert not (tmp_path / "qwen_math").exists()


@pytest.mark.slow
def test_samples_with_vllm_from_the_model_directory(tmp_path):
    from rlhf_pipeline.generation.settings import find_vllm_python

    try:
        find_vllm_python()
    except ValueError as exc:
        pytest.skip(f"no vLLM environment: {exc}")
    tokenizer = char_tokenizer()
    model = tiny_causal_lm(len(tokenizer), arch="qwen2", hidden_size=64, num_layers=1, num_heads=2,  # head size 32
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = write_jsonl(tmp_path / "gsm.jsonl", [{"question": f"What is {a} + {b}?", "answer": str(a + b)}
                                                for a, b in [(2, 3), (10, 7), (4, 4), (21, 9)]])
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", QWEN_MATH, "--steps", "2",
                             "--home", str(tmp_path), *SMALL, "--set", f"model_path={tmp_path / 'model'}",
                             "--set", f"data_path={data}", "--set", "generation.engine=vllm"],
                           cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the vllm generation engine started" in result.stderr + result.stdout
    records = read_metrics(tmp_path / "qwen_math" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    # rows of version 0 trained by weights of version 0: the engine's log-probs are the learner's
    assert records[0]["losses/sampler_logprob_diff_max"] < 1e-4


def test_missing_model_path_and_bad_prompts_fail_before_any_work(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "ok.jsonl", [{"question": "1+1?", "answer": "2"}])
    with pytest.raises(PipelineError, match="nowhere' does not exist"):
        run_command("run", pipeline_path=QWEN_MATH, home=str(tmp_path), device="cpu",
                    overrides=[f"model_path={tmp_path / 'nowhere'}", f"data_path={data}"])

    no_answer = write_jsonl(tmp_path / "bad.jsonl", [{"question": "1+1?", "answer": "2"}, {"question": "2+2?"}])
    with pytest.raises(PipelineError, match="bad.jsonl:2: missing field 'answer'"):
        run_command("run", pipeline_path=QWEN_MATH, home=str(tmp_path), device="cpu",
                    overrides=[f"model_path={model_dir}", f"data_path={no_answer}"])
    assert not (tmp_path / "qwen_math").exists()  # nothing was created
