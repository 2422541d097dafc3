"""Tiny offline models and a character-level tokenizer, built in-process (no Hub access).

The tokenizer maps each printable ASCII character to one token, the chat markers to special
tokens, and is built as Qwen2's tokenizer class builds itself, so every loader gives the same ids;
its template marks the assistant's tokens (``{% generation %}``) and renders
``<|system|>...<|user|>12+7=<|assistant|>19<|end|>``. Models are ``Qwen2ForCausalLM`` (default) or
``LlamaForCausalLM`` with random weights. Design: docs/architecture.md#models-and-tokenizers.
"""

from __future__ import annotations

import string
from typing import Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<|end|>"
UNK_TOKEN = "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# 95 printable ASCII characters: digits, letters, punctuation, space (no \t\n\r\x0b\x0c)
DEFAULT_CHARACTERS = string.printable[:95] + "\n"

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
    "{% elif m['role'] in ['system', 'user'] %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% else %}{{ raise_exception('unknown chat role: ' + m['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def char_tokenizer(characters: str = DEFAULT_CHARACTERS) -> PreTrainedTokenizerFast:
    """A character-level ``PreTrainedTokenizerFast`` with pad/eos/unk and chat markers.

    Ids: 0 ``<pad>``, 1 ``<|end|>`` (EOS), 2 ``<unk>``, 3-5 role markers, then one id
    per character of ``characters`` (ASCII) in order. A byte-level BPE model with no merges
    splits text into characters, one byte each: byte-level, as Qwen2's tokenizer class builds itself,
    so every loader, ``AutoTokenizer`` included, gives the same ids
    (docs/architecture.md#models-and-tokenizers).
    """
    if len(set(characters)) != len(characters):
        raise ValueError("char_tokenizer(characters=...): characters must be distinct")
    if not characters.isascii():
        raise ValueError("char_tokenizer(characters=...): characters must be ASCII (the tokenizer is byte-level, "
                         "one byte per token)")
    specials = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = [byte_level.pre_tokenize_str(c)[0][0] for c in characters]  # " " -> "Ġ", "\n" -> "Ċ"
    vocab = {tok: i for i, tok in enumerate(specials + symbols)}
    # the arguments Qwen2Tokenizer builds its backend with: a loader that rebuilds it gets this one
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], dropout=None, unk_token=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False), byte_level])
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left")
    # registering as special tokens keeps each marker one id and lets decode skip them
    tokenizer.add_special_tokens(
        {
            "pad_token": PAD_TOKEN,
            "eos_token": EOS_TOKEN,
            "unk_token": UNK_TOKEN,
            "additional_special_tokens": list(ROLE_TOKENS),
        }
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


TOOL_ROLE_TOKEN = "<|tool|>"
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")
# Hermes-style tool calls (``<tool_call>{json}</tool_call>``, answered in a ``tool`` role) in the
# char tokenizer's markers. Tools are listed in one short system line, ``Tools: multiply(a, b)``,
# not as JSON schemas: at one token per character a schema would cost hundreds of tokens of context.
# Append-only (an earlier turn renders as the model sampled it), so episodes see no template_mismatch.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t['function']['name'] }}("
    "{{ t['function']['parameters']['properties'] | list | join(', ') }}){% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] in ['system', 'user', 'tool'] %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% else %}{{ raise_exception('unknown chat role: ' + m['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def char_tool_tokenizer() -> PreTrainedTokenizerFast:
    """:func:`char_tokenizer` for tool-using agents: a ``<|tool|>`` role marker, ``<tool_call>`` and
    ``</tool_call>`` as one token each (as Qwen's tokenizers have them) and :data:`TOOL_CHAT_TEMPLATE`.
    The ids of :func:`char_tokenizer` are unchanged; the three new tokens come after them."""
    tokenizer = char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [*ROLE_TOKENS, TOOL_ROLE_TOKEN]})
    tokenizer.add_tokens(list(TOOL_CALL_TOKENS))  # not special: decode keeps them in the text parsed for calls
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return tokenizer


def _config_kwargs(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int | None,
    max_position_embeddings: int,
    pad_token_id: int,
    eos_token_id: int,
) -> dict:
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
        # eager attention: exact, and fastest for these sizes on CPU
        attn_implementation="eager",
    )


def tiny_causal_lm(
    vocab_size: int,
    *,
    arch: Literal["qwen2", "llama"] = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised ``Qwen2ForCausalLM`` (or ``LlamaForCausalLM``) in eval mode, float32.

    Defaults give ~140k parameters with the char tokenizer's vocabulary: small
    enough to sample 64 completions of 16 tokens in well under a second on one CPU core.
    ``seed`` makes the initial weights reproducible without touching the global RNG.
    """
    kwargs = _config_kwargs(
        vocab_size, hidden_size, num_layers, num_heads, intermediate_size,
        max_position_embeddings, pad_token_id, eos_token_id,
    )
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**kwargs))
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.eos_token_id = eos_token_id
    return model.eval()


def tiny_reward_model(
    vocab_size: int,
    *,
    hidden_size: int = 32,
    num_layers: int = 1,
    num_heads: int = 2,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised ``Qwen2ForSequenceClassification`` with one label (a scalar score).

    ``pad_token_id`` must be set: the head reads the last non-pad token of each row.
    """
    kwargs = _config_kwargs(
        vocab_size, hidden_size, num_layers, num_heads, None, 256, pad_token_id, eos_token_id
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(Qwen2Config(num_labels=1, **kwargs))
    return model.eval()


def tiny_model_and_tokenizer(
    *, arch: Literal["qwen2", "llama"] = "qwen2", seed: int = 0, **model_kwargs
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The char tokenizer and a tiny causal LM sized to its vocabulary, ids wired together."""
    tokenizer = char_tokenizer()
    model = tiny_causal_lm(
        len(tokenizer), arch=arch, seed=seed, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, **model_kwargs,
    )
    return model, tokenizer
