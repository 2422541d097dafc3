"""``bench tool-use``: both sides start from the same weights and tasks, TRL's tool turns are our
episodes' tokens, and one step of each runs. Skipped without TRL (the ``bench-trl`` extra)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from rlhf_pipeline.agents.calculator import demonstration, multiply  # noqa: E402
from rlhf_pipeline.agents.tools import ToolBox  # noqa: E402
from rlhf_pipeline.bench.tool_use_bench import format_table, initial_weights, run_side, summarize  # noqa: E402
from rlhf_pipeline.bench.trl_tool_side import build_trainer, trl_tool_tokenizer  # noqa: E402
from rlhf_pipeline.models import char_tool_tokenizer  # noqa: E402
from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings  # noqa: E402
from rlhf_pipeline.runs.processes import build_pipeline  # noqa: E402
from rlhf_pipeline.storage import open_buffer  # noqa: E402

PIPELINE = Path(__file__).resolve().parents[2] / "pipelines" / "tool_use.py"
SMALL = ["warm_start_steps=20", "warm_start_check_tasks=0", "learner.batch_size=16", "learner.new_rows_per_step=16",
         "learner.sample_window=32", "log_rounds_every=0", "seed=3"]


def test_trl_tokenizer_gives_our_episode_tokens(tmp_path):
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    ours, trl_side = char_tool_tokenizer(), trl_tool_tokenizer()
    assert ours.get_vocab() == trl_side.get_vocab()  # the adaptation is the template and parser only
    assert supports_tool_calling(trl_side) and is_chat_template_prefix_preserving(trl_side)
    assert not supports_tool_calling(ours)  # why TRL cannot take the pipeline's tokenizer as it is

    toolbox = ToolBox([multiply])
    episode = demonstration(ours, {"question": "What is 37 * 58?", "answer": "2146"}, use_tool=True, guess=0,
                            toolbox=toolbox)
    toolbox.close()
    ids, mask = episode.token_ids, episode.loss_mask
    first = mask.index(1)
    call_end = mask.index(0, first)  # the first turn: the call and its <|end|>
    answer = mask.index(1, call_end)
    # the opening prompt TRL renders is ours
    prompt = trl_side.apply_chat_template([{"role": "user", "content": "What is 37 * 58?"}], tools=[multiply],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt == ids[:first]
    # TRL parses the sampled call into the tool call our parser reads
    parsed = parse_response(trl_side, ids[first:call_end], prefix=prompt, tools=[multiply])
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "multiply",
                                                                      "arguments": {"a": 37, "b": 58}}}]
    # and the tool's answer it splices in (a dummy conversation's diff) is our environment tokens
    settings = make_settings(load_pipeline_module(PIPELINE), SMALL)
    trainer, _ = build_trainer(settings, _random_state(settings), steps=1, output_dir=str(tmp_path))
    suffix = trainer._get_tool_suffix_ids([{"role": "tool", "name": "multiply", "content": str(multiply(37, 58))}])
    assert suffix == ids[call_end:answer]


def _random_state(settings) -> dict:
    from rlhf_pipeline.models import tiny_causal_lm

    tokenizer = char_tool_tokenizer()
    return tiny_causal_lm(len(tokenizer), hidden_size=settings.hidden_size, num_layers=settings.num_layers,
                          num_heads=settings.num_heads, max_position_embeddings=settings.context_length,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id).state_dict()


def test_both_sides_start_from_the_same_weights_and_tasks_and_run_a_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    init = tmp_path / "init.pt"
    initial_weights(PIPELINE, SMALL, init)
    state = torch.load(init, weights_only=True)
    module = load_pipeline_module(PIPELINE)

    # ours: the policy `run` publishes as version 0 with init_weights set
    ours = build_pipeline(module, make_settings(module, [*SMALL, f"init_weights={init}"]),
                          RunPaths(tmp_path / "scratch")).make_policy()
    # TRL: the trainer's model
    settings = make_settings(module, SMALL)
    trainer, scorer = build_trainer(settings, state, steps=1, output_dir=str(tmp_path / "trl"))
    for name, tensor in state.items():
        assert torch.equal(ours.state_dict()[name], tensor), name
        assert torch.equal(trainer.model.state_dict()[name], tensor), name
    trainer.train()
    assert trainer.state.global_step == 1
    assert [r["episodes"] for r in scorer.rounds] == [settings.tasks_per_round * settings.group_size]
    trl_questions = [m[0]["content"] for m in trainer.train_dataset["prompt"]]

    # one step of ours through the bench's own runner; its first round asked TRL's first questions
    records = {}
    for side in ("ours", "trl"):
        record = run_side(side, PIPELINE, steps=1, home=tmp_path, name=side, overrides=SMALL, init=init)
        assert record["rounds"] >= 1 and 0 <= record["reward_first"] <= 1 and record["wall_s"] > 0
        records[side] = summarize(side, [{**record, "seed": 3}], steps=1)
    with open_buffer(tmp_path / "ours" / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)), fields=("prompt_text", "step"))
    asked = [re.search(r"What is \d+ \* \d+\?", text).group(0)
             for text, step in zip(rows["prompt_text"], rows["step"].tolist(), strict=True) if step == 0]
    first_round = list(dict.fromkeys(asked))[:settings.tasks_per_round]
    assert first_round == trl_questions[:settings.tasks_per_round]
    assert "| wall_s |" in format_table([records["ours"], records["trl"]])
