"""Shared pieces for the agents tests (conftest.py makes fixtures of them): a BPE tokenizer trained here, chat templates, a scripted model.

The tokenizer is byte-level BPE trained at test time on a small corpus (nothing is downloaded), so
decoding and encoding again changes ids the way real tokenizers do (the character tokenizer of
``models.tiny`` cannot show that). ``HERMES_TEMPLATE`` is a Qwen-style template with a tool role
and tools listed in a system message; ``TRIMMING_TEMPLATE`` trims assistant messages, so it is not
append-only for a turn that ends in whitespace; ``THINKING_TEMPLATE`` strips ``<think>`` blocks
from assistant messages that a later user message follows (as Qwen3's does), so the conversation
renders differently from what the model saw once the user speaks again.
"""

from __future__ import annotations

from collections.abc import Sequence

HERMES_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nYou may call these tools:\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{%- endfor %}"
    "{{ 'Call one as <tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
TRIMMING_TEMPLATE = HERMES_TEMPLATE.replace(
    "message.content + '<|im_end|>", "(message.content | trim if message.role == 'assistant' else message.content) + '<|im_end|>")

THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- set content = message.content %}"
    "{%- if message.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip() %}{%- endif %}"
    "{{ '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS = [
    "the answer is forty two and the question is what six times seven is",
    "what is 12 times 34? let me use the calculator tool to multiply them",
    '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>',
    "the result of the tool is 408 so the final answer is 408",
    "user assistant tool system you may call these tools",
    '{"type": "function", "function": {"name": "multiply", "description": "Multiplies two integers."}}',
    "hello there, how are you today? i am fine, thanks for asking",
] * 20


def train_tokenizer(chat_template: str = HERMES_TEMPLATE, vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.add_tokens(["<tool_call>", "</tool_call>"])  # added, not special (as Qwen's are)
    fast.chat_template = chat_template
    return fast


class ScriptedModel:
    """A deterministic "model": turn k says ``script[k]``, written one character per token (a
    tokenization BPE would never produce, as a sampler may), then the end-of-turn token unless
    ``stop=False``. Log-probs are fixed and distinct per position."""

    def __init__(self, tokenizer, script: Sequence[str], *, stop: bool = True):
        self.tokenizer, self.script, self.stop = tokenizer, list(script), stop

    def ids(self, text: str) -> list[int]:
        ids = [i for ch in text for i in self.tokenizer.encode(ch, add_special_tokens=False)]
        return ids + [self.tokenizer.eos_token_id] if self.stop else ids

    def sample(self, turn: int, max_new_tokens: int) -> tuple[list[int], list[float]]:
        ids = self.ids(self.script[turn % len(self.script)])[:max_new_tokens]
        return ids, [-0.01 * (1 + (turn * 31 + k) % 50) for k in range(len(ids))]


def scripted_sampler(tokenizer, script):
    """The rollout's ``sample_turn``: turn k of an episode says script[k]; the turn is read off the
    prompt's assistant headers."""
    model = ScriptedModel(tokenizer, script)
    header = tokenizer.encode("<|im_start|>assistant", add_special_tokens=False)

    async def sample_turn(episode, prompt, limit):
        turn = sum(prompt[i:i + len(header)] == header for i in range(len(prompt))) - 1
        return model.sample(turn, limit)

    return sample_turn
