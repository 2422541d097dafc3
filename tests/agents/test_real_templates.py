"""Golden loss masks on two real chat-template families: Qwen3 (thinking blocks, tool answers as
``<tool_response>`` in a user turn) and Llama 3.1 (custom tools, an ``ipython`` role).

The templates are the models' own, as TRL ships them for identity checks
(``trl/chat_templates/*.jinja``), so this file runs where the ``bench-trl`` extra is installed
(CI installs it) and is skipped elsewhere; nothing is downloaded. The tokenizer is byte-level BPE
trained here with each family's special and added tokens. Each test plays a scripted episode and
compares the whole token list, written out with ``[`` and ``]`` around every trained span, with
the text below: which characters are trained is read off the page, token by token.
"""

from __future__ import annotations

from importlib import resources

import pytest
from agent_scripts import ScriptedModel

from rlhf_pipeline.agents.environment import StepResult
from rlhf_pipeline.agents.episode import Episode, EpisodeLimits
from rlhf_pipeline.agents.tools import (
    ToolBox,
    parse_hermes,
    parse_llama3_json,
    parser_for_template,
)
from rlhf_pipeline.schema import TerminationReason

pytest.importorskip("trl")


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def real_template(name: str) -> str:
    return (resources.files("trl") / "chat_templates" / f"{name}.jinja").read_text()


def family_tokenizer(chat_template: str, *, special: list[str], added: list[str], eos: str, bos: str | None = None):
    """Byte-level BPE over ASCII text with the family's special tokens (never split) and added
    tokens (``<think>``, ``<tool_call>``: single ids in the real vocabularies, not special)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["what is 12 times 34? the answer is 408", "I need the multiply tool for this",
              '{"name": "multiply", "parameters": {"a": 12, "b": 34}}', "go on, you may call these tools"] * 20
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, bos_token=bos, pad_token=special[0],
                                   unk_token=None)
    fast.add_tokens(added)
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="module")
def qwen3():
    return family_tokenizer(real_template("qwen3"), special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                            added=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                                   "</tool_response>"], eos="<|im_end|>")


@pytest.fixture(scope="module")
def llama31():
    return family_tokenizer(real_template("llama3_1"),
                            special=["<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|start_header_id|>",
                                     "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                            added=[], eos="<|eot_id|>", bos="<|begin_of_text|>")


@pytest.fixture
def box():
    box = ToolBox([multiply])
    yield box
    box.close()


class Multiplication:
    """12 x 34: a tool call is answered by the tool box; a turn saying 408 ends the episode with
    reward 1; any other turn gets ``go on`` as a user message."""

    def __init__(self, box):
        self.box = box

    def step(self, turn):
        if turn.tool_calls:
            return StepResult(self.box.run(turn.tool_calls))
        if "408" in turn.text:
            return StepResult(reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "go on"}])


def play(tokenizer, box, script, parser, **limits):
    model = ScriptedModel(tokenizer, script)
    episode = Episode(tokenizer, [{"role": "user", "content": "what is 12 times 34?"}],
                      limits=EpisodeLimits(**limits), tools=box.schemas, parser=parser)
    env = Multiplication(box)
    while not episode.done:
        ids, log_probs = model.sample(len(episode.turns), episode.max_new_tokens())
        episode.add_environment(env.step(episode.add_turn(ids, log_probs)))
    return episode


def marked(episode, tokenizer) -> str:
    """The token list as text, each trained span inside ``[`` ``]``, decoded token by token (so
    a bracket can only fall on a token boundary) from the episode's ``token_ids`` and
    ``loss_mask``, the two things the rows store."""
    out, trained = [], False
    for token, mask in zip(episode.token_ids, episode.loss_mask, strict=True):
        if mask != trained:
            out.append("[" if mask else "]")
            trained = bool(mask)
        out.append(tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False))
    return "".join(out) + ("]" if trained else "")


def after_opening(episode, tokenizer) -> str:
    """:func:`marked` less the opening prompt, which is checked on its own: it is exactly the
    template's rendering with the generation prompt, and nothing in it is trained."""
    opening = episode.segments[0]
    assert opening.text == episode.render(episode.messages[:1], add_generation_prompt=True)
    assert not opening.sampled
    text = marked(episode, tokenizer)
    assert text.startswith(opening.text)
    return text[len(opening.text):]


CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>'


def test_qwen3_thinking_and_tool_call_masks(qwen3, box):
    assert parser_for_template(qwen3.chat_template) is parse_hermes
    script = ["<think>\nI need the tool.\n</think>\n\n" + CALL, "<think>\nIt said 408.\n</think>\n\nThe answer is 408."]
    episode = play(qwen3, box, script, parse_hermes)
    assert episode.reason is TerminationReason.ENV_DONE and episode.rewards == [0.0, 1.0]
    assert episode.segments[0].text.endswith("<|im_start|>user\nwhat is 12 times 34?<|im_end|>\n<|im_start|>assistant\n")
    assert after_opening(episode, qwen3) == (
        "[<think>\nI need the tool.\n</think>\n\n" + CALL + "<|im_end|>]"
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        "[<think>\nIt said 408.\n</think>\n\nThe answer is 408.<|im_end|>]")
    # the real template re-renders this conversation as the model saw it (reasoning after the
    # last user query is kept): append-only, nothing counted
    assert episode.metrics["template_mismatch"] == 0


def test_qwen3_strips_earlier_thinking_once_the_user_speaks_and_the_samples_stay(qwen3, box):
    script = ["<think>\nHard.\n</think>\n\nMaybe 400?", "<think>\nCheck it.\n</think>\n\n" + CALL,
              "<think>\nDone.\n</think>\n\nIt is 408."]
    episode = play(qwen3, box, script, parse_hermes)
    assert episode.reason is TerminationReason.ENV_DONE and len(episode.turns) == 3
    assert after_opening(episode, qwen3) == (
        "[<think>\nHard.\n</think>\n\nMaybe 400?<|im_end|>]"
        "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
        "[<think>\nCheck it.\n</think>\n\n" + CALL + "<|im_end|>]"
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        "[<think>\nDone.\n</think>\n\nIt is 408.<|im_end|>]")
    # once "go on" is the last user query, Qwen3 renders the first turn without its thinking:
    # from then on the re-rendered conversation is not what the model saw, counted at both
    # environment turns that follow, and never trained on
    assert episode.metrics["template_mismatch"] == 2
    rendered = episode.render(episode.messages, add_generation_prompt=False)
    assert "Hard." not in rendered and "Hard." in "".join(s.text for s in episode.segments)


LLAMA_CALL = '{"name": "multiply", "parameters": {"a": 12, "b": 34}}'


def test_llama31_ipython_role_masks(llama31, box):
    assert parser_for_template(llama31.chat_template) is parse_llama3_json
    episode = play(llama31, box, [LLAMA_CALL, "The answer is 408."], parse_llama3_json)
    assert episode.reason is TerminationReason.ENV_DONE
    opening = episode.segments[0].text
    assert opening.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    assert opening.endswith("what is 12 times 34?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    # the tool's answer is JSON-encoded by the template (a string is iterable in Jinja): "408" in quotes
    assert after_opening(episode, llama31) == (
        "[" + LLAMA_CALL + "<|eot_id|>]"
        '<|start_header_id|>ipython<|end_header_id|>\n\n"408"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
        "[The answer is 408.<|eot_id|>]")
    assert episode.metrics["template_mismatch"] == 0
    assert episode.turns[0].tool_calls[0].arguments == {"a": 12, "b": 34}


def test_llama31_trims_a_turn_and_the_sampled_whitespace_stays_trained(llama31, box):
    episode = play(llama31, box, ["Let me think.  ", "The answer is 408."], parse_llama3_json)
    # the template writes `content | trim`: the two spaces the model sampled are not in the
    # re-rendered conversation; they stay in the token list, trained, and the drift is counted
    assert after_opening(episode, llama31) == (
        "[Let me think.  <|eot_id|>]"
        "<|start_header_id|>user<|end_header_id|>\n\ngo on<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        "[The answer is 408.<|eot_id|>]")
    assert episode.metrics["template_mismatch"] == 1
