"""Runs llama.cpp's own ``convert_hf_to_gguf.py`` (from the tree tools/bench_setup_llama_cpp.sh
unpacked) on a bench checkpoint.

The converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a probe text and
refuses hashes it does not list; the bench checkpoints' byte-level BPE tokenizers are trained at
test time, so their hash is new. Their pre-tokenizer is GPT-2's byte-level split, so an unlisted
hash is written as ``gpt-2``. The bench feeds llama.cpp token ids, never text, so this choice
cannot change a measured token.

    python -m eaglet.bench.gguf_convert LLAMA_CPP_SRC CHECKPOINT --outtype bf16 --outfile out.gguf
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    source, converter_args = Path(argv[0]), argv[1:]
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    from conversion.base import TextModel

    recognized = TextModel.get_vocab_base_pre

    def vocab_base_pre(self: TextModel, tokenizer: object) -> str:
        try:
            return recognized(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    TextModel.get_vocab_base_pre = vocab_base_pre
    sys.argv = [str(source / "convert_hf_to_gguf.py"), *converter_args]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
