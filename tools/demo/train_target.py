"""The demo target: a small Kimi-K2.5 (DeepSeek-V3 MLA + MoE text model, MoonViT vision tower,
patch-merger projector) trained from scratch with transformers' reference implementation, then
exported in the published Kimi-K2.5 checkpoint layout that eaglet loads.

The initial checkpoint (config.json, preprocessor_config.json, random weights under the published
names) is written by tests/checkpoints.py, the same code that writes eaglet's test fixtures; the
trained weights go back through its transformers -> published name mapping.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from eaglet.multimodal.image_processor import ImageProcessorConfig, KimiImageProcessor  # noqa: E402
from tests.checkpoints import (  # noqa: E402
    load_reference_kimi_k25,
    read_checkpoint_tensors,
    transformers_state_to_published,
    write_kimi_k25_checkpoint,
)
from tools.demo import scenes  # noqa: E402
from tools.demo.tokenizer import IM_END, MEDIA_PAD, PAD, special_token_id, user_prompt  # noqa: E402


@dataclass(frozen=True)
class TargetSize:
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 48
    qk_nope_head_dim: int = 24
    qk_rope_head_dim: int = 8
    v_head_dim: int = 24
    intermediate_size: int = 320
    moe_intermediate_size: int = 128
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    vision_hidden_size: int = 64
    vision_layers: int = 2
    vision_heads: int = 4
    vision_intermediate_size: int = 128
    max_position_embeddings: int = 1024


SMOKE_SIZE = TargetSize(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48, moe_intermediate_size=16,
    vision_hidden_size=16, vision_layers=1, vision_heads=2, vision_intermediate_size=32,
)

PATCH_SIZE = 14
# 112 px scenes are 8 x 8 patches -> 16 placeholder tokens; larger user images are scaled down to
# at most this many patches.
MAX_PATCHES = 64


def write_initial_checkpoint(directory: Path, size: TargetSize, vocab_size: int, seed: int) -> None:
    """config.json + preprocessor_config.json + random weights in the published layout."""
    text = dict(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        moe_intermediate_size=size.moe_intermediate_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_attention_heads,
        q_lora_rank=size.q_lora_rank,
        kv_lora_rank=size.kv_lora_rank,
        qk_nope_head_dim=size.qk_nope_head_dim,
        qk_rope_head_dim=size.qk_rope_head_dim,
        v_head_dim=size.v_head_dim,
        n_routed_experts=size.n_routed_experts,
        num_experts_per_tok=size.num_experts_per_tok,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=size.max_position_embeddings,
        bos_token_id=special_token_id("[BOS]"),
        eos_token_id=special_token_id("[EOS]"),
        pad_token_id=special_token_id(PAD),
    )
    vision = dict(
        patch_size=PATCH_SIZE,
        hidden_size=size.vision_hidden_size,
        num_hidden_layers=size.vision_layers,
        num_attention_heads=size.vision_heads,
        intermediate_size=size.vision_intermediate_size,
        pos_emb_height=scenes.IMAGE_SIZE // PATCH_SIZE,
        pos_emb_width=scenes.IMAGE_SIZE // PATCH_SIZE,
    )
    write_kimi_k25_checkpoint(
        directory, text, vision, seed=seed, num_shards=1, dtype=torch.float32,
        image_token_id=special_token_id(MEDIA_PAD), max_patches=MAX_PATCHES,
    )


def write_generation_config(directory: Path) -> None:
    config = {
        "bos_token_id": special_token_id("[BOS]"),
        "eos_token_id": [special_token_id(IM_END), special_token_id("[EOS]")],
        "pad_token_id": special_token_id(PAD),
        "do_sample": False,
    }
    (directory / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ------------------------------------------------------------------------------------------
# examples
# ------------------------------------------------------------------------------------------

@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[bool]  # True where the token is predicted (assistant answer incl. <|im_end|>)
    pixel_values: torch.Tensor | None  # [patches, 3, p, p]
    grid_thw: tuple[int, int, int] | None


# Relative frequencies of the training tasks.
TASK_WEIGHTS = {"describe": 4, "colour": 3, "shape": 3, "position": 3, "count": 1, "docs": 1}
DOCS_PROMPT_CHARS = 100
DOCS_ANSWER_CHARS = 120


def docs_prompt_and_answer(docs: list[str], rng: random.Random) -> tuple[str, str]:
    """A "continue the text" request on a random docs paragraph and its true continuation, both
    cut at spaces."""
    paragraph = rng.choice(docs)
    if len(paragraph) > DOCS_PROMPT_CHARS + 40:
        start = rng.randrange(0, max(1, len(paragraph) - DOCS_PROMPT_CHARS - DOCS_ANSWER_CHARS))
        start = paragraph.rfind(" ", 0, start) + 1 if start else 0
        split = paragraph.find(" ", start + DOCS_PROMPT_CHARS)
        split = split if split != -1 else start + DOCS_PROMPT_CHARS
        head, tail = paragraph[start:split], paragraph[split:split + DOCS_ANSWER_CHARS]
    else:
        half = paragraph.find(" ", len(paragraph) // 2)
        head, tail = paragraph[:half], paragraph[half:]
    cut = tail.rfind(" ")
    tail = tail if len(tail) < DOCS_ANSWER_CHARS or cut <= 0 else tail[:cut]
    return f"Continue the text:\n{head}", tail


class ExampleMaker:
    def __init__(self, tokenizer: Tokenizer, image_processor: KimiImageProcessor, docs: list[str]) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.docs = docs
        self.image_token_id = special_token_id(MEDIA_PAD)

    def scene_prompt(self, scene: scenes.Scene, question: str) -> tuple[list[int], torch.Tensor, tuple[int, int, int]]:
        processed = self.image_processor([scenes.render_scene(scene)])
        ids = self.tokenizer.encode(user_prompt(question, with_image=True), add_special_tokens=False).ids
        count = processed.num_placeholder_tokens[0]
        at = ids.index(self.image_token_id)
        ids = ids[:at] + [self.image_token_id] * count + ids[at + 1:]
        grid = tuple(int(x) for x in processed.grid_thws[0].tolist())
        return ids, processed.pixel_values, grid

    def example(self, rng: random.Random) -> Example:
        kinds = list(TASK_WEIGHTS)
        kind = rng.choices(kinds, weights=[TASK_WEIGHTS[k] for k in kinds])[0]
        if kind == "docs":
            prompt, answer = docs_prompt_and_answer(self.docs, rng)
            ids = self.tokenizer.encode(user_prompt(prompt, with_image=False), add_special_tokens=False).ids
            pixels, grid = None, None
        else:
            scene = scenes.random_scene(rng)
            qa = scenes.question_about(scene, kind, rng)
            ids, pixels, grid = self.scene_prompt(scene, qa.question)
            answer = qa.answer
        answer_ids = self.tokenizer.encode(answer + IM_END, add_special_tokens=False).ids
        return Example(ids + answer_ids, [False] * len(ids) + [True] * len(answer_ids), pixels, grid)


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.bool)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = torch.tensor(e.input_ids)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(e.loss_mask)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
    with_image = [e for e in examples if e.pixel_values is not None]
    if with_image:
        batch["pixel_values"] = torch.cat([e.pixel_values for e in with_image])
        batch["image_grid_thw"] = torch.tensor([e.grid_thw for e in with_image], dtype=torch.long)
    return batch


def batch_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "loss_mask"}
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    # position t predicts token t+1; the lm_head runs only where token t+1 belongs to an answer
    target_mask = batch["loss_mask"][:, 1:]
    logits = model.lm_head(hidden[:, :-1][target_mask])
    return F.cross_entropy(logits.float(), batch["input_ids"][:, 1:][target_mask])


# ------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainSettings:
    steps: int
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    checkpoint_every: int = 200
    seed: int = 0
    # (until_step, horizon): steps before until_step follow the cosine schedule of a run of
    # `horizon` steps; later steps follow `steps`. Records how the shipped run was extended twice
    # while training (each extension resumed from a checkpoint), so a rebuild repeats it exactly.
    schedule_segments: tuple[tuple[int, int], ...] = ()


def learning_rate(settings: TrainSettings, step: int) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    horizon = next((h for until, h in settings.schedule_segments if step < until), settings.steps)
    progress = (step - settings.warmup_steps) / max(1, horizon - settings.warmup_steps)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def load_model_for_training(checkpoint_dir: Path) -> torch.nn.Module:
    model = load_reference_kimi_k25(checkpoint_dir)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()  # routing starts unbiased; it is not trained by gradients
    model.train()
    return model


def train_target(
    model: torch.nn.Module,
    maker: ExampleMaker,
    settings: TrainSettings,
    work_dir: Path,
    *,
    log: callable = print,
    max_minutes: float | None = None,
) -> int:
    """Trains in place; resumes from ``work_dir/train_state.pt`` when present. Batch ``s`` is
    drawn from an RNG seeded with (seed, s), so a resumed run sees the same data. Returns the
    number of steps done."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=settings.lr, betas=(0.9, 0.95),
        weight_decay=settings.weight_decay,
    )
    state_path = work_dir / "train_state.pt"
    start = 0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        log(f"resumed at step {start}")
    pad_id = special_token_id(PAD)
    began = time.monotonic()
    recent: list[float] = []
    step = start
    for step in range(start, settings.steps):
        if max_minutes is not None and time.monotonic() - began > max_minutes * 60:
            log(f"time budget reached at step {step}")
            break
        rng = random.Random(f"{settings.seed}-{step}")
        batch = collate([maker.example(rng) for _ in range(settings.batch_size)], pad_id)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(settings, step)
        loss = batch_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        recent.append(loss.item())
        if (step + 1) % 20 == 0:
            elapsed = time.monotonic() - began
            log(f"step {step + 1}/{settings.steps} loss {sum(recent) / len(recent):.4f} "
                f"lr {learning_rate(settings, step):.2e} {elapsed / (step + 1 - start):.2f}s/step")
            recent.clear()
        if (step + 1) % settings.checkpoint_every == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}, state_path)
    else:
        step = settings.steps
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, state_path)
    return step


