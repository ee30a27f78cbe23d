"""Byte-level BPE for the demo model, trained with ``tokenizers``, with Kimi-K2.5's special
tokens and chat template (the image part renders as ``<|media_pad|>``, the model's media
placeholder, which the engine expands to one token per merged image patch)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from eaglet.testing.demo_task import CHAT_TEMPLATE

# Ids follow the list order: [BOS] 0, [EOS] 1, <|im_end|> 2, ...
SPECIAL_TOKENS = (
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>", "[PAD]",
)
BOS, EOS, IM_END, MEDIA_PAD, PAD = "[BOS]", "[EOS]", "<|im_end|>", "<|media_pad|>", "[PAD]"

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
