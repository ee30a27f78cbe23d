"""Online serving benchmark: Poisson arrivals of mixed text and image requests, with and without EAGLE-3.

    python -m eaglet.bench.online_serving                     # 64 requests at 4 req/s
    python -m eaglet.bench.online_serving --num-requests 32 --rate 8

One process drives ``Engine.step()`` and admits each request when its (seeded) Poisson arrival time
has passed, so both runs see the same workload. Per request: TTFT (arrival to first token) and
inter-token latencies (time between output growths, divided by the tokens each growth brought, so a
speculative block of k tokens counts as k gaps). Reports throughput (generated tokens / makespan),
TTFT and ITL p50/p99, mean accept length, and the plain/speculative ratio; writes
``<--results-dir>/online-<timestamp>.json``. The target is a random Kimi-K2.5 checkpoint turned
into the echo acceptance dial (eaglet.testing.echo_checkpoints), the draft an echo MLA head.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eaglet import LLM, SamplingParams
from eaglet.bench.results_files import write_record
from eaglet.bench.settings import DEFAULT_RESULTS_DIR
from eaglet.testing.echo_checkpoints import IMAGE_TOKEN, echo_draft, echo_kimi_target
from eaglet.testing.images import make_image


def workload(n: int, rate: float, seed: int) -> list[tuple[float, dict, SamplingParams]]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    requests = []
    for i, at in enumerate(arrivals):
        length = int(rng.integers(8, 96))
        ids = rng.integers(0, 240, length).tolist()
        prompt: dict = {"prompt_token_ids": ids}
        if i % 3 == 0:  # a third of the requests carry an image
            prompt = {"prompt_token_ids": ids[: length // 2] + [IMAGE_TOKEN] + ids[length // 2 :],
                      "images": [make_image(int(rng.integers(16, 64)), int(rng.integers(16, 64)), i)]}
        params = SamplingParams(max_new_tokens=int(rng.integers(16, 64)), temperature=0.0, ignore_eos=True)
        requests.append((float(at), prompt, params))
    return requests


def run(llm: LLM, requests: list[tuple[float, dict, SamplingParams]]) -> dict:
    engine = llm.engine
    start = time.perf_counter()
    pending = list(requests)
    arrival, first, last_time, last_len, gaps, done = {}, {}, {}, {}, [], {}
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, prompt, params = pending.pop(0)
            rid = engine.add_request(prompt, params)
            arrival[rid] = at
            last_len[rid] = 0
        if not engine.has_unfinished():
            time.sleep(min(0.01, max(0.0, pending[0][0] - now)))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            rid, grown = out.request_id, len(out.token_ids) - last_len[out.request_id]
            if grown <= 0:
                continue
            if rid not in first:
                first[rid] = now
            else:
                gaps.extend([(now - last_time[rid]) / grown] * grown)
            last_time[rid], last_len[rid] = now, len(out.token_ids)
            if out.finished:
                done[rid] = out
    makespan = time.perf_counter() - start
    ttft = [first[r] - arrival[r] for r in first]
    tokens = sum(len(o.token_ids) for o in done.values())
    verify = sum(o.spec_verify_ct for o in done.values())
    accepted = sum(o.spec_accepted_tokens for o in done.values())
    return {
        "throughput_tok_s": tokens / makespan,
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_p99_ms": 1000 * float(np.percentile(ttft, 99)),
        "itl_p50_ms": 1000 * statistics.median(gaps),
        "itl_p99_ms": 1000 * float(np.percentile(gaps, 99)),
        "accept_length": (accepted + verify) / verify if verify else None,
        "max_running": engine.config.max_running_requests,
        "outputs": {rid: o.token_ids for rid, o in done.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second")
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS_DIR)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    workdir = Path(tempfile.mkdtemp(prefix="eaglet-online-"))
    target = echo_kimi_target(workdir / "target", args.alpha, seed=5)
    draft = echo_draft(target, workdir / "draft", kind="mla", seed=6)
    requests = workload(args.num_requests, args.rate, args.seed)
    common = dict(dtype="float32", show_progress=False, max_running_requests=32)
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
                speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    modes = {
        "plain": {},
        "eagle3 (3,1,4) fixed": {**spec, "speculative_adaptive": False},
        "eagle3 (3,1,4) adaptive": spec,
    }
    results, policies = {}, {}
    for name, extra in modes.items():
        llm = LLM(str(target), **extra, **common)
        run(llm, workload(2, 100.0, 99))  # warm-up
        results[name] = run(llm, requests)
        if extra:
            policies[name] = llm.spec_metrics()["policy"]
    by_id = [[t for _, t in sorted(r["outputs"].items(), key=lambda item: int(item[0]))] for r in results.values()]
    assert all(outputs == by_id[0] for outputs in by_id), "speculation changed an output"
    print(f"{args.num_requests} requests, Poisson {args.rate}/s, 1/3 with an image, greedy, echo alpha {args.alpha}")
    print(f"{'mode':<24} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'accept':>7}")
    for name, r in results.items():
        accept = f"{r['accept_length']:.2f}" if r["accept_length"] else "-"
        print(f"{name:<24} {r['throughput_tok_s']:>7.1f} {r['ttft_p50_ms']:>8.0f}ms {r['ttft_p99_ms']:>8.0f}ms "
              f"{r['itl_p50_ms']:>7.1f}ms {r['itl_p99_ms']:>7.1f}ms {accept:>7}")
    plain = results["plain"]
    ratios = {name: {"throughput": r["throughput_tok_s"] / plain["throughput_tok_s"],
                     "itl_p50": r["itl_p50_ms"] / plain["itl_p50_ms"]}
              for name, r in results.items() if name != "plain"}
    for name, ratio in ratios.items():
        print(f"{name} / plain: throughput {ratio['throughput']:.2f}x, ITL p50 {ratio['itl_p50']:.2f}x")
    for name, policy in policies.items():
        if policy["adaptive"]:
            print(f"{name}: decode steps per level: {policy['decode_steps_per_level']}; "
                  f"chosen level per batch bucket: {policy['best_level_per_batch_bucket']}")
    out = write_record(args.results_dir, "online", {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ratios": ratios, "policies": policies,
        "results": {k: {m: v for m, v in r.items() if m != "outputs"} for k, r in results.items()}})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
