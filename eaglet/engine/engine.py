"""The engine: request admission, batched prefill and decode steps, finishing, and detokenizing."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglet.backends import select_backend
from eaglet.distributed.parallel_config import ParallelConfig
from eaglet.distributed.tensor_parallel import CollectiveTime
from eaglet.engine.detokenizer import IncrementalDetokenizer, StopStringChecker
from eaglet.engine.prefix_cache import PrefixCache
from eaglet.engine.scheduler import Scheduler, SchedulerConfig, prefill_target
from eaglet.errors import ConfigError, DistributedError, ImageError, InvalidRequestError
from eaglet.executor.model_runner import ModelRunner
from eaglet.executor.request import Request, RequestOutput, RequestStatus, record_logprobs
from eaglet.executor.tp_launch import RankGroup, RankLoad
from eaglet.grammar.compiler import GrammarCompiler
from eaglet.grammar.matcher import mask_logits
from eaglet.layers.linear import Linear
from eaglet.layers.logits_processor import LogitsRow, process_logits
from eaglet.layers.sampler import sample
from eaglet.models.deepseek_v3 import ForwardOutput
from eaglet.models.eagle3 import load_eagle3_draft
from eaglet.models.load_time_quantization import LoadTimeQuantization
from eaglet.models.loader import read_checkpoint_tensor, skip_init
from eaglet.models.registry import load_model, load_model_config, resolve_dtype
from eaglet.multimodal.inputs import MultimodalInputs, expand_placeholders
from eaglet.runtime.kv_cache import KVCacheManager
from eaglet.sampling_params import SamplingParams
from eaglet.spec.config import SpeculativeConfig
from eaglet.spec.eagle_worker import EagleWorker
from eaglet.spec.metrics import SpecMetrics
from eaglet.spec.policy import SpeculationPolicy

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")


@dataclass
class EngineConfig:
    model: str
    dtype: str = "bfloat16"
    max_running_requests: int = 64
    max_num_batched_tokens: int = 2048  # tokens per step: prefill chunks + decode / verify tokens
    chunked_prefill_size: int | None = None  # largest prefill chunk of one request (default: the budget)
    enable_prefix_caching: bool = True
    context_length: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16
    kv_cache_blocks: int | None = None  # default: from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    show_progress: bool = True
    speculative_algorithm: str | None = None  # "EAGLE3"
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int = 3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 4
    # Per decode step, draft less deeply or not at all where measured costs say the configured
    # shape would give fewer tokens/s than that (see eaglet/spec/policy.py).
    speculative_adaptive: bool = True
    # Fused C++ CPU kernels (eaglet/kernels: norms, rotary, routing, attention, and on AMX,
    # AVX512-BF16 or AVX2 the bfloat16 GEMMs and experts), built on first use; where they cannot be built
    # the engine logs why and runs the PyTorch ops.
    cpu_kernels: bool = True
    # "int4" / "int8": the target's plain matrices quantized at load time (Kimi-K2.5's int4 form, or
    # int8 by its rule), those ``quantized_layers`` names: "experts" (the routed experts) or "all"
    # (every linear layer).
    quantization: str | None = None
    quantized_layers: str = "experts"
    # "int8": the target's int4 / int8 matrices meet activations quantized to int8 per block of 32
    # (W4A8 / W8A8, llama.cpp's Q8_0 activations): faster, but no longer the W4A16 arithmetic.
    activation_quantization: str | None = None
    # Tensor parallelism (eaglet.distributed.parallel_config.ParallelConfig; SGLang's flag names).
    tp_size: int = 1
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    cpu_omp_threads_bind: str | None = None
    dist_timeout_s: float = 60.0

    @property
    def load_time_quantization(self) -> LoadTimeQuantization | None:
        if self.quantization is None:
            if self.quantized_layers != "experts":
                raise ConfigError(f"quantized_layers={self.quantized_layers!r} needs a quantization (int4)")
            return None
        return LoadTimeQuantization(self.quantization, self.quantized_layers)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(
            self.tp_size, self.ep_size, self.nnodes, self.node_rank, self.dist_init_addr, self.cpu_omp_threads_bind,
            self.dist_timeout_s,
        )


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = Path(config.model)
        if not model_dir.is_dir():
            raise ConfigError(f"model path {config.model!r} is not a directory")
        parallel = config.parallel
        quantize = config.load_time_quantization
        int8_activations = int8_activations_for(config, model_dir)
        self.backend = select_backend(config.cpu_kernels, int8_activations)
        dtype = resolve_dtype(config.dtype, self.backend.tile_gemm)
        self.tp_group: RankGroup | None = None
        if parallel.tp_size > 1:
            load = RankLoad(
                str(model_dir), str(dtype).removeprefix("torch."), config.cpu_kernels, quantize, int8_activations
            )
            self.tp_group = RankGroup(parallel, load)
        try:
            self._build(config, model_dir, dtype)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, model_dir: Path, dtype: torch.dtype) -> None:
        tp = self.tp_group.tp if self.tp_group is not None else None
        try:
            self.model, self.model_config = load_model(
                model_dir, dtype, backend=self.backend, show_progress=config.show_progress, quantize=config.load_time_quantization,
                tp=tp,
            )
        except Exception as exc:
            if self.tp_group is not None:  # the other ranks stop too; this rank's error is the one to raise
                with contextlib.suppress(ConfigError):
                    self.tp_group.agree_loaded(f"{type(exc).__name__}: {exc}", self.backend)
            raise
        if self.tp_group is not None:
            self.tp_group.agree_loaded(None, self.backend)
        text = self.model_config.text
        self.context_len = min(config.context_length or text.max_position_embeddings, text.max_position_embeddings)
        self.tokenizer = _load_tokenizer(model_dir)
        self.eos_token_ids = set(text.eos_token_ids) | _generation_eos(model_dir)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.grammars = GrammarCompiler(self.tokenizer, text.vocab_size, self.eos_token_ids)
        self.image_processor = None
        if self.model_config.is_multimodal:
            from eaglet.multimodal.image_processor import ImageProcessorConfig, KimiImageProcessor

            self.image_processor = KimiImageProcessor(ImageProcessorConfig.from_pretrained(model_dir))

        self.spec_config = _speculative_config(config)
        # Row indices a speculative round uses past a request's committed tokens.
        self.spec_scratch = self.spec_config.scratch_len if self.spec_config else 0
        blocks_per_request = -(-(self.context_len + self.spec_scratch) // config.block_size)
        if config.kv_cache_blocks is not None:
            num_blocks = config.kv_cache_blocks
        else:
            block_bytes = text.num_hidden_layers * config.block_size * text.kv_cache_dim * dtype.itemsize
            by_memory = int(config.kv_cache_memory_gb * 2**30 // block_bytes)
            num_blocks = min(by_memory, config.max_running_requests * blocks_per_request)
        geometry = dict(
            num_layers=text.num_hidden_layers,
            kv_cache_dim=text.kv_cache_dim,
            num_blocks=num_blocks + 1,
            block_size=config.block_size,
            max_requests=config.max_running_requests,
            max_context_len=self.context_len + self.spec_scratch,
            dtype=dtype,
        )
        self.cache = KVCacheManager(**geometry, ops=self.backend.cache)
        followers = None
        if self.tp_group is not None:
            followers = self.tp_group.followers
            followers.setup_cache(geometry)
        self.runner = ModelRunner(
            self.model, self.model_config, self.cache, self.backend.mla_attention(self.cache, None), followers
        )
        self.spec_worker: EagleWorker | None = None
        self.spec_metrics: SpecMetrics | None = None
        self.spec_policy: SpeculationPolicy | None = None
        if self.spec_config is not None:
            draft, draft_config = load_eagle3_draft(
                self.spec_config.draft_model_path, self.model_config, dtype, self.backend, show_progress=config.show_progress
            )
            draft.share_target_weights(self.model.embed_tokens, self._lm_head_for_draft(draft, model_dir, dtype))
            self.spec_worker = EagleWorker(
                self.runner, draft, draft_config, self.spec_config, self.cache, self.backend, frozenset(self.eos_token_ids)
            )
            self.spec_metrics = SpecMetrics(self.spec_config.num_steps)
            self.spec_policy = SpeculationPolicy(self.spec_config, adaptive=config.speculative_adaptive)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_running_requests, config.max_num_batched_tokens, config.chunked_prefill_size),
            self.cache,
            decode_cost=self.spec_config.num_draft_tokens if self.spec_config else 1,
            decode_growth=self.spec_scratch or 1,
            prefix_cache=PrefixCache(self.cache.allocator, config.block_size) if config.enable_prefix_caching else None,
        )
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    def _lm_head_for_draft(self, draft: torch.nn.Module, model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
        """The target's lm_head for a draft without its own. Under tensor parallelism the target's is
        split by vocabulary across the ranks and the draft runs on rank 0 alone, so rank 0 reads a
        whole copy from the checkpoint (vocab x hidden more memory on rank 0 only)."""
        head = _lm_head(self.model)
        if self.tp_group is None or draft.own_lm_head:
            return head
        if self.model_config.text.tie_word_embeddings:
            weight = self.model.embed_tokens.weight.detach()
        else:
            name = next(n for n, p in self.model.named_parameters() if p is head.weight)
            weight = read_checkpoint_tensor(model_dir, name).to(dtype)
        with skip_init(dtype):
            whole = Linear(weight.shape[1], weight.shape[0], False, self.backend.weights)
        whole.weight = torch.nn.Parameter(weight, requires_grad=False)
        whole.process_weights_after_loading()
        return whole

    # ---- the tensor-parallel group ----------------------------------------------------------
    def check_health(self) -> None:
        """Raises DistributedError once a tensor-parallel rank failed (no-op in one process)."""
        if self.tp_group is not None:
            self.tp_group.followers.check()

    def collective_time(self) -> CollectiveTime | None:
        """Rank 0's time inside collectives (tensor parallelism), for the bench's share of a step."""
        return self.tp_group.tp.collective_time() if self.tp_group is not None else None

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (no-op in one process); the engine is unusable after."""
        group, self.tp_group = getattr(self, "tp_group", None), None
        if group is not None:
            group.close()

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: str | dict[str, Any], params: SamplingParams, request_id: str | None = None) -> str:
        """Validates and queues a request. Raises InvalidRequestError (nothing is queued) on bad input."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        params.validate_for_vocab(self.model_config.text.vocab_size)
        token_ids, mm_inputs = self._prepare_prompt(prompt)
        needed = len(token_ids) + params.max_new_tokens
        if needed > self.context_len:
            raise InvalidRequestError(
                f"prompt of {len(token_ids)} tokens + max_new_tokens {params.max_new_tokens} = {needed} "
                f"exceeds the context length {self.context_len}"
            )
        if self.cache.blocks_needed(needed + self.spec_scratch) > self.cache.allocator.num_usable:
            raise InvalidRequestError(
                f"request needs {self.cache.blocks_needed(needed + self.spec_scratch)} cache blocks; the cache has "
                f"{self.cache.allocator.num_usable}"
            )
        generator = None
        if not params.greedy:
            generator = torch.Generator()
            generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
        final_ids = tuple(sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)))
        grammar = None
        if params.structured_output is not None:
            grammar = self.grammars.matcher(params.structured_output, final_ids)
        req = Request(request_id, token_ids, params, mm_inputs, generator=generator, final_token_ids=final_ids, grammar=grammar)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            req.stop_checker = StopStringChecker(params.stop, params.include_stop_str_in_output, params.min_tokens)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def _prepare_prompt(self, prompt: str | dict[str, Any]) -> tuple[list[int], MultimodalInputs | None]:
        images: list[Any] = []
        if isinstance(prompt, str):
            token_ids = self._encode(prompt)
        elif isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "images"}
            if unknown:
                raise InvalidRequestError(f"unknown request fields: {sorted(unknown)}")
            if "prompt_token_ids" in prompt:
                token_ids = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                token_ids = self._encode(prompt["prompt"])
            else:
                raise InvalidRequestError("a request dict needs 'prompt_token_ids' or 'prompt'")
            images = list(prompt.get("images") or [])
        else:
            raise InvalidRequestError(f"a request is a string or a dict, got {type(prompt).__name__}")
        vocab = self.model_config.text.vocab_size
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if not self.model_config.is_multimodal:
            if images:
                raise InvalidRequestError("this model has no vision tower; images are not accepted")
            return token_ids, None
        image_token_id = self.model_config.image_token_id
        if not images:
            if image_token_id in token_ids:
                raise InvalidRequestError(
                    f"the prompt holds image placeholder token(s) (id {image_token_id}) but no images were given"
                )
            return token_ids, None
        from eaglet.multimodal.image_processor import load_image

        try:
            processed = self.image_processor([load_image(img) for img in images])
        except ImageError:
            raise
        except Exception as exc:  # a PIL decoder failing half-way raises its own types
            raise ImageError(f"could not process the image: {exc}") from exc
        token_ids, positions = expand_placeholders(token_ids, image_token_id, processed.num_placeholder_tokens)
        return token_ids, MultimodalInputs(processed.pixel_values, processed.grid_thws, positions)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer; pass {'prompt_token_ids': [...]}")
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.scheduler.prefix_cache

    def num_free_blocks(self) -> int:
        """Blocks no request holds: free, or held only by the prefix cache (evictable on demand)."""
        evictable = self.prefix_cache.num_evictable_blocks if self.prefix_cache is not None else 0
        return self.cache.num_free_blocks + evictable

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def waiting(self) -> list[Request]:
        return list(self.scheduler.waiting)

    # ---- stepping -------------------------------------------------------------------------
    def step(self, stream_text: bool = True) -> list[RequestOutput]:
        """One scheduler step: the planned prefill chunks, then one decode token (or one speculative
        round) for every request whose prompt is cached.

        Returns an output for every request that got new tokens or finished in this step; with
        ``stream_text=False`` those of unfinished requests carry no text (None), so a caller that
        reads only finished outputs (offline generation) lets requests without stop strings decode
        their text once, when they finish.
        """
        plan = self.scheduler.schedule()
        touched: list[Request] = []
        for phase, requests, run in (
            ("prefill", plan.prefill, lambda: self._run_prefill(plan.prefill, plan.prefill_lens)),
            ("decode", plan.decode, lambda: self._run_decode(plan.decode)),
        ):
            if not requests:
                continue
            try:
                touched += run()
            except DistributedError as exc:  # the ranks are out of step: nothing can run any more
                self._fail(phase, list(self.requests.values()), exc)
                raise
            except Exception as exc:  # contained to the requests of the phase that raised
                touched += self._fail(phase, requests, exc)
        for req in plan.prefill + plan.decode:
            if req.request_id in self.requests:
                self.scheduler.publish(req)
        return [self.output_of(r, with_text=stream_text or r.finish_reason is not None) for r in touched]

    def _fail(self, phase: str, requests: list[Request], exc: Exception) -> list[Request]:
        """Ends the requests of a prefill or decode phase that raised (finish_reason "error", cache
        freed, nothing of theirs published); the other phase, waiting requests and later steps go on."""
        logger.exception("%s of %d request(s) failed; stopping them", phase, len(requests))
        failed = [r for r in requests if r.request_id in self.requests]
        for req in failed:
            req.error = f"{type(exc).__name__}: {exc}"
            self._finish(req, "error")
        return failed

    def _run_prefill(self, requests: list[Request], num_new: list[int]) -> list[Request]:
        """Prefill chunks; a request whose fresh prompt completes gets its first token sampled."""
        samples = [
            not r.output_token_ids and r.num_cached_tokens + n == prefill_target(r) for r, n in zip(requests, num_new)
        ]
        if self.spec_worker is not None:
            tokens = self.spec_worker.prefill(requests, num_new, lambda logits: self._sample(requests, logits, samples))
        else:
            _, output = self.runner.extend(requests, num_new)
            tokens = self._sample(requests, output.logits, samples)
        sampled = [r for r, s in zip(requests, samples) if s]
        self._append(sampled, [[t] for t, s in zip(tokens.tolist(), samples) if s])
        return sampled

    def _run_decode(self, requests: list[Request]) -> list[Request]:
        if self.spec_worker is not None:
            self._run_speculative_decode(requests)
        else:
            greedy_ids = all(r.greedy_ids_suffice for r in requests)
            _, output = self.runner.extend(requests, [1] * len(requests), greedy_ids_only=greedy_ids)
            self._append(requests, [[t] for t in self._next_tokens(requests, output).tolist()])
        return requests

    def _run_speculative_decode(self, requests: list[Request]) -> None:
        # A seeded sampled request keeps the configured shape: its random draws, hence its output,
        # then do not depend on timing or on the other requests of the batch.
        pinned = any(r.sampling_params.seed is not None and not r.sampling_params.greedy for r in requests)
        # The bonus token comes anyway: drafts past a request's last allowed token are wasted.
        useful = max(r.sampling_params.max_new_tokens - len(r.output_token_ids) for r in requests) - 1
        level = self.spec_policy.choose(len(requests), pinned, useful)
        start = time.perf_counter()
        if level == 0:
            tokens = self.spec_worker.plain_decode(requests, lambda output: self._next_tokens(requests, output))
            self.spec_metrics.num_plain_decode_steps += 1
            self._append(requests, [[t] for t in tokens.tolist()])
            self.spec_policy.record(len(requests), level, time.perf_counter() - start)
            return
        num_steps, topk, num_draft_tokens = self.spec_policy.shape(level)
        result = self.spec_worker.decode(requests, num_steps, num_draft_tokens, topk)
        kept = self._append(requests, result.new_tokens)
        # Only emitted tokens count (spec/metrics.py): a round cut inside its accepted drafts books
        # the tokens it kept.
        accepted = [min(a + 1, k) - 1 for a, k in zip(result.num_accepted, kept)]
        drafts = [result.num_drafted if k > a else k - 1 for a, k in zip(result.num_accepted, kept)]
        self.spec_metrics.record(accepted, drafts)
        for req, a in zip(requests, accepted):
            req.spec_verify_ct += 1
            req.spec_accepted_tokens += a
            req.spec_accept_lengths.append(a + 1)
        # Appending is timed too (a round appends several tokens per request). The catch-up after
        # plain steps is the cost of switching back, not of this level's rounds.
        seconds = time.perf_counter() - start - self.spec_worker.catch_up_seconds
        self.spec_policy.record(len(requests), level, seconds, result.num_accepted, result.num_drafted)

    def _next_tokens(self, requests: list[Request], output: ForwardOutput) -> torch.Tensor:
        """A decode step's tokens: the forward's greedy ids where it returned them, else sampled."""
        return output.greedy_ids if output.greedy_ids is not None else self._sample(requests, output.logits)

    def _sample(self, requests: list[Request], logits: torch.Tensor, rows: list[bool] | None = None) -> torch.Tensor:
        """Next tokens for the rows that need one (others get -1 and draw no random numbers).

        A request's grammar masks the raw logits first (logprobs are those of the masked logits, as
        vLLM's); then penalties, logit bias and min_tokens shape them.
        """
        index = list(range(len(requests))) if rows is None else [i for i, needed in enumerate(rows) if needed]
        if not index:
            return torch.full((len(requests),), -1, dtype=torch.long)
        every_row = len(index) == len(requests)
        chosen = requests if every_row else [requests[i] for i in index]
        raw = mask_logits(logits if every_row else logits[index], [r.grammar for r in chosen])
        processed = process_logits(
            raw, [LogitsRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids) for r in chosen], self.eos_token_ids
        )
        picked = sample(processed, [r.sampling_params for r in chosen], [r.generator for r in chosen], self.backend.sampling)
        record_logprobs(chosen, raw, picked[:, None])
        if every_row:
            return picked
        tokens = torch.full((len(requests),), -1, dtype=torch.long)
        tokens[index] = picked
        return tokens

    def _append(self, requests: list[Request], new_tokens: list[list[int]]) -> list[int]:
        """Appends each request's new tokens (one sampled token, or a speculative block), cut at the
        first finish in token order: EOS / stop token ids / max_new_tokens at a token, or a stop
        string completed by a token (which wins at the same token). Token ids, text and logprobs are
        all cut at that point, exactly as one-token-at-a-time decoding would cut them.

        Returns how many of each request's new tokens were kept (at least 1)."""
        kept: list[int] = []
        for req, tokens in zip(requests, new_tokens):
            num_before = len(req.output_token_ids)
            reason = None
            for i, token in enumerate(tokens):
                reason = self._finish_reason(req, len(req.output_token_ids) + i + 1, token)
                if req.grammar is not None and reason != "stop":  # a token that ends the request is no output
                    req.grammar.accept(token)
                    if req.grammar.finished:  # the output is complete: end it without asking for EOS
                        reason = "stop"
                if reason is not None:
                    tokens = tokens[: i + 1]
                    break
            req.output_token_ids.extend(tokens)
            if req.detokenizer is not None:
                # Without stop strings nothing needs the text before it is read (output_of, the end).
                match = None
                if req.stop_checker.stops:
                    req.detokenizer.append(tokens)
                    match = req.stop_checker.check(req.detokenizer)
                else:
                    req.detokenizer.defer(tokens)
                if match is not None:
                    del req.output_token_ids[match.num_tokens :]
                    req.final_text, reason = match.text, "stop"
                elif reason is not None:
                    req.detokenizer.finish()
                    req.final_text = req.detokenizer.text
            # Logprobs were recorded for every proposed token; keep those of the tokens kept.
            del req.output_logprobs[len(req.output_token_ids) :]
            kept.append(max(1, len(req.output_token_ids) - num_before))
            if reason is not None:
                self._finish(req, reason)
        return kept

    def _finish_reason(self, req: Request, num_generated: int, token: int) -> str | None:
        params = req.sampling_params
        if token in req.final_token_ids:
            if num_generated > params.min_tokens:
                return "stop"
        if num_generated >= params.max_new_tokens:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        if reason not in ("abort", "error"):
            self.scheduler.publish(req)
        self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        req.mm_inputs = None

    def abort(self, request_id: str) -> None:
        """Stops a request at once and frees everything it holds; unknown ids are ignored."""
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, "abort")

    def output_of(self, req: Request, with_text: bool = True) -> RequestOutput:
        """The request's output so far; unfinished text holds back a possible partial stop string
        (``with_text=False``: None, and the detokenizer is not read)."""
        text = req.final_text
        if text is None and req.detokenizer is not None and with_text:
            text = req.stop_checker.streamable_text(req.detokenizer)
        return RequestOutput(
            req.request_id,
            req.prompt_token_ids,
            list(req.output_token_ids),
            text,
            req.finish_reason,
            spec_verify_ct=req.spec_verify_ct,
            spec_accepted_tokens=req.spec_accepted_tokens,
            spec_accept_lengths=list(req.spec_accept_lengths),
            logprobs=list(req.output_logprobs) if req.sampling_params.logprobs is not None else None,
            prompt_logprobs=list(req.prompt_logprobs) if req.sampling_params.prompt_logprobs is not None else None,
            error=req.error,
        )


