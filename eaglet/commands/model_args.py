"""Model and speculation flags shared by ``eaglet serve``, ``eaglet generate`` and ``eaglet chat``,
spelled as in SGLang, and the engine they describe.

Without ``--model-path`` the bundled demo model (a small Kimi-K2.5 target and its EAGLE-3 draft) is
used, with speculation on unless ``--speculative-algorithm NONE``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_model_arguments(parser: argparse.ArgumentParser, default_log_level: str = "info") -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model-path", help="checkpoint directory (default: the bundled demo model)")
    group.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    group.add_argument("--quantization", choices=("int4", "int8"), default=None,
                       help="quantize a plain checkpoint's routed experts at load time (int4: Kimi-K2.5's published "
                            "form, one bfloat16 scale per 32 columns; int8: the same rule in 8 bits); quantized "
                            "checkpoints load as stored without it")
    group.add_argument("--quantized-layers", choices=("experts", "all"), default="experts",
                       help="what --quantization quantizes: the routed experts (as Kimi-K2.5 ships), or every linear "
                            "layer of the language model, lm_head included (as llama.cpp's Q4_0 files; reads about "
                            "half the bytes per step of a MoE model, at some accuracy)")
    group.add_argument("--activation-quantization", choices=("int8",), default=None,
                       help="multiply int4 / int8 weights by activations quantized to int8 per block of 32 (W4A8 / "
                            "W8A8, as llama.cpp's Q4_0 / Q8_0 x Q8_0): faster on CPUs, but results differ slightly "
                            "from W4A16 / W8A16 arithmetic; still batch-invariant and lossless under speculation")
    group.add_argument("--max-running-requests", type=positive_int, default=64)
    group.add_argument("--context-length", type=positive_int, default=None,
                       help="longest prompt + output (default: the model's max_position_embeddings)")
    group.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                       help="tokens per engine step (prefill chunks + decode tokens)")
    group.add_argument("--kv-cache-memory-gb", type=positive_float, default=2.0)
    group.add_argument("--disable-prefix-caching", action="store_true")
    group.add_argument("--disable-cpu-kernels", action="store_true",
                       help="run the PyTorch ops instead of eaglet's fused C++ kernels (eaglet/kernels)")
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-algorithm", type=str.upper, choices=("EAGLE3", "NONE"), default=None,
                      help="EAGLE3 needs --speculative-draft-model-path (default: EAGLE3 for the demo model, else off)")
    spec.add_argument("--speculative-draft-model-path")
    spec.add_argument("--speculative-num-steps", type=positive_int, default=3)
    spec.add_argument("--speculative-eagle-topk", type=positive_int, default=1)
    spec.add_argument("--speculative-num-draft-tokens", type=positive_int, default=4)
    spec.add_argument("--disable-speculative-adaptive", action="store_true",
                      help="always draft the configured shape (by default each decode step may draft less deeply, "
                           "or not at all, where measured costs say that is faster)")
    parallel = parser.add_argument_group("parallelism (one process per rank; see docs/tensor_parallel.md)")
    parallel.add_argument("--tp-size", "--tp", type=positive_int, default=1,
                          help="tensor-parallel ranks: attention heads, MLPs and the lm_head split across them")
    parallel.add_argument("--ep-size", "--ep", type=positive_int, default=1,
                          help="1: each routed expert split across the ranks; equal to --tp-size: whole experts "
                               "divided among them")
    parallel.add_argument("--nnodes", type=positive_int, default=1, help="machines the ranks run on")
    parallel.add_argument("--node-rank", type=int, default=0,
                          help="this machine's index; node 0 serves, the others run their ranks only")
    parallel.add_argument("--dist-init-addr", help="host:port of node 0's rendezvous (needed with --nnodes > 1)")
    parallel.add_argument("--cpu-omp-threads-bind",
                          help="this machine's ranks' cores, e.g. '0-31|32-63' (default: NUMA nodes, else the "
                               "cores divided evenly); EAGLET_CPU_OMP_THREADS_BIND sets it too")
    parallel.add_argument("--dist-timeout", type=positive_float, default=60.0,
                          help="seconds a rank may lag a collective before the group is declared broken")
    parser.add_argument("--log-level", default=default_log_level, choices=LOG_LEVELS)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=positive_int, default=128)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace):  # -> eaglet.sampling_params.SamplingParams
    """SamplingParams of the sampling flags; a value out of range exits with the field named."""
    from eaglet.errors import InvalidRequestError
    from eaglet.sampling_params import SamplingParams

    try:
        return SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos,
        )
    except InvalidRequestError as exc:
        raise SystemExit(f"eaglet: {exc}") from exc


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments for the parsed flags.

    Raises SystemExit with a message when the flags cannot describe an engine (no model and no
    demo model, a draft without an algorithm, ...).
    """
    from eaglet.demo_model import DEMO_DRAFT_DIR, DEMO_TARGET_DIR, demo_model_available

    model_path = args.model_path
    algorithm = args.speculative_algorithm
    draft_path = args.speculative_draft_model_path
    if model_path is None:
        if not demo_model_available():
            raise SystemExit(
                f"eaglet: no --model-path given and the bundled demo model is not installed (expected at "
                f"{DEMO_TARGET_DIR}); pass --model-path /path/to/checkpoint"
            )
        model_path = str(DEMO_TARGET_DIR)
        if algorithm is None:
            algorithm = "EAGLE3"
        if algorithm == "EAGLE3" and draft_path is None:
            draft_path = str(DEMO_DRAFT_DIR)
    if algorithm == "NONE":
        if draft_path is not None:
            raise SystemExit("eaglet: --speculative-draft-model-path given with --speculative-algorithm NONE")
        algorithm = None
    if algorithm == "EAGLE3" and draft_path is None:
        raise SystemExit("eaglet: --speculative-algorithm EAGLE3 needs --speculative-draft-model-path")
    if algorithm is None and draft_path is not None:
        raise SystemExit("eaglet: --speculative-draft-model-path needs --speculative-algorithm EAGLE3")
    return dict(
        model=model_path,
        dtype=args.dtype,
        quantization=args.quantization,
        quantized_layers=args.quantized_layers,
        activation_quantization=args.activation_quantization,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        enable_prefix_caching=not args.disable_prefix_caching,
        cpu_kernels=not args.disable_cpu_kernels,
        speculative_algorithm=algorithm,
        speculative_draft_model_path=draft_path,
        speculative_num_steps=args.speculative_num_steps,
        speculative_eagle_topk=args.speculative_eagle_topk,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        speculative_adaptive=not args.disable_speculative_adaptive,
        tp_size=args.tp_size,
        ep_size=args.ep_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        cpu_omp_threads_bind=args.cpu_omp_threads_bind,
        dist_timeout_s=args.dist_timeout,
    )


