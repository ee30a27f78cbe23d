"""Fine-tunes the shipped demo target on the count_shapes tool and Kimi-K2.5's thinking section
(issue 36), from the trained weights rather than from scratch:

1. ``init``: the shipped target's files with the tokenizer grown by Kimi's seven thinking and
   tool-call markers (special tokens, ids 1024-1030), the chat template ``KIMI_K25_TOOLS_TEMPLATE``,
   ``vocab_size`` 1032, and embed_tokens / lm_head grown to match (new rows: the mean row plus small
   noise), in float32, as ``<work>/init``.
2. ``train``: the old task mix plus count_shapes calls and answers, every example with thinking on
   or off (half each), rendered exactly as the server's chat template renders them (checked at
   start). The vision tower and projector stay frozen (the scene probe that trained them is not
   needed again). Checkpoints to ``<work>/train_state.pt`` and resumes from it.
3. ``export``: the published layout into ``<out>/target`` with the eaglet-vs-transformers check.
4. ``draft``: the draft rebuilt for the new target (tools.demo.build.build_draft).

    python -m tools.demo.finetune_tools --stages init,train,export,draft [--steps 900]
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
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from eaglet.demo_model import DEMO_DIR, DEMO_TARGET_DIR
from eaglet.testing import scenes
from eaglet.testing import demo_task as task
from eaglet.testing.docs_corpus import docs_paragraphs
from tools.demo import train_target as tt
from tools.demo.tokenizer import IM_END, MEDIA_PAD, PAD, add_markers, model_vocab_size, save_tokenizer, special_token_id

REPO_ROOT = Path(__file__).resolve().parents[2]
EMBEDDING_NAMES = ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight")
TOOL_CONTEXT_SHARE = 0.15  # scene questions asked with the tool declared (answered directly)
RANDOM_RESULT_SHARE = 0.5  # tool answers whose result is a random number, not the scene's count


def make_init(source: Path, init_dir: Path, seed: int, log=print) -> None:
    """The shipped target with the markers added (see the module docstring), float32."""
    if init_dir.exists():
        shutil.rmtree(init_dir)
    init_dir.mkdir(parents=True)
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    ids = add_markers(tokenizer)
    vocab = model_vocab_size(tokenizer)
    save_tokenizer(tokenizer, init_dir)
    config = json.loads((source / "config.json").read_text())
    old_vocab = config["text_config"]["vocab_size"]
    config["text_config"]["vocab_size"] = vocab
    if "vocab_size" in config:
        config["vocab_size"] = vocab
    config["torch_dtype"] = config["text_config"]["torch_dtype"] = "float32"
    (init_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(source / "preprocessor_config.json", init_dir / "preprocessor_config.json")
    tensors = {k: v.float() for k, v in load_file(str(source / "model.safetensors")).items()}
    tensors = {k: (v if k.endswith("e_score_correction_bias") else v) for k, v in tensors.items()}
    generator = torch.Generator().manual_seed(seed)
    for name in EMBEDDING_NAMES:
        old = tensors[name]
        assert old.shape[0] == old_vocab, (name, old.shape)
        noise = torch.randn((vocab - old_vocab, old.shape[1]), generator=generator) * old.std() * 0.1
        tensors[name] = torch.cat([old, old.mean(0, keepdim=True) + noise]).contiguous()
    save_file(tensors, str(init_dir / "model.safetensors"), metadata={"format": "pt"})
    log(f"init: vocab {old_vocab} -> {vocab}, markers {ids}")


class ToolExampleMaker(tt.ExampleMaker):
    """Examples of the old tasks and the count_shapes turns, with thinking on or off; ``tool_boost``
    multiplies the tool turns' share of the mix."""

    tool_boost: float = 1.0

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def expand_image(self, ids: list[int], scene: scenes.Scene) -> tuple[list[int], torch.Tensor, tuple[int, int, int]]:
        processed = self.image_processor([scenes.render_scene(scene)])
        at = ids.index(self.image_token_id)
        ids = ids[:at] + [self.image_token_id] * processed.num_placeholder_tokens[0] + ids[at + 1:]
        return ids, processed.pixel_values, tuple(int(x) for x in processed.grid_thws[0].tolist())

    def example(self, rng: random.Random) -> tt.Example:
        kinds = list(task.TASK_WEIGHTS)
        weights = [task.TASK_WEIGHTS[k] * (self.tool_boost if k in task.TOOL_TASKS else 1.0) for k in kinds]
        kind = rng.choices(kinds, weights=weights)[0]
        thinking = rng.random() < 0.5
        scene = None
        if kind == "docs":
            prompt, answer = task.docs_prompt_and_answer(self.docs, rng)
            text = task.user_prompt(prompt, with_image=False, thinking=thinking)
            reasoning = task.reasoning_for(kind)
        elif kind in task.TOOL_TASKS:
            scene, colour, question = task.tool_request(rng)
            if kind == "tool_call":
                text = task.user_prompt(question, with_image=True, thinking=thinking, tools=True)
                reasoning = task.reasoning_for(kind, colour=colour)
                answer = task.tool_call_text(colour)
            else:
                result = (str(rng.randint(0, 9)) if rng.random() < RANDOM_RESULT_SHARE
                          else str(task.count_colour(scene, colour)))
                sent_back = task.reasoning_for("tool_call", colour=colour) if rng.random() < 0.5 else None
                text = task.tool_result_prompt(question, colour, result, thinking=thinking, reasoning=sent_back)
                reasoning = task.reasoning_for(kind, result=result)
                answer = task.tool_answer(colour, result)
        else:
            scene = scenes.random_scene(rng)
            qa = scenes.question_about(scene, kind, rng)
            tools = rng.random() < TOOL_CONTEXT_SHARE
            text = task.user_prompt(qa.question, with_image=True, thinking=thinking, tools=tools)
            reasoning = task.reasoning_for(kind, scene, qa.question)
            answer = qa.answer
        ids = self.encode(text)
        pixels = grid = labels = None
        if scene is not None:
            ids, pixels, grid = self.expand_image(ids, scene)
            labels = tt.scene_labels(scene)
        answer_ids = self.encode(task.with_reasoning(reasoning, answer, thinking) + IM_END)
        return tt.Example(ids + answer_ids, [False] * len(ids) + [True] * len(answer_ids), pixels, grid, labels)


