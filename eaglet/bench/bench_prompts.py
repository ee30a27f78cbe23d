"""The bench's prompts: seeded random token ids (one image each for Kimi), and for the demo its
held-out scene description requests."""

from __future__ import annotations

import torch

from eaglet.bench.bench_checkpoints import KIMI_IMAGE_TOKEN
from eaglet.testing.demo_task import held_out_prompts
from eaglet.testing.images import make_image

PROMPT_SEED = 4321


def random_prompt_ids(batch: int, prompt_len: int, vocab: int, seed: int = PROMPT_SEED) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # ids 0/1 are bos/eos in the fixture vocabulary; keep prompts to ordinary tokens
    ids = torch.randint(2, vocab, (batch, prompt_len), generator=g)
    return ids.tolist()


def make_prompts(ckpt: dict, vocab: int, batch: int, prompt_len: int) -> list[dict]:
    """``batch`` distinct prompts: token ids (one image each for Kimi); for the demo, held-out scene
    description requests in its chat format (eaglet.testing.demo_task), the task its draft was
    measured on, each answered until its own end of turn."""
    if not ckpt["echo"]:
        return held_out_prompts(batch, seed=1, kinds=("describe",))
    ids = random_prompt_ids(batch, prompt_len, vocab)
    if not ckpt["images"]:
        return [{"prompt_token_ids": p} for p in ids]
    ids = [[t if t != KIMI_IMAGE_TOKEN else t + 1 for t in p] for p in ids]
    return [{"prompt_token_ids": p[: prompt_len // 2] + [KIMI_IMAGE_TOKEN] + p[prompt_len // 2:],
             "images": [make_image(56, 42, i)]} for i, p in enumerate(ids)]
