"""The demo target: a small Kimi-K2.5 (DeepSeek-V3 MLA + MoE text model, MoonViT vision tower,
patch-merger projector) trained from scratch with transformers' reference implementation, then
exported in the published Kimi-K2.5 checkpoint layout that eaglet loads.

The initial checkpoint (config.json, preprocessor_config.json, random weights under the published
names) is written by eaglet/testing/checkpoints.py, the same code that writes eaglet's test fixtures; the
trained weights go back through its transformers -> published name mapping.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from eaglet.multimodal.image_processor import ImageProcessorConfig, KimiImageProcessor
from eaglet.testing import scenes
from eaglet.testing.checkpoints import (
    load_reference_kimi_k25,
    read_checkpoint_tensors,
    transformers_state_to_published,
    write_kimi_k25_checkpoint,
)
from eaglet.testing.demo_task import SCENE_TASKS, TASK_WEIGHTS, docs_prompt_and_answer, user_prompt
from tools.demo.tokenizer import IM_END, MEDIA_PAD, PAD, special_token_id


@dataclass(frozen=True)
class TargetSize:
    hidden_size: int = 128
    num_hidden_layers: int = 12
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
    scene_labels: tuple[list[int], list[int]] | None = None  # see scene_labels()


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
        """A scene question or docs continuation, thinking off (finetune_tools.ToolExampleMaker
        makes the whole task, tools and thinking included)."""
        kinds = [*SCENE_TASKS, "docs"]
        kind = rng.choices(kinds, weights=[TASK_WEIGHTS[k] for k in kinds])[0]
        labels = None
        if kind == "docs":
            prompt, answer = docs_prompt_and_answer(self.docs, rng)
            ids = self.tokenizer.encode(user_prompt(prompt, with_image=False), add_special_tokens=False).ids
            pixels, grid = None, None
        else:
            scene = scenes.random_scene(rng)
            qa = scenes.question_about(scene, kind, rng)
            ids, pixels, grid = self.scene_prompt(scene, qa.question)
            answer = qa.answer
            labels = scene_labels(scene)
        answer_ids = self.tokenizer.encode(answer + IM_END, add_special_tokens=False).ids
        return Example(ids + answer_ids, [False] * len(ids) + [True] * len(answer_ids), pixels, grid, labels)

    def scene_batch(self, rng: random.Random, count: int) -> dict[str, torch.Tensor]:
        """Images only, with their scene labels (the vision pretraining batches)."""
        drawn = [scenes.random_scene(rng) for _ in range(count)]
        processed = self.image_processor([scenes.render_scene(scene) for scene in drawn])
        labels = [scene_labels(scene) for scene in drawn]
        return {
            "pixel_values": processed.pixel_values,
            "image_grid_thw": processed.grid_thws.to(torch.long),
            "shape_labels": torch.tensor([shape for shape, _ in labels]),
            "colour_labels": torch.tensor([colour for _, colour in labels]),
        }


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
        batch["shape_labels"] = torch.tensor([e.scene_labels[0] for e in with_image])
        batch["colour_labels"] = torch.tensor([e.scene_labels[1] for e in with_image])
    return batch


LABEL_KEYS = ("loss_mask", "shape_labels", "colour_labels")


def batch_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k not in LABEL_KEYS}
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    # position t predicts token t+1; the lm_head runs only where token t+1 belongs to an answer
    target_mask = batch["loss_mask"][:, 1:]
    logits = model.lm_head(hidden[:, :-1][target_mask])
    return F.cross_entropy(logits.float(), batch["input_ids"][:, 1:][target_mask])


# ------------------------------------------------------------------------------------------
# the scene probe: a training-only read-out that teaches the vision tower to see shapes
# ------------------------------------------------------------------------------------------

PROBE_POSITIONS = tuple(sorted(scenes.POSITIONS))
PROBE_SHAPES = scenes.SHAPES
PROBE_COLOURS = tuple(sorted(scenes.COLOURS))


def scene_labels(scene: scenes.Scene) -> tuple[list[int], list[int]]:
    """Per named position (PROBE_POSITIONS order): the index of the shape and of the colour there,
    or len(PROBE_SHAPES) / len(PROBE_COLOURS) where the position is empty."""
    shapes = [len(PROBE_SHAPES)] * len(PROBE_POSITIONS)
    colours = [len(PROBE_COLOURS)] * len(PROBE_POSITIONS)
    for obj in scene.objects:
        at = PROBE_POSITIONS.index(obj.position)
        shapes[at] = PROBE_SHAPES.index(obj.shape)
        colours[at] = PROBE_COLOURS.index(obj.colour)
    return shapes, colours


class SceneProbe(torch.nn.Module):
    """A linear read-out of the shape and colour at each named position from a training scene's
    merged image features (the projector's output, all tokens of the image together).

    From the language loss alone the tower barely learns shapes: a linear probe fitted to the
    features of a tower trained that way found 49% of the shapes, and the target named 32.5% of
    them right (chance 25%). Trained directly, the same tower finds them almost all within a few
    hundred steps. So the probe's loss trains the tower first (``vision_pretrain_steps``) and then
    goes on beside the language loss. The probe is not part of the exported model."""

    def __init__(self, image_tokens: int, hidden_size: int) -> None:
        super().__init__()
        self.image_tokens = image_tokens
        self.shape_logits = torch.nn.Linear(image_tokens * hidden_size, len(PROBE_POSITIONS) * (len(PROBE_SHAPES) + 1))
        self.colour_logits = torch.nn.Linear(image_tokens * hidden_size, len(PROBE_POSITIONS) * (len(PROBE_COLOURS) + 1))

    def forward(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
        """Cross-entropy of the batch's images against their scene labels, and the share of the
        objects whose shape the probe names right."""
        features = model.model.get_image_features(
            pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"]).pooler_output
        features = torch.stack(list(features)).flatten(1).float()  # [images, tokens * hidden]
        shape_logits = self.shape_logits(features).reshape(-1, len(PROBE_SHAPES) + 1)
        colour_logits = self.colour_logits(features).reshape(-1, len(PROBE_COLOURS) + 1)
        shape_labels = batch["shape_labels"].reshape(-1)
        loss = F.cross_entropy(shape_logits, shape_labels) + F.cross_entropy(colour_logits, batch["colour_labels"].reshape(-1))
        present = shape_labels < len(PROBE_SHAPES)
        shape_accuracy = (shape_logits.argmax(-1)[present] == shape_labels[present]).float().mean().item()
        return loss, shape_accuracy


def make_probe(model: torch.nn.Module, maker: ExampleMaker) -> SceneProbe:
    sample = maker.scene_batch(random.Random("probe-size"), 1)
    tokens = int(sample["image_grid_thw"][0].prod()) // 4  # 2 x 2 patch merge
    return SceneProbe(tokens, model.config.text_config.hidden_size)


def pretrain_vision(model: torch.nn.Module, probe: SceneProbe, maker: ExampleMaker, settings: "TrainSettings",
                    *, log: callable = print) -> float:
    """Trains the vision tower, the projector and the probe on scene images alone; returns the
    probe's shape accuracy on held-out scenes."""
    params = [*model.model.vision_tower.parameters(), *model.model.mm_projector.parameters(), *probe.parameters()]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    for step in range(settings.vision_pretrain_steps):
        batch = maker.scene_batch(random.Random(f"{settings.seed}-vision-{step}"), settings.batch_size)
        loss, accuracy = probe(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        if (step + 1) % 100 == 0:
            log(f"vision step {step + 1}/{settings.vision_pretrain_steps} probe loss {loss.item():.4f} "
                f"shape accuracy {accuracy:.3f}")
    return probe_accuracy(model, probe, maker)


def probe_accuracy(model: torch.nn.Module, probe: SceneProbe, maker: ExampleMaker) -> float:
    with torch.no_grad():
        _, accuracy = probe(model, maker.scene_batch(random.Random("probe-held-out"), 256))
    return accuracy


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
    vision_pretrain_steps: int = 800
    probe_loss_weight: float = 0.5  # the scene probe's loss beside the language loss


def learning_rate(settings: TrainSettings, step: int) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
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
    """Trains in place: the vision pretraining with the scene probe, then the language loss plus
    the probe's. Resumes from ``work_dir/train_state.pt`` when present. Batch ``s`` is drawn from
    an RNG seeded with (seed, s), so a resumed run sees the same data. Returns the number of
    language-training steps done."""
    probe = make_probe(model, maker)
    state_path = work_dir / "train_state.pt"
    state = torch.load(state_path, weights_only=False) if state_path.exists() else None
    if state is None:
        accuracy = pretrain_vision(model, probe, maker, settings, log=log)
        log(f"vision pretraining: probe shape accuracy {accuracy:.3f} on held-out scenes")
    params = [p for p in [*model.parameters(), *probe.parameters()] if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        probe.load_state_dict(state["probe"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        log(f"resumed at step {start}")

    def save(step: int) -> None:
        torch.save({"model": model.state_dict(), "probe": probe.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": step}, state_path)

    pad_id = special_token_id(PAD)
    began = time.monotonic()
    recent: list[tuple[float, float, float]] = []
    step = start
    for step in range(start, settings.steps):
        if max_minutes is not None and time.monotonic() - began > max_minutes * 60:
            log(f"time budget reached at step {step}")
            break
        rng = random.Random(f"{settings.seed}-{step}")
        batch = collate([maker.example(rng) for _ in range(settings.batch_size)], pad_id)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(settings, step)
        language_loss = batch_loss(model, batch)
        probe_loss, shape_accuracy = probe(model, batch) if "pixel_values" in batch else (language_loss * 0, 0.0)
        loss = language_loss + settings.probe_loss_weight * probe_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        recent.append((language_loss.item(), probe_loss.item(), shape_accuracy))
        if (step + 1) % 20 == 0:
            elapsed = time.monotonic() - began
            means = [sum(r[i] for r in recent) / len(recent) for i in range(3)]
            log(f"step {step + 1}/{settings.steps} loss {means[0]:.4f} probe loss {means[1]:.4f} "
                f"probe shape accuracy {means[2]:.3f} lr {learning_rate(settings, step):.2e} "
                f"{elapsed / (step + 1 - start):.2f}s/step")
            recent.clear()
        if (step + 1) % settings.checkpoint_every == 0:
            save(step + 1)
    else:
        step = settings.steps
    save(step)
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