def check_rendering(checkpoint: Path) -> None:
    """The prompt builders of demo_task against the server's own rendering (protocol messages,
    template_messages, the tokenizer's chat template through transformers)."""
    from transformers import AutoTokenizer

    from eaglet.server.chat import render_chat_prompt, template_messages, template_tools
    from eaglet.server.protocol import ChatMessage, ToolDefinition

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    tools = template_tools([ToolDefinition.model_validate(task.COUNT_SHAPES_TOOL)])
    question = "How many red shapes are there? Use the tool."
    call = {"id": task.TOOL_CALL_ID, "type": "function",
            "function": {"name": "count_shapes", "arguments": json.dumps({"color": "red"})}}
    for thinking in (True, False):
        kwargs = {} if thinking else {"thinking": False}
        user = {"role": "user", "content": [image, {"type": "text", "text": question}]}
        for reasoning in (None, "I think."):
            cases = [
                ([user], None, task.user_prompt(question, with_image=True, thinking=thinking)),
                ([user], tools, task.user_prompt(question, with_image=True, thinking=thinking, tools=True)),
                ([{"role": "user", "content": "Continue the text:\nabc"}], None,
                 task.user_prompt("Continue the text:\nabc", with_image=False, thinking=thinking)),
                ([user, {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": reasoning},
                  {"role": "tool", "tool_call_id": task.TOOL_CALL_ID, "content": "2"}], tools,
                 task.tool_result_prompt(question, "red", "2", thinking=thinking, reasoning=reasoning)),
            ]
            for messages, with_tools, expected in cases:
                rendered, _ = template_messages([ChatMessage.model_validate(m) for m in messages])
                got = render_chat_prompt(tokenizer, rendered, with_tools, kwargs)
                if got != expected:
                    raise AssertionError(f"demo_task renders\n{expected!r}\nthe template renders\n{got!r}")


def split_batch_loss(model: torch.nn.Module, examples: list[tt.Example], pad_id: int) -> torch.Tensor:
    """tt.batch_loss over the examples as two padded batches, short and long (the tool turns are
    3-4 times longer than the rest, and one batch would pad everything to them): the mean over
    all answer tokens, as one batch would give."""
    examples = sorted(examples, key=lambda e: len(e.input_ids))
    lengths = [len(e.input_ids) for e in examples]
    # the split point that pads least
    cut = min(range(1, len(examples) + 1),
              key=lambda i: i * lengths[i - 1] + (len(examples) - i) * (lengths[-1] if i < len(examples) else 0))
    total = sum(sum(e.loss_mask[1:]) for e in examples)
    loss = 0.0
    for part in (examples[:cut], examples[cut:]):
        if part:
            tokens = sum(sum(e.loss_mask[1:]) for e in part)
            loss = loss + tt.batch_loss(model, tt.collate(part, pad_id)) * (tokens / total)
    return loss


def train(init_dir: Path, work_dir: Path, *, steps: int, batch_size: int, lr: float, seed: int,
          max_minutes: float | None, tool_boost: float = 1.0, log=print) -> torch.nn.Module:
    model = tt.load_reference_kimi_k25(init_dir)
    model.train()
    for module in (model.model.vision_tower, model.model.mm_projector):
        module.requires_grad_(False)
        module.eval()
    tokenizer = Tokenizer.from_file(str(init_dir / "tokenizer.json"))
    maker = ToolExampleMaker(tokenizer, tt.make_image_processor(init_dir), docs_paragraphs())
    maker.tool_boost = tool_boost
    settings = tt.TrainSettings(steps=steps, batch_size=batch_size, lr=lr, warmup_steps=30, seed=seed,
                                checkpoint_every=100, vision_pretrain_steps=0, probe_loss_weight=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    state_path = work_dir / "train_state.pt"
    start = 0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        log(f"resumed at step {start}")

    def save(step: int) -> None:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, state_path)

    pad_id = special_token_id(PAD)
    began = time.monotonic()
    recent: list[float] = []
    step = start
    for step in range(start, steps):
        if max_minutes is not None and time.monotonic() - began > max_minutes * 60:
            log(f"time budget reached at step {step}")
            break
        rng = random.Random(f"tools-{seed}-{step}")
        examples = [maker.example(rng) for _ in range(batch_size)]
        for group in optimizer.param_groups:
            group["lr"] = tt.learning_rate(settings, step)
        loss = split_batch_loss(model, examples, pad_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        recent.append(loss.item())
        if (step + 1) % 20 == 0:
            elapsed = time.monotonic() - began
            log(f"step {step + 1}/{steps} loss {sum(recent) / len(recent):.4f} lr {tt.learning_rate(settings, step):.2e} "
                f"{elapsed / (step + 1 - start):.2f}s/step")
            recent.clear()
        if (step + 1) % settings.checkpoint_every == 0:
            save(step + 1)
    else:
        step = steps
    save(step)
    model.eval()
    return model


def export(init_dir: Path, work_dir: Path, out_dir: Path, settings: dict, log=print) -> None:
    from tools.demo.build import export_target

    model = tt.load_reference_kimi_k25(init_dir)
    state = torch.load(work_dir / "train_state.pt", weights_only=False)
    model.load_state_dict(state["model"])
    model.eval()
    log(f"exporting the fine-tuned target at step {state['step']}")
    previous = json.loads((DEMO_TARGET_DIR / "training.json").read_text()) if (DEMO_TARGET_DIR / "training.json").exists() else {}
    export_target(model, init_dir, out_dir, log=log)
    (out_dir / "training.json").write_text(json.dumps(
        {**{k: v for k, v in previous.items() if k != "tools_fine_tune"},
         "tools_fine_tune": {**settings, "steps_done": state["step"]}}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEMO_TARGET_DIR, help="the trained target to start from")
    parser.add_argument("--out", type=Path, default=DEMO_DIR)
    parser.add_argument("--work", type=Path, default=REPO_ROOT / "build" / "demo_tools_work")
    parser.add_argument("--stages", default="init,train,export,draft")
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument("--tool-boost", type=float, default=1.0,
                        help="multiplies the tool turns' weight in the mix (a resumed phase may raise it)")
    parser.add_argument("--draft-prompts", type=int, default=4000)
    parser.add_argument("--draft-epochs", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    log_file = (args.work / "build.log").open("a")

    def log(message: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {message}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    init_dir = args.work / "init"
    stages = set(args.stages.split(","))
    settings = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
                "task_weights": task.TASK_WEIGHTS, "tool_boost": args.tool_boost, "frozen": ["vision_tower", "mm_projector"]}
    if "init" in stages:
        make_init(args.source, init_dir, args.seed, log=log)
        check_rendering(init_dir)
        log("demo_task's prompts equal the chat template's rendering")
    if "train" in stages:
        began = time.monotonic()
        train(init_dir, args.work, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
              max_minutes=args.max_minutes, tool_boost=args.tool_boost, log=log)
        log(f"fine-tune took {(time.monotonic() - began) / 60:.1f} min")
    if "export" in stages:
        export(init_dir, args.work, args.out / "target", settings, log=log)
    if "draft" in stages:
        from tools.demo.build import build_draft

        build_draft(args.out, args.work, smoke=False, num_prompts=args.draft_prompts, epochs=args.draft_epochs,
                    seed=args.seed, log=log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
