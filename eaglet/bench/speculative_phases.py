"""EAGLE-3 speculative decoding benchmark: eaglet with and without speculation, same target.

    python -m eaglet.bench.speculative_phases                       # batch 1 and 8, chain and tree, echo dial 1.0
    python -m eaglet.bench.speculative_phases --alpha 0.3 --batch-sizes 1,4,16 --repeats 5

The target is a random DeepSeek-V3 checkpoint (about 20M parameters by default) turned into an
"acceptance dial" (eaglet.testing.echo_checkpoints: lm_head = embed_tokens, residual branches scaled by
``--alpha``), and the draft an MLA EAGLE-3 head that predicts "the same token again"; the target
repeats itself more often at small alpha, so acceptance is controlled rather than random. With
``--random-draft`` the draft is random instead (acceptance near zero: the worst case).

For each batch size, decoding is timed from the first decode step (prefill excluded) through
``engine.step()``; tokens/s = generated tokens after the first / decode time; medians over
``--repeats``. The speculative rounds are split into draft forwards, the target verify forward and
bookkeeping (tree building, masks, acceptance, cache moves, batch metadata), from the worker's
phase timer. Results go to stdout and ``<--results-dir>/spec-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from eaglet import LLM, SamplingParams
from eaglet.bench.results_files import write_record
from eaglet.bench.settings import DEFAULT_RESULTS_DIR
from eaglet.testing.draft_checkpoints import write_eagle3_draft
from eaglet.testing.echo_checkpoints import echo_draft, echo_text_target

TARGET = dict(
    vocab_size=8000, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=6,
    q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=1024,
)
SETTINGS = {"chain (3,1,4)": (3, 1, 4), "tree (4,2,8)": (4, 2, 8)}


def decode_rate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    engine = llm.engine
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, params)
    engine.step()  # prefill + first token
    start = time.perf_counter()
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.finished]
    elapsed = time.perf_counter() - start
    return len(prompts) * (new_tokens - 1) / elapsed, sorted(outputs, key=lambda o: int(o.request_id))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--alpha", type=float, default=1.0, help="echo dial of the target (smaller: more acceptance)")
    parser.add_argument("--random-draft", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS_DIR)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    workdir = Path(tempfile.mkdtemp(prefix="eaglet-spec-bench-"))
    target = echo_text_target(workdir / "target", args.alpha, TARGET, seed=3)
    if args.random_draft:
        draft = write_eagle3_draft(workdir / "draft", target, kind="mla", seed=4, draft_vocab_size=None)
    else:
        draft = echo_draft(target, workdir / "draft", kind="mla", seed=4)
    plain = LLM(str(target), dtype=args.dtype, show_progress=False)
    spec = {
        name: LLM(str(target), dtype=args.dtype, show_progress=False, speculative_algorithm="EAGLE3",
                  speculative_draft_model_path=str(draft), speculative_num_steps=s, speculative_eagle_topk=k,
                  speculative_num_draft_tokens=n)
        for name, (s, k, n) in SETTINGS.items()
    }
    warmup = [[1] * args.prompt_len]
    for llm in [plain, *spec.values()]:  # first calls pay one-time library initialisation
        decode_rate(llm, warmup, 8)
    rows = []
    gen = torch.Generator().manual_seed(1)
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = torch.randint(0, TARGET["vocab_size"], (batch, args.prompt_len), generator=gen).tolist()
        rates: dict[str, list[float]] = {"plain": []}
        stats: dict[str, dict] = {}
        for _ in range(args.repeats):  # interleaved so drift on a noisy machine hits every mode alike
            rate, plain_out = decode_rate(plain, prompts, args.new_tokens)
            rates["plain"].append(rate)
            for name, llm in spec.items():
                worker = llm.engine.spec_worker
                worker.timer.reset()
                before = llm.spec_metrics()
                rate, out = decode_rate(llm, prompts, args.new_tokens)
                assert [o.token_ids for o in out] == [o.token_ids for o in plain_out], "speculation changed the output"
                rates.setdefault(name, []).append(rate)
                after = llm.spec_metrics()
                verify = after["num_verify_steps"] - before["num_verify_steps"]
                accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
                stats[name] = {
                    "accept_length": (accepted + verify) / max(1, verify),
                    "per_position_acceptance_rate": after["per_position_acceptance_rate"],
                    "phase_share": worker.timer.shares(),
                    "ms_per_round": 1000 * sum(worker.timer.seconds.values()) / max(1, worker.timer.rounds),
                }
        plain_rate = statistics.median(rates["plain"])
        rows.append({"batch": batch, "mode": "plain", "tokens_per_s": plain_rate, "ratio_vs_plain": 1.0})
        for name in spec:
            rate = statistics.median(rates[name])
            rows.append({"batch": batch, "mode": name, "tokens_per_s": rate, "ratio_vs_plain": rate / plain_rate, **stats[name]})

    print(f"target {sum(p.numel() for p in plain.engine.model.parameters()) / 1e6:.1f}M params, dtype {args.dtype}, "
          f"alpha {args.alpha}, {'random' if args.random_draft else 'echo'} draft, {torch.get_num_threads()} threads")
    print(f"{'batch':>5} {'mode':<15} {'tok/s':>8} {'vs plain':>8} {'accept':>7} {'draft':>6} {'verify':>6} {'bookkeep':>8} {'ms/round':>8}")
    for r in rows:
        share = r.get("phase_share", {})
        print(f"{r['batch']:>5} {r['mode']:<15} {r['tokens_per_s']:>8.1f} {r['ratio_vs_plain']:>8.2f} "
              f"{r.get('accept_length', float('nan')):>7.2f} {share.get('draft', float('nan')):>6.1%} "
              f"{share.get('verify', float('nan')):>6.1%} {share.get('bookkeeping', float('nan')):>8.1%} "
              f"{r.get('ms_per_round', float('nan')):>8.1f}")
    record = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__}, "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out = write_record(args.results_dir, "spec", record)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
