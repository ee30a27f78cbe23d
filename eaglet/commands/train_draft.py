"""``eaglet train-draft``: train an EAGLE-3 draft head for a target (eaglet/train/).

The target regenerates the responses to the prompts (JSONL, format in eaglet/train/data.py), its
aux hidden states and logits are captured, the draft trains with the training-time-test unroll,
is exported as a standard EAGLE-3 checkpoint to --output-dir, and (with --num-eval-prompts) its
accept length is measured by eaglet's own speculative decoding on held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _layer_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three comma-separated layer ids, got {text!r}") from None
    if len(ids) != 3:
        raise argparse.ArgumentTypeError(f"expected three comma-separated layer ids, got {text!r}")
    return ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", required=True, help="target checkpoint directory")
    parser.add_argument("--prompts", required=True,
                        help="JSONL, one {messages, images} / {prompt, images} / {prompt_token_ids} object a line")
    parser.add_argument("--output-dir", required=True, help="where the draft checkpoint and training state go")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="target dtype, and the exported draft's")
    draft = parser.add_argument_group("draft")
    draft.add_argument("--draft-arch", choices=("mla", "llama"), default="mla")
    draft.add_argument("--draft-vocab-size", type=_positive_int, default=32000)
    draft.add_argument("--aux-layer-ids", type=_layer_ids, default=None,
                       help="three target layers, 'output of layer id' (default: 1,N//2-1,N-4)")
    draft.add_argument("--draft-intermediate-size", type=_positive_int, default=None)
    data = parser.add_argument_group("data")
    data.add_argument("--max-new-tokens", type=_positive_int, default=256, help="regenerated response length")
    data.add_argument("--temperature", type=float, default=0.0, help="0: greedy responses")
    data.add_argument("--max-length", type=_positive_int, default=2048, help="prompt + response tokens kept")
    data.add_argument("--cache-dir", default=None, help="cache responses and captured features here for reuse")
    train = parser.add_argument_group("training")
    train.add_argument("--ttt-length", type=_positive_int, default=7)
    train.add_argument("--lr", type=float, default=5e-5)
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--warmup-ratio", type=float, default=0.02)
    train.add_argument("--lr-schedule", choices=("cosine", "linear"), default="cosine")
    train.add_argument("--epochs", type=_positive_int, default=1)
    train.add_argument("--max-steps", type=_positive_int, default=None, help="total steps (default: --epochs)")
    train.add_argument("--batch-size", type=_positive_int, default=8)
    train.add_argument("--grad-clip", type=float, default=0.5)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: at the end)")
    train.add_argument("--no-resume", action="store_true", help="ignore an existing training_state.pt")
    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--num-eval-prompts", type=int, default=0, help="prompts held out to measure accept length")
    evaluation.add_argument("--eval-max-new-tokens", type=_positive_int, default=64)
    evaluation.add_argument("--eval-initial-draft", action="store_true", help="also measure the untrained draft")
    evaluation.add_argument("--speculative-num-steps", type=_positive_int, default=3)
    evaluation.add_argument("--speculative-eagle-topk", type=_positive_int, default=1)
    evaluation.add_argument("--speculative-num-draft-tokens", type=_positive_int, default=4)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    level = logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    from eaglet.train import TrainDraftConfig, train_draft

    overrides = {"intermediate_size": args.draft_intermediate_size} if args.draft_intermediate_size else {}
    config = TrainDraftConfig(
        target=args.model_path,
        prompts=args.prompts,
        output_dir=args.output_dir,
        architecture=args.draft_arch,
        draft_vocab_size=args.draft_vocab_size,
        aux_layer_ids=args.aux_layer_ids,
        draft_config_overrides=overrides,
        ttt_length=args.ttt_length,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        warmup_ratio=args.warmup_ratio,
        lr_schedule=args.lr_schedule,
        num_epochs=args.epochs,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        max_length=args.max_length,
        grad_clip=args.grad_clip,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        dtype=args.dtype,
        cache_dir=args.cache_dir,
        save_every=args.save_every,
        resume=not args.no_resume,
        num_eval_prompts=args.num_eval_prompts,
        eval_max_new_tokens=args.eval_max_new_tokens,
        evaluate_initial_draft=args.eval_initial_draft,
        speculative_num_steps=args.speculative_num_steps,
        speculative_eagle_topk=args.speculative_eagle_topk,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        show_progress=not args.quiet,
    )
    try:
        result = train_draft(config)
    except (ValueError, OSError) as exc:
        print(f"eaglet train-draft: {exc}", file=sys.stderr)
        return 2
    summary = {
        "output_dir": str(result.output_dir),
        "steps": result.num_steps,
        "train_sequences": result.num_train_sequences,
        "final_loss": round(result.final_loss, 4),
        "step_accuracies": [round(a, 3) for a in result.step_accuracies],
        "train_seconds": round(result.train_seconds, 1),
        "tokens_per_second": round(result.tokens_per_second, 1),
    }
    if result.eval_metrics is not None:
        summary["accept_length"] = result.eval_metrics["accept_length"]
    if result.initial_eval_metrics is not None:
        summary["initial_accept_length"] = result.initial_eval_metrics["accept_length"]
    print(json.dumps(summary, indent=2))
    return 0
