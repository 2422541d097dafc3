"""The two pipelines docs/your-own-pipeline.md builds, run as the page runs them (fewer steps and a
shorter warm start): real processes, a real buffer, a tiny model. What the page says of each run
is checked on what the run wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import preloaded

from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.pipeline import load_pipeline_module
from rlhf_pipeline.storage import open_buffer

REPO = Path(__file__).resolve().parents[2]
REVERSE = "pipelines/examples/reverse_words.py"
BINARY = "pipelines/examples/binary_tool.py"


def run(pipeline: str, home: Path, *settings: str) -> subprocess.CompletedProcess:
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", pipeline, "--steps", "2",
                             "--home", str(home), "--run-name", "example",
                             *(word for setting in settings for word in ("--set", setting))],
                           cwd=REPO, capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "[run] done: 2 learner steps" in result.stderr
    assert [r["step"] for r in read_metrics(home / "example" / "metrics.jsonl")] == [1, 2]
    return result


def stored_rows(home: Path) -> dict:
    with open_buffer(home / "example" / "buffer", mode="r") as store:
        return store.read(torch.arange(len(store)))


def test_the_single_turn_task_runs_and_its_reward_scores_what_was_sampled(tmp_path):
    result = run(REVERSE, tmp_path, "warm_start_steps=20", "prompts_per_round=4", "group_size=4",
                 "learner.batch_size=16", "learner.new_rows_per_step=16")
    assert "[run] warm start: 20 steps, loss " in result.stdout
    example = load_pipeline_module(REPO / REVERSE)
    rows = stored_rows(tmp_path)
    assert len(rows["reward"]) >= 32 and len(rows["reward"]) % 4 == 0  # whole groups of group_size
    for prompt, completion, reward in zip(rows["prompt_text"], rows["response_text"], rows["reward"].tolist()):
        # the record's answer is the prompt's word backwards; the reward the page wrote scored the completion
        word = prompt.split("reverse: ")[1][:3]
        scored = example.reverse_reward([prompt], [completion], answer=[word[::-1]])[0]
        assert reward == float(torch.tensor(scored, dtype=torch.float32))  # as the buffer stores it
    assert abs(float(rows["advantage"].sum())) < 1e-3  # the write path's group advantage


def test_the_tool_environment_runs_and_the_tools_answers_come_back_into_the_episodes(tmp_path):
    result = run(BINARY, tmp_path, "warm_start_steps=40", "learner.batch_size=16", "learner.new_rows_per_step=16")
    assert "[run] warm start: 40 steps, loss " in result.stdout
    rounds = read_metrics(tmp_path / "example" / "collector" / "metrics-0000.jsonl")
    assert rounds and all(r["template_mismatch"] == 0 for r in rounds)
    rows = stored_rows(tmp_path)
    called = [i for i, calls in enumerate(rows["tool_calls"].tolist()) if calls > 0]
    assert called, "40 warm-start steps teach the call's format: some turns call the tool"
    answered = 0
    for i in called:  # a call's turn is followed by the tool's answer, at the start of the next turn's prompt
        if rows["done"][i] or rows["tool_errors"][i]:
            continue
        number = int(rows["response_text"][i].split('"number":')[1].split("}")[0])
        assert f"<|tool|>{number:b}" in rows["prompt_text"][i + 1]
        answered += 1
    assert answered > 0


def test_a_demonstration_is_an_episode_whose_loss_is_on_the_models_turns_only():
    from rlhf_pipeline.agents.tools import ToolBox
    from rlhf_pipeline.models import char_tool_tokenizer

    example = load_pipeline_module(REPO / BINARY)
    tokenizer = char_tool_tokenizer()
    toolbox = ToolBox([example.to_binary])
    try:
        episode = example.demonstration(tokenizer, {"question": "37 in binary?", "number": "37", "answer": "100101"},
                                        toolbox)
    finally:
        toolbox.close()
    trained = [t for t, m in zip(episode.token_ids, episode.loss_mask) if m]
    assert tokenizer.decode(trained) == ('<tool_call>{"name":"to_binary","arguments":{"number":37}}</tool_call><|end|>'
                                         '100101<|end|>')
    assert "<|tool|>100101" in tokenizer.decode(episode.token_ids)  # the tool ran: its answer, not trained on
    assert episode.rewards == [0.0, 1.0]
