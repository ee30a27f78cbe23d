"""Byte-level BPE for the demo model, trained with ``tokenizers``, with Kimi-K2.5's special
tokens and chat template (the image part renders as ``<|media_pad|>``, the model's media
placeholder, which the engine expands to one token per merged image patch)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from eaglet.server.kimi_k2_output import REASONING_MARKERS, TOOL_CALL_MARKERS
from eaglet.testing.demo_task import CHAT_TEMPLATE

# Ids follow the list order: [BOS] 0, [EOS] 1, <|im_end|> 2, ...
SPECIAL_TOKENS = (
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>", "[PAD]",
)
BOS, EOS, IM_END, MEDIA_PAD, PAD = "[BOS]", "[EOS]", "<|im_end|>", "<|media_pad|>", "[PAD]"
# Kimi's thinking and tool-call markers, special tokens after the BPE vocabulary (ids 1024-1030 in
# the full build), as in Kimi's own tokenizer. The model's vocab_size rounds the total up to 8.
MARKERS = REASONING_MARKERS + TOOL_CALL_MARKERS


def add_markers(tokenizer: Tokenizer) -> dict[str, int]:
    """Adds MARKERS as special tokens right after the vocabulary; returns their ids."""
    first = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens(list(MARKERS))
    ids = {marker: tokenizer.token_to_id(marker) for marker in MARKERS}
    if list(ids.values()) != list(range(first, first + len(MARKERS))):
        raise AssertionError(f"markers got unexpected ids {ids}")
    return ids


def model_vocab_size(tokenizer: Tokenizer) -> int:
    """The model's vocab_size for a tokenizer: every id, rounded up to a multiple of 8."""
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    return (n + 7) // 8 * 8


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    for index, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != index:
            raise AssertionError(f"special token {token} did not get id {index}")
    add_markers(tokenizer)
    return tokenizer


def special_token_id(name: str) -> int:
    return SPECIAL_TOKENS.index(name)


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
