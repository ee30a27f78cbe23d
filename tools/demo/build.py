"""Builds eaglet's bundled demo model: tokenizer, Kimi-K2.5 target trained from scratch, its
EAGLE-3 draft. Every random choice is seeded, so a rebuild on the same Python / torch versions
gives the same files.

    python -m tools.demo.build                      # full build into eaglet/demo_model/
    python -m tools.demo.build --smoke --out /tmp/x  # tiny sizes, a few steps (the test uses this)

(from the repository root, which makes ``tools`` and ``tests`` importable).

Stages (``--stages``): ``target`` (tokenizer, training, export, eaglet-vs-transformers check) and
``draft`` (the target's own answers to held-in prompts, then eaglet's EAGLE-3 trainer).
Target training checkpoints to ``<work>/train_state.pt`` and resumes from it; ``export``
exports that saved state without training.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from eaglet.demo_model import DEMO_DIR
from eaglet.testing import scenes
from eaglet.testing.demo_task import held_out_prompts
from eaglet.testing.docs_corpus import docs_paragraphs
from tools.demo import train_target as tt
from tools.demo.tokenizer import model_vocab_size, save_tokenizer, train_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]

FULL_VOCAB = 1024
FULL_TARGET_STEPS = 4000
SMOKE_VOCAB = 400
TOKENIZER_SCENES = 3000  # scenes whose questions/answers join the docs as tokenizer training text
DRAFT_TTT_LENGTH = 5
DRAFT_LR = 2e-3
DRAFT_BATCH_SIZE = 16
DRAFT_MAX_NEW_TOKENS = 64
SMOKE_MAX_NEW_TOKENS = 12


def tokenizer_texts(seed: int) -> list[str]:
    rng = random.Random(f"tokenizer-{seed}")
    texts = docs_paragraphs()
    for _ in range(TOKENIZER_SCENES):
        scene = scenes.random_scene(rng)
        for kind in scenes.QUESTION_TYPES:
            qa = scenes.question_about(scene, kind, rng)
            texts.append(f"user assistant image {qa.question} {qa.answer} Continue the text:")
    return texts


def build_target(out_dir: Path, work_dir: Path, *, smoke: bool, steps: int, batch_size: int,
                 max_minutes: float | None, seed: int, log) -> None:
    torch.manual_seed(seed)
    size = tt.SMOKE_SIZE if smoke else tt.TargetSize()
    vocab = SMOKE_VOCAB if smoke else FULL_VOCAB
    tokenizer = train_tokenizer(tokenizer_texts(seed), vocab)
    init_dir = work_dir / "init"
    if not (init_dir / "config.json").exists():
        tt.write_initial_checkpoint(init_dir, size, model_vocab_size(tokenizer), seed)
    save_tokenizer(tokenizer, init_dir)
    model = tt.load_model_for_training(init_dir)
    log(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"vocab {model_vocab_size(tokenizer)} (BPE {vocab} + markers)")
    from tools.demo.finetune_tools import ToolExampleMaker

    maker = ToolExampleMaker(tokenizer, tt.make_image_processor(init_dir), docs_paragraphs())
    settings = tt.TrainSettings(steps=steps, batch_size=batch_size, seed=seed,
                                warmup_steps=min(100, max(1, steps // 10)),
                                vision_pretrain_steps=4 if smoke else tt.TrainSettings.vision_pretrain_steps)
    (work_dir / "settings.json").write_text(json.dumps(tt.settings_dict(size, settings), indent=2) + "\n")
    began = time.monotonic()
    done = tt.train_target(model, maker, settings, work_dir, log=log, max_minutes=max_minutes)
    log(f"target trained {done}/{steps} steps in {(time.monotonic() - began) / 60:.1f} min")
    export_target(model, init_dir, out_dir, log=log)
    (out_dir / "training.json").write_text(json.dumps(
        {**tt.settings_dict(size, settings), "steps_done": done}, indent=2) + "\n")


def export_saved_state(out_dir: Path, work_dir: Path, *, log) -> None:
    """Exports whatever ``train_state.pt`` holds (e.g. a run stopped early or still going)."""
    init_dir = work_dir / "init"
    model = tt.load_model_for_training(init_dir)
    state = torch.load(work_dir / "train_state.pt", weights_only=False)
    model.load_state_dict(state["model"])
    model.eval()
    log(f"exporting the target at step {state['step']}")
    export_target(model, init_dir, out_dir, log=log)


def export_target(model: torch.nn.Module, init_dir: Path, out_dir: Path, *, log) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tt.export_published(model, init_dir, out_dir, torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(init_dir / name, out_dir / name)
    tt.write_generation_config(out_dir)
    max_diff = check_against_transformers(out_dir)
    log(f"exported to {out_dir}; eaglet vs transformers max |logit diff| {max_diff:.2e}")


def check_against_transformers(checkpoint: Path) -> float:
    """Prompt logits of eaglet's loader and of transformers' reference on the exported files, both
    float32, for a scene question and a text prompt; raises if they disagree."""
    from eaglet.api import LLM
    from eaglet.testing.checkpoints import load_reference_kimi_k25
    from eaglet.testing.demo_task import user_prompt
    from tests.runtime_utils import prompt_logits

    llm = LLM(str(checkpoint), dtype="float32", show_progress=False)
    reference = load_reference_kimi_k25(checkpoint)
    scene = scenes.random_scene(random.Random("check"))
    requests = [
        {"prompt": user_prompt("Describe the image.", with_image=True), "images": [scenes.render_scene(scene)]},
        {"prompt": user_prompt("Continue the text:\nReturn the sum of", with_image=False)},
    ]
    worst = 0.0
    for request, ours in zip(requests, prompt_logits(llm, requests)):
        token_ids, mm = llm.engine._prepare_prompt(request)
        inputs = {"input_ids": torch.tensor([token_ids])}
        if mm is not None:
            inputs["pixel_values"], inputs["image_grid_thw"] = mm.pixel_values, mm.grid_thws
        with torch.no_grad():
            expected = reference(**inputs).logits[0].float()
        diff = (ours - expected).abs().max().item()
        worst = max(worst, diff)
        if diff > 1e-3 or not torch.equal(ours.argmax(-1), expected.argmax(-1)):
            raise AssertionError(f"eaglet and transformers disagree on the exported checkpoint: {diff}")
    return worst


def draft_prompts(count: int, seed: int, tokenizer_dir: Path) -> list[dict]:
    """Held-in prompts for draft training, in eaglet train-draft's format (token ids of the demo
    task's own renderings, with the rendered image): scene questions of every kind, docs
    continuations and count_shapes calls and answers, in the target's task mix, thinking on for
    about half."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    prompts = []
    for prompt in held_out_prompts(count, seed=f"draft-{seed}", thinking=None):
        ids = tokenizer.encode(prompt["prompt"], add_special_tokens=False).ids
        prompts.append({"prompt_token_ids": ids, **({"images": prompt["images"]} if "images" in prompt else {})})
    return prompts