def _speculative_config(config: EngineConfig) -> SpeculativeConfig | None:
    if config.speculative_algorithm is None:
        if config.speculative_draft_model_path is not None:
            raise ConfigError("speculative_draft_model_path is set but speculative_algorithm is not (use 'EAGLE3')")
        return None
    if config.speculative_draft_model_path is None:
        raise ConfigError("speculative_algorithm EAGLE3 needs speculative_draft_model_path")
    return SpeculativeConfig(
        draft_model_path=config.speculative_draft_model_path,
        algorithm=config.speculative_algorithm,
        num_steps=config.speculative_num_steps,
        eagle_topk=config.speculative_eagle_topk,
        num_draft_tokens=config.speculative_num_draft_tokens,
    )


def _lm_head(model: torch.nn.Module) -> torch.nn.Linear:
    language_model = getattr(model, "language_model", model)
    return language_model.lm_head


def int8_activations_for(config: EngineConfig, model_dir: Path) -> bool:
    """Whether the engine runs W4A8 / W8A8; refused where the target has no integer matrices to run it on."""
    if config.activation_quantization is None:
        return False
    if config.activation_quantization != "int8":
        raise ConfigError(
            f"activation_quantization={config.activation_quantization!r}: the one activation quantization is 'int8' "
            "(W4A8 / W8A8, for int4 or int8 weights)"
        )
    scheme = load_model_config(model_dir).quantization
    if config.quantization not in ("int4", "int8") and (scheme is None or scheme.format != "int4"):
        stored = "no quantization_config" if scheme is None else f"{scheme.format} weights"
        raise ConfigError(
            f"activation_quantization='int8' runs int4 or int8 weights against int8 activations, and {model_dir} has "
            f"{stored}; add --quantization int4 (or int8) to quantize its routed experts at load time"
        )
    return True


def _load_tokenizer(model_dir: Path):  # -> transformers.PreTrainedTokenizerBase | None
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ConfigError(f"{model_dir}: tokenizer files are present but could not be loaded ({exc})") from exc


def _generation_eos(model_dir: Path) -> set[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return set()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    if isinstance(eos, int):
        return {eos}
    return {t for t in eos or [] if isinstance(t, int)}
