"""The offline char tokenizer, the tiny models built from configs, and local loading."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rlhf_pipeline.models import (
    ModelLoadError,
    char_tokenizer,
    char_tool_tokenizer,
    load_model,
    load_reward_model,
    load_tokenizer,
    tiny_causal_lm,
    tiny_model_and_tokenizer,
    tiny_reward_model,
)


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def test_text_round_trips_one_token_per_character(tokenizer):
    text = "Q: 12+7=? {A} ~x"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids(tokenizer):
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 1
    for marker in ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>"):
        ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, marker
    ids = tokenizer("ab<|end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"


def test_chat_template_marks_exactly_the_assistant_turn(tokenizer):
    conv = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="},
            {"role": "assistant", "content": "3"}]
    out = tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    marked = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.convert_ids_to_tokens(marked) == ["3", "<|end|>"]
    prompt = tokenizer.apply_chat_template(conv[:2], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|system|>add<|user|>1+2=<|assistant|>"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_saved_tool_tokenizer_loads_with_every_loader_to_the_same_ids(arch, tmp_path):
    # AutoTokenizer builds a Qwen2 config's tokenizer with Qwen2's own class, which keeps only the
    # vocabulary of tokenizer.json: a character vocabulary with a plain " " lost every space there
    tokenizer = char_tool_tokenizer()
    tiny_causal_lm(len(tokenizer), arch=arch, hidden_size=8, num_layers=1, num_heads=2).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    text = 'What is 12 * 34?\n<tool_call>{"name": "multiply", "arguments": {"a": 12}}</tool_call> <|tool|>408<|end|>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokenizer.encode("What is 12 * 34?", add_special_tokens=False)) == 16
    chat = [{"role": "user", "content": "What is 12 * 34?"},
            {"role": "assistant", "content": '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}'
                                             "</tool_call>"},
            {"role": "tool", "content": "408"}, {"role": "assistant", "content": "It is 408."}]
    tools = [{"type": "function", "function": {"name": "multiply", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    chat_ids = tokenizer.apply_chat_template(chat, tools=tools, tokenize=True, return_dict=True)["input_ids"]
    for loaded in (AutoTokenizer.from_pretrained(tmp_path), PreTrainedTokenizerFast.from_pretrained(tmp_path)):
        name = type(loaded).__name__
        assert loaded.encode(text, add_special_tokens=False) == ids, name
        assert loaded.decode(ids) == text, name
        assert loaded.apply_chat_template(chat, tools=tools, tokenize=True, return_dict=True)["input_ids"] == chat_ids
        assert loaded.encode("naïve\tx", add_special_tokens=False) == tokenizer.encode("naïve\tx",
                                                                                      add_special_tokens=False)


def test_characters_must_be_ascii():
    with pytest.raises(ValueError, match="must be ASCII"):
        char_tokenizer("abé")


def test_unknown_role_is_rejected(tokenizer):
    with pytest.raises(Exception, match="unknown chat role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_left_padding_with_position_ids_matches_unpadded(arch):
    model, tok = tiny_model_and_tokenizer(arch=arch)
    ids = torch.tensor([tok("12+34=", add_special_tokens=False)["input_ids"]])
    plain = model(input_ids=ids).logits
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=padded, attention_mask=mask, position_ids=pos).logits[:, 3:]
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=0)


def test_seed_fixes_weights_without_touching_global_rng():
    torch.manual_seed(7)
    before = torch.rand(1)
    torch.manual_seed(7)
    a = tiny_causal_lm(50, seed=3)
    after = torch.rand(1)
    b = tiny_causal_lm(50, seed=3)
    c = tiny_causal_lm(50, seed=4)
    assert torch.equal(before, after)
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_bad_head_count_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        tiny_causal_lm(50, hidden_size=30, num_heads=4)


# ------------------------------------------------------------------ loading
def test_save_and_load_round_trip(tmp_path):
    model, tok = tiny_model_and_tokenizer(hidden_size=32, num_layers=1)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_model(tmp_path), load_tokenizer(tmp_path)
    ids = torch.tensor([tok("7+8=", add_special_tokens=False)["input_ids"]])
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert loaded_tok.padding_side == "left" and loaded_tok.pad_token_id == tok.pad_token_id
    assert loaded_tok.apply_chat_template([{"role": "user", "content": "1"}], tokenize=False) == "<|user|>1"
    assert load_model(tmp_path, dtype="bf16").dtype == torch.bfloat16


def test_loading_in_a_log_prints_lines_not_progress_bars(tmp_path, capsys):
    """stderr that is not a terminal (run's log): no "Loading weights" bar, one line each side."""
    from transformers.utils import logging as hf_logging

    model, tokenizer = tiny_model_and_tokenizer(hidden_size=16, num_layers=1, num_heads=2)
    model.save_pretrained(tmp_path)
    capsys.readouterr()  # (saving has a bar of its own)
    enabled_before = hf_logging.is_progress_bar_enabled()
    load_model(tmp_path)
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "\r" not in err
    assert f"[models] loading a causal LM from {tmp_path}" in err and "[models] loaded a causal LM in " in err
    assert hf_logging.is_progress_bar_enabled() == enabled_before  # the switch is put back


def test_reward_model_round_trip(tmp_path):
    rm = tiny_reward_model(101)
    rm.save_pretrained(tmp_path)
    assert load_reward_model(tmp_path).config.num_labels == 1


def test_loading_errors_name_the_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(tmp_path)
    with pytest.raises(ModelLoadError, match="is a file"):
        load_model(tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        load_tokenizer(tmp_path)
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model(tmp_path, dtype="float8")


@pytest.mark.parametrize("damage", ["weights-cut-short", "config-of-another-size"])
def test_a_model_directory_whose_weights_do_not_load_is_a_model_load_error(tmp_path, damage):
    """A copy cut short, or a config.json edited after the weights were saved: safetensors' error and
    transformers' RuntimeError were tracebacks of `replay --init-from`/`--ref-model`."""
    import json

    model, _ = tiny_model_and_tokenizer(hidden_size=32, num_layers=1)
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    if damage == "weights-cut-short":
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 16}))
    with pytest.raises(ModelLoadError, match=f"could not load a causal LM from '{tmp_path}': ") as raised:
        load_model(tmp_path)
    assert "\n" not in str(raised.value)


def test_a_state_dict_file_of_another_model_or_not_torchs_is_named_as_such(tmp_path):
    from rlhf_pipeline.models.loading import load_state_dict_file

    model = tiny_causal_lm(101, hidden_size=32, num_layers=1)
    saved = tmp_path / "weights.pt"
    torch.save(model.state_dict(), saved)
    other = tiny_causal_lm(101, hidden_size=32, num_layers=1, seed=1)
    load_state_dict_file(other, saved, "setting 'init_weights'")
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values()))

    torch.save(tiny_causal_lm(101, hidden_size=16, num_layers=1).state_dict(), saved)
    with pytest.raises(ModelLoadError, match=r"setting 'init_weights': .* holds the weights of another model "
                                             r"\(shape mismatches \(found vs the model\): "):
        load_state_dict_file(other, saved, "setting 'init_weights'")
    saved.write_text("not torch's")
    with pytest.raises(ModelLoadError, match="is not a file torch.save wrote"):
        load_state_dict_file(other, saved, "setting 'init_weights'")
