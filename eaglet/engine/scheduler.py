"""Which requests run in the next step, and how many tokens each: continuous batching.

Every step serves, within ``max_num_batched_tokens``:

1. decode work for every request whose prompt is cached (one token each, or one speculative
   round costing ``decode_cost`` tokens);
2. the next chunk of prompts being prefilled, oldest first;
3. newly admitted requests, while rows, blocks and budget last, unless an earlier request of this
   step had to wait or preempt for blocks (a newer request must not take what an older one needs).

The progress rule (``_fit``, the one place blocks are found for running requests): a running
request whose work does not fit the free blocks preempts running requests newer than itself,
newest first (their cache freed, recomputed when readmitted); if it is the newest, it is
preempted itself. So the oldest running request is never preempted and always gets its work (it
fits the cache alone, which admission checks), every step runs work while requests are
unfinished, and every request finishes.

A request's prompt is "cached" once ``prefill_target`` tokens are: the whole prompt for a fresh
request; prompt + output minus the last token for a preempted one (its last token is the next
decode input, so nothing is sampled twice).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from eaglet.runtime.kv_cache import KVCacheManager
from eaglet.engine.prefix_cache import PrefixCache, block_keys, image_spans
from eaglet.executor.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_running_requests: int = 64
    max_num_batched_tokens: int = 2048
    chunked_prefill_size: int | None = None  # largest prefill chunk per request (default: the budget)


@dataclass
class StepPlan:
    prefill: list[Request] = field(default_factory=list)
    prefill_lens: list[int] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


def prefill_target(req: Request) -> int:
    return req.num_tokens - 1 if req.output_token_ids else req.num_tokens


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: KVCacheManager,
        *,
        decode_cost: int = 1,
        decode_growth: int = 1,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.decode_cost = decode_cost
        self.decode_growth = decode_growth
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._planned_blocks = 0  # blocks set aside by the plan being built
        self._planned: dict[int, int] = {}  # id(request) -> its blocks among them

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Drops a request from the queues and frees its cache (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._planned_blocks = 0
        self._planned = {}
        budget = self.config.max_num_batched_tokens
        for req in [r for r in self.running if r.num_cached_tokens >= prefill_target(r)]:
            if req in self.running and self._fit(plan, req, self._decode_blocks(req)):
                plan.decode.append(req)
        budget -= len(plan.decode) * self.decode_cost

        held_back = bool(plan.preempted)
        for req in [r for r in self.running if r.num_cached_tokens < prefill_target(r)]:
            chunk = self._chunk_len(req, budget)
            if chunk <= 0:
                break
            if req not in self.running:  # preempted by an older request of this step
                continue
            if not self._fit(plan, req, self._chunk_blocks(req, chunk)):
                held_back = True
                continue
            plan.prefill.append(req)
            plan.prefill_lens.append(chunk)
            budget -= chunk
        held_back = held_back or bool(plan.preempted)

        while not held_back and self.waiting and len(self.running) < self.config.max_running_requests and budget > 0:
            req = self.waiting[0]
            self._admit(req)
            chunk = self._chunk_len(req, budget)
            if not self._reserve(self._chunk_blocks(req, chunk)):
                self._release(req)
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            plan.prefill.append(req)
            plan.prefill_lens.append(chunk)
            budget -= chunk
        if plan.empty and self.has_work():
            raise RuntimeError(
                f"scheduler made no progress with {len(self.running)} running and {len(self.waiting)} waiting "
                f"requests and {self.cache.num_free_blocks} free blocks (a bug: please report it)"
            )
        return plan

    def _decode_blocks(self, req: Request) -> int:
        target = self.cache.blocks_needed(req.num_cached_tokens + self.decode_growth)
        return max(0, target - len(self.cache.row_blocks[req.req_pool_idx]))

    def _chunk_len(self, req: Request, budget: int) -> int:
        remaining = prefill_target(req) - req.num_cached_tokens
        return min(remaining, budget, self.config.chunked_prefill_size or budget)

    def _chunk_blocks(self, req: Request, chunk: int) -> int:
        return self.cache.blocks_needed(req.num_cached_tokens + chunk) - len(self.cache.row_blocks[req.req_pool_idx])

    def _fit(self, plan: StepPlan, req: Request, num_blocks: int) -> bool:
        """Sets num_blocks aside for running ``req``, preempting newer running requests (newest
        first) until they fit; False if ``req`` itself had to be preempted (it was the newest)."""
        while not self._reserve(num_blocks):
            victim = self.running[-1]
            self._planned_blocks -= self._planned.pop(id(victim), 0)
            for planned in (plan.decode, plan.prefill):
                if victim in planned:
                    index = planned.index(victim)
                    del planned[index]
                    if planned is plan.prefill:
                        del plan.prefill_lens[index]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is req:
                return False
        self._planned[id(req)] = num_blocks
        return True

    def _reserve(self, num_blocks: int) -> bool:
        """Sets num_blocks aside for this step's plan if the cache has them (evicting unused
        prefix-cache blocks if needed)."""
        needed = self._planned_blocks + num_blocks
        if needed > self.cache.num_free_blocks and self.prefix_cache is not None:
            self.prefix_cache.evict(needed - self.cache.num_free_blocks)
        if needed > self.cache.num_free_blocks:
            return False
        self._planned_blocks = needed
        return True

    def _admit(self, req: Request) -> None:
        req.req_pool_idx = self.cache.alloc_row()
        # Prompt logprobs need the logits of every prompt position, so a request still missing
        # some computes its whole prompt (and still publishes its blocks for others).
        if self.prefix_cache is not None and not req.needs_prompt_logprobs:
            # At least one token is always computed: the logits of the last one, and the draft's
            # state for a speculative request.
            usable = (prefill_target(req) - 1) // self.cache.block_size
            blocks = self.prefix_cache.match(self.block_keys(req)[:usable], num_tokens=prefill_target(req))
            self.cache.adopt_blocks(req.req_pool_idx, blocks, len(blocks) * self.cache.block_size)
            req.num_cached_tokens = req.num_prefix_hit_tokens = len(blocks) * self.cache.block_size

    def block_keys(self, req: Request) -> list:
        """Prefix-cache keys of the request's full blocks. Each key holds the token after its block
        too (the draft's entry at a position depends on the next token), and images by content."""
        if req.mm_spans is None:
            req.mm_spans = image_spans(req.mm_inputs) if req.mm_inputs is not None else []
        return block_keys(req.token_ids(0, req.num_tokens), self.cache.block_size, req.mm_spans, lookahead=True)

    def publish(self, req: Request) -> None:
        """Shares the request's committed full blocks (target and draft entries written) with others."""
        if self.prefix_cache is None or req.req_pool_idx is None:
            return
        draft_written = req.num_cached_tokens - len(req.draft_pending_features)
        committed = min(draft_written, req.num_tokens - 1) // self.cache.block_size
        if committed > req.num_published_blocks:
            blocks = self.cache.row_blocks[req.req_pool_idx][:committed]
            self.prefix_cache.insert(self.block_keys(req)[:committed], blocks)
            req.num_published_blocks = committed

    def _release(self, req: Request) -> None:
        if req.req_pool_idx is not None:
            self.cache.free_row(req.req_pool_idx)
            req.req_pool_idx = None
        req.num_cached_tokens = 0
        req.num_published_blocks = 0
        req.draft_pending_features.clear()

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