def build_draft(out_dir: Path, work_dir: Path, *, smoke: bool, num_prompts: int, epochs: int, seed: int, log) -> None:
    from eaglet.train import TrainDraftConfig, train_draft

    target_dir = out_dir / "target"
    train_dir = work_dir / "draft_train"
    num_layers = json.loads((target_dir / "config.json").read_text())["text_config"]["num_hidden_layers"]
    # "Output of" ids: a low, a middle and the last layer. The usual [1, N//2-1, N-4] is meant for
    # targets of 30-60 layers; in a 12-layer target N-4 leaves a third of the network for the
    # one-layer draft to redo, and the last layer's output is the most predictive feature.
    aux_layer_ids = ((1, num_layers // 2 - 1, num_layers - 1) if num_layers >= 6
                     else tuple(max(0, num_layers - 3 + i) for i in range(3)))
    config = TrainDraftConfig(
        target=str(target_dir),
        prompts=draft_prompts(num_prompts, seed, target_dir),
        output_dir=str(train_dir),
        architecture="mla",
        aux_layer_ids=aux_layer_ids,
        draft_vocab_size=json.loads((target_dir / "config.json").read_text())["text_config"]["vocab_size"],
        ttt_length=DRAFT_TTT_LENGTH,
        learning_rate=DRAFT_LR,
        warmup_ratio=0.05,
        num_epochs=epochs,
        batch_size=DRAFT_BATCH_SIZE,
        max_new_tokens=SMOKE_MAX_NEW_TOKENS if smoke else DRAFT_MAX_NEW_TOKENS,
        dtype="bfloat16",
        seed=seed,
        resume=False,
        show_progress=False,
    )
    result = train_draft(config)
    log(f"draft: {result.num_steps} steps on {result.num_train_sequences} sequences in {result.train_seconds / 60:.1f} min, "
        f"loss {result.final_loss:.3f}, per-step top-1 agreement {[round(a, 3) for a in result.step_accuracies]}")
    draft_dir = out_dir / "draft"
    if draft_dir.exists():
        shutil.rmtree(draft_dir)
    draft_dir.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(train_dir / name, draft_dir / name)
    (draft_dir / "training.json").write_text(json.dumps({
        "prompts": num_prompts, "epochs": epochs, "aux_layer_ids": list(aux_layer_ids), "steps": result.num_steps, "ttt_length": DRAFT_TTT_LENGTH,
        "learning_rate": DRAFT_LR, "batch_size": DRAFT_BATCH_SIZE, "final_loss": result.final_loss,
        "step_accuracies": result.step_accuracies, "seed": seed,
    }, indent=2) + "\n")
    log(f"draft exported to {draft_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEMO_DIR, help="writes <out>/target and <out>/draft")
    parser.add_argument("--work", type=Path, default=None, help="intermediate files (default build/demo_work)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and few steps, for tests")
    parser.add_argument("--stages", default="target,draft")
    parser.add_argument("--target-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--max-minutes", type=float, default=None, help="stop target training early")
    parser.add_argument("--draft-prompts", type=int, default=None)
    parser.add_argument("--draft-epochs", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is fastest on a shared machine: no OpenMP spin-waits)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = args.work or (REPO_ROOT / "build" / ("demo_work_smoke" if args.smoke else "demo_work"))
    work.mkdir(parents=True, exist_ok=True)
    log_file = (work / "build.log").open("a")

    def log(message: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {message}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    stages = set(args.stages.split(","))
    steps = args.target_steps or (4 if args.smoke else FULL_TARGET_STEPS)
    batch_size = args.batch_size or (4 if args.smoke else 32)
    if "target" in stages:
        build_target(args.out / "target", work, smoke=args.smoke, steps=steps, batch_size=batch_size,
                     max_minutes=args.max_minutes, seed=args.seed, log=log)
    if "export" in stages:
        export_saved_state(args.out / "target", work, log=log)
    if "draft" in stages:
        build_draft(args.out, work, smoke=args.smoke, num_prompts=args.draft_prompts or (8 if args.smoke else 4000),
                    epochs=args.draft_epochs or (1 if args.smoke else 6), seed=args.seed, log=log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