def build_engine(args: argparse.Namespace, show_progress: bool = True):  # -> eaglet.engine.engine.Engine
    """Loads the engine the flags describe; configuration and checkpoint problems exit with their message."""
    kwargs = engine_config_kwargs(args)
    from eaglet.engine.engine import Engine, EngineConfig
    from eaglet.errors import EagletError

    try:
        return Engine(EngineConfig(show_progress=show_progress, **kwargs))
    except (EagletError, ValueError) as exc:
        raise SystemExit(f"eaglet: cannot load the model: {exc}") from exc


def run_ranks_of_node(args: argparse.Namespace) -> int:
    """``--node-rank`` > 0: this machine's tensor-parallel ranks, until node 0 stops them."""
    from eaglet.backends import select_backend
    from eaglet.engine.engine import EngineConfig, int8_activations_for
    from eaglet.errors import EagletError
    from eaglet.executor.tp_launch import RankLoad, run_node
    from eaglet.models.registry import resolve_dtype

    config = EngineConfig(show_progress=False, **engine_config_kwargs(args))
    try:
        int8_activations = int8_activations_for(config, Path(config.model))
        dtype = resolve_dtype(config.dtype, select_backend(config.cpu_kernels, int8_activations).tile_gemm)
        load = RankLoad(
            config.model, str(dtype).removeprefix("torch."), config.cpu_kernels, config.load_time_quantization,
            int8_activations,
        )
        logging.getLogger("eaglet").info("node %d: running ranks %s", config.node_rank, list(config.parallel.local_ranks))
        return run_node(config.parallel, load)
    except EagletError as exc:
        raise SystemExit(f"eaglet: {exc}") from exc


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="[%(asctime)s %(levelname)s %(name)s] %(message)s",
        stream=sys.stderr,
        force=True,
    )


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value