def export_published(model: torch.nn.Module, template_dir: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """Writes the trained weights under the published tensor names, plus the config files of
    ``template_dir``, to ``out_dir`` (one model.safetensors)."""
    from safetensors.torch import save_file

    config = json.loads((template_dir / "config.json").read_text())
    state = {k: v.detach() for k, v in model.state_dict().items()}
    published = transformers_state_to_published(state, config)
    reference = read_checkpoint_tensors(template_dir)
    if set(published) != set(reference):
        raise AssertionError(f"exported names differ from the published layout: {sorted(set(published) ^ set(reference))[:8]}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in published.items():
        keep_fp32 = name.endswith("e_score_correction_bias")
        tensors[name] = tensor.to(torch.float32 if keep_fp32 else dtype).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # save_file creates it owner-only; it is package data
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["text_config"]["torch_dtype"] = config["torch_dtype"]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("preprocessor_config.json",):
        (out_dir / name).write_text((template_dir / name).read_text())


def make_image_processor(checkpoint_dir: Path) -> KimiImageProcessor:
    return KimiImageProcessor(ImageProcessorConfig.from_pretrained(checkpoint_dir))


def settings_dict(size: TargetSize, settings: TrainSettings) -> dict:
    return {"size": asdict(size), "train": asdict(settings)}
