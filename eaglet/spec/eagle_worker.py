"""EAGLE-3 speculative decoding over ragged batches: draft extend, tree drafting, verify, commit.

One round for running requests, each with n cached tokens and a root token (its last output
token, not yet cached):

1. draft: step 0's top-k comes from the last draft extend; each later step runs the draft on the
   current frontier (B * topk tokens) at scratch row indices n + (step-1)*topk + f, position
   n - 1 + step, seeing the committed prefix and its own ancestors (custom mask);
2. the best ``num_draft_tokens - 1`` candidates form the tree (``tree.py``); with structured
   output, nodes the grammar rejects are cut and the verify logits masked (``grammar_drafts.py``);
   the target verifies root + tree in one forward at row indices n .. n+N-1 with a tree mask,
   capturing its features;
3. ``verify.py`` picks the accepted path and the bonus token; the target's cache entries of the
   accepted nodes move to row indices n+1 .. n+a, the row is cut to n+1+a;
4. the draft extend runs over root + accepted path (ids rotated: the accepted tokens then the
   bonus), rewriting the draft's entries at n .. n+a, and yields the next round's step-0 top-k.

Target and draft share the slot space, so a row index holds both models' entries for the same
position. When the adaptive policy (``policy.py``) decodes plain steps instead, ``plain_decode``
keeps the target's features of those positions and ``catch_up`` writes the draft's entries for
them at the start of the next round. All tensor work is batched over requests; Python loops over requests only touch cache
bookkeeping.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eaglet.backends.base import Backend
from eaglet.executor.model_runner import ModelRunner
from eaglet.executor.request import Request, record_logprobs
from eaglet.layers.logits_processor import LogitsRow, process_logits
from eaglet.layers.sampler import shaped_probs
from eaglet.models.deepseek_v3 import ForwardOutput
from eaglet.models.eagle3 import Eagle3Draft
from eaglet.models.eagle3_config import Eagle3Config
from eaglet.runtime.forward_batch import ForwardBatch, ForwardMode, long_tensor
from eaglet.runtime.kv_cache import KVCacheManager
from eaglet.spec.config import SpeculativeConfig
from eaglet.spec.draft_inputs import draft_extend_inputs
from eaglet.spec.drafter import Drafter, TorchDrafter
from eaglet.spec.grammar_drafts import cut_rejected_drafts, mask_verify_logits
from eaglet.spec.metrics import PhaseTimer
from eaglet.spec.round_state import DraftState, RoundRows
from eaglet.spec.stack_drafter import StackDrafter
from eaglet.spec.tree import DraftTree, tree_attention_mask
from eaglet.spec.verify import VerifyResult, verify_greedy, verify_greedy_ids, verify_sampling


@dataclass
class RoundResult:
    new_tokens: list[list[int]]  # per request: accepted draft tokens + the bonus token
    num_accepted: list[int]
    num_drafted: int  # draft tokens verified per request (fewer than asked where a chain stopped early)


class EagleWorker:
    def __init__(
        self,
        runner: ModelRunner,
        draft: Eagle3Draft,
        draft_config: Eagle3Config,
        spec: SpeculativeConfig,
        cache: KVCacheManager,
        backend: Backend,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.runner = runner
        self.backend = backend
        self.draft = draft
        self.draft_config = draft_config
        self.spec = spec
        self.cache = cache
        self.eos_token_ids = eos_token_ids
        dtype = next(draft.parameters()).dtype
        self.pool = cache.add_pool(draft.make_kv_pool(cache.num_slots, dtype, cache.device))
        self.draft_attention = draft.make_attention(cache, self.pool)
        self.capture_layers = tuple(draft_config.aux_layer_ids)
        # Indexed by request row: a round reads its requests' states in one op per field, the
        # draft extend writes them so (per-request tensors cost a stack and an unbind per round).
        rows, k = cache.req_to_token.shape[0], spec.eagle_topk
        self.states = DraftState(
            topk_tokens=torch.zeros(rows, k, dtype=torch.long, device=cache.device),
            topk_logprobs=torch.zeros(rows, k, dtype=torch.float32, device=cache.device),
            hidden=torch.zeros(rows, draft_config.hidden_size, dtype=dtype, device=cache.device),
        )
        self.timer = PhaseTimer()
        # Time the model forwards and the grammar's work; decode() books the rest of a round as bookkeeping.
        self._draft_clock, self._verify_clock = self.timer.clock("draft"), self.timer.clock("verify")
        self._grammar_clock = self.timer.clock("grammar")
        torch_drafter = TorchDrafter(draft, self.draft_attention, self.states, spec.eagle_topk, backend.spec, self._draft_clock)
        self.drafter: Drafter = (
            StackDrafter(draft, self.draft_attention, self.states, spec.eagle_topk, torch_drafter)
            if draft.stack is not None else torch_drafter
        )
        self.catch_up_seconds = 0.0  # of the last round: the draft extend over positions decoded plain
        self._chain_index: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (B, n) -> parents, depths
        self._aranges: dict[int, torch.Tensor] = {}
        self._final_ids_table: tuple[tuple[tuple[int, ...], ...], torch.Tensor | None] = ((), None)  # (finals, _final_ids)

    # ---- prefill ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self, requests: list[Request], num_new: list[int], sample: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Target extend (prefill chunks) with feature capture, then the draft extend over the same batch.

        ``sample`` turns the target logits [B, V] into next tokens [B]; they are the tails of
        requests whose prompt is now complete. Returns the sampled tokens.
        """
        final = [r.num_cached_tokens + n == r.num_tokens for r, n in zip(requests, num_new)]
        batch, output = self.runner.extend(requests, num_new, capture_layers=self.capture_layers)
        sampled = sample(output.logits)
        next_prompt = [
            r.token_ids(r.num_cached_tokens, r.num_cached_tokens + 1)[0] if not f else 0 for r, f in zip(requests, final)
        ]
        tails = torch.where(torch.tensor(final), sampled, torch.tensor(next_prompt))
        tail_embeds = self._tail_embeddings(requests, tails, final) if batch.input_embeds is not None else None
        ids, embeds = draft_extend_inputs(batch, tails, tail_embeds)
        self._draft_extend(batch, ids, embeds, output.aux_hidden_states)
        return sampled

    def _tail_embeddings(self, requests: list[Request], tails: torch.Tensor, final: list[bool]) -> torch.Tensor:
        """Plain token embeddings of the tails, except a non-final chunk whose next prompt position
        is an image placeholder: that tail is the image feature. Image rows are found by position
        among the prompt's placeholders, never by token id: a generated token that happens to be
        the placeholder id (re-prefilled after a preemption) is an ordinary token."""
        image_rows: list[tuple[int, int]] = []  # (tail, feature row)
        for i, req in enumerate(requests):
            if final[i] or req.mm_inputs is None:
                continue
            position = req.num_cached_tokens
            _, rows = req.mm_inputs.feature_rows(position, position + 1)
            if rows.numel():
                image_rows.append((i, int(rows[0])))
        ids = tails.clone()
        for i, _ in image_rows:
            ids[i] = 0  # placeholder ids never reach embed_tokens
        embeds = self.runner.model.embed_tokens(ids)
        for i, row in image_rows:
            embeds[i] = self.runner.image_features(requests[i])[row]
        return embeds

    def _draft_extend(
        self,
        target_batch: ForwardBatch,
        ids: torch.Tensor,
        embeds: torch.Tensor | None,
        features: torch.Tensor,
    ) -> None:
        batch = ForwardBatch.build(
            input_ids=ids,
            req_pool_indices=target_batch.req_pool_indices.tolist(),
            extend_prefix_lens=target_batch.extend_prefix_lens_cpu,
            extend_seq_lens=target_batch.extend_seq_lens_cpu,
            out_cache_loc=target_batch.out_cache_loc,
            positions=target_batch.positions,
            mode=ForwardMode.EXTEND,
            input_embeds=embeds,
        )
        self.drafter.extend(batch, features, target_batch.req_pool_indices, timed=False)

    def _arange(self, n: int) -> torch.Tensor:
        """torch.arange(n), made once per n (rounds of one shape ask for the same ones; read-only)."""
        if n not in self._aranges:
            self._aranges[n] = torch.arange(n)
        return self._aranges[n]

    def draft_state(self, req: Request) -> DraftState:
        """A copy of the request's state (its row of ``states``)."""
        row = req.req_pool_idx
        return DraftState(*(t[row].clone() for t in (self.states.topk_tokens, self.states.topk_logprobs, self.states.hidden)))

    # ---- plain decoding while speculation is off ------------------------------------------------
    @torch.inference_mode()
    def plain_decode(self, requests: list[Request], next_tokens: Callable[[ForwardOutput], torch.Tensor]) -> torch.Tensor:
        """One plain target token per request, capturing the features the draft will need to catch up
        (``catch_up``) when speculation resumes. ``next_tokens`` turns the forward's output (greedy
        ids where every request's ``greedy_ids_suffice``, else logits) into the tokens it returns."""
        _, output = self.runner.extend(
            requests, [1] * len(requests), capture_layers=self.capture_layers,
            greedy_ids_only=all(r.greedy_ids_suffice for r in requests),
        )
        for req, feature in zip(requests, output.aux_hidden_states.unbind(0)):
            req.draft_pending_features.append(feature)
        return next_tokens(output)

    def catch_up(self, requests: list[Request]) -> None:
        """Draft extend over the positions decoded without the draft (entry p: feature of p, id of
        token p+1), so the draft cache and the next round's step-0 proposals are what they would
        have been had every step been speculative."""
        lagging = [r for r in requests if r.draft_pending_features]
        if not lagging:
            return
        starts = [r.num_cached_tokens - len(r.draft_pending_features) for r in lagging]
        lags = [len(r.draft_pending_features) for r in lagging]
        ids = [t for r, start, lag in zip(lagging, starts, lags) for t in r.token_ids(start + 1, start + lag + 1)]
        positions = torch.cat([torch.arange(start, start + lag) for start, lag in zip(starts, lags)])
        slots = torch.cat(
            [self.cache.req_to_token[r.req_pool_idx, start : start + lag] for r, start, lag in zip(lagging, starts, lags)]
        )
        batch = ForwardBatch.build(
            input_ids=ids,
            req_pool_indices=[r.req_pool_idx for r in lagging],
            extend_prefix_lens=starts,
            extend_seq_lens=lags,
            out_cache_loc=slots,
            positions=positions,
            mode=ForwardMode.EXTEND,
        )
        features = torch.stack([f for r in lagging for f in r.draft_pending_features])
        self.drafter.extend(batch, features, batch.req_pool_indices)
        for req in lagging:
            req.draft_pending_features.clear()

    # ---- decode round --------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(
        self,
        requests: list[Request],
        num_steps: int | None = None,
        num_draft_tokens: int | None = None,
        topk: int | None = None,
    ) -> RoundResult:
        """One speculative round; ``num_steps`` / ``num_draft_tokens`` / ``topk`` (default: the
        configured shape) may be smaller than configured, as the adaptive policy asks (top-1: a
        chain, drafted from the first column of the top-k proposals)."""
        spec = self.spec
        num_steps = num_steps or spec.num_steps
        num_draft_tokens = num_draft_tokens or spec.num_draft_tokens
        topk = topk or spec.eagle_topk
        if topk > spec.eagle_topk or num_draft_tokens > spec.scratch_len:
            raise ValueError(f"a round of top-{topk} and {num_draft_tokens} tokens exceeds the configured shape")
        start = time.perf_counter()
        seconds = self.timer.seconds
        timed = ("draft", "verify", "grammar")
        timed_before = sum(seconds[phase] for phase in timed)
        self.catch_up(requests)
        self.catch_up_seconds = time.perf_counter() - start
        round_rows = self._round_rows(requests)
        tree = self._draft_tree(requests, round_rows, num_steps, num_draft_tokens, topk)
        with self._grammar_clock:
            tree = cut_rejected_drafts(tree, requests)
        result, raw_logits, features = self._verify(requests, round_rows, tree, is_chain=topk == 1)
        round_result = self._commit(requests, round_rows, tree, result, raw_logits, features, is_chain=topk == 1)
        seconds["bookkeeping"] += time.perf_counter() - start - (sum(seconds[phase] for phase in timed) - timed_before)
        self.timer.rounds += 1
        return round_result

    def _round_rows(self, requests: list[Request]) -> RoundRows:
        """Grows every request's row by the round's scratch and returns the round's row indices."""
        rows = [r.req_pool_idx for r in requests]
        prefix = [r.num_cached_tokens for r in requests]
        scratch = self.spec.scratch_len
        self.cache.reserve_scratch(rows, prefix, scratch)
        # Rows, prefixes and roots in one host-to-tensor copy.
        rows_t, prefix_t, roots = long_tensor(rows + prefix + [r.output_token_ids[-1] for r in requests]).view(3, -1).unbind(0)
        slots = self.cache.scratch_slots(rows_t, prefix_t, scratch)
        greedy_only = all(r.greedy_ids_suffice for r in requests)
        return RoundRows(rows, prefix, rows_t, prefix_t, roots, slots, greedy_only)

    def _draft_tree(
        self, requests: list[Request], round_rows: RoundRows, steps: int, num_draft_tokens: int, k: int
    ) -> DraftTree:
        if k == 1:
            return self._draft_chain(requests, round_rows, min(steps, num_draft_tokens - 1))
        return self.drafter.tree(round_rows, steps, num_draft_tokens, k)

    def _final_ids(self, requests: list[Request]) -> torch.Tensor | None:
        """[B, S] per request the tokens that would end it wherever it drafts them (EOS unless
        ignore_eos, its stop token ids; -1 pads), for a round of greedy requests that all have some
        and have made their min_tokens; else None. Drafts after such a token are never kept (accepted,
        it ends the request; rejected, so is all after it), so a chain may stop once every request
        drafted one. Sampled requests keep their chains: a seeded one's random draws must not depend
        on the rest of its batch."""
        for req in requests:
            params = req.sampling_params
            if not req.final_token_ids or not params.greedy or len(req.output_token_ids) < params.min_tokens:
                return None
        finals = tuple(r.final_token_ids for r in requests)  # rounds of one batch repeat the same table
        if self._final_ids_table[0] != finals:
            width = max(len(ids) for ids in finals)
            table = long_tensor([t for ids in finals for t in ids + (-1,) * (width - len(ids))]).view(len(requests), width)
            self._final_ids_table = (finals, table)
        return self._final_ids_table[1]

    def _draft_chain(self, requests: list[Request], round_rows: RoundRows, length: int) -> DraftTree:
        """Top-1 drafting: the tree is the chain of each step's best token, which is what the tree
        path keeps for k = 1 (its scores fall along the chain), without recording candidates. It
        stops early once every request drafted a token that would end it (``_final_ids``)."""
        batch_size = len(requests)
        final_ids = self._final_ids(requests) if length > 1 else None
        chain = self.drafter.chain(round_rows, length, final_ids)
        n = chain.shape[1]
        if (batch_size, n) not in self._chain_index:  # the same for every chain of this size
            index = torch.arange(n).expand(batch_size, n)
            self._chain_index[batch_size, n] = (index - 1, index)
        parents, depths = self._chain_index[batch_size, n]
        return DraftTree(tokens=chain, parents=parents, depths=depths)

    def _verify(
        self, requests: list[Request], round_rows: RoundRows, tree: DraftTree, is_chain: bool
    ) -> tuple[VerifyResult, torch.Tensor | None, torch.Tensor]:
        """The verify forward and its result; the target's logits [B, N, V] too, unless the forward
        returned only its greedy ids (a greedy-only round)."""
        batch_size, n = tree.tokens.shape
        prefix = round_rows.prefix_t
        batch = ForwardBatch.same_length(
            new_tokens=n,
            input_ids=tree.tokens.reshape(-1),
            req_pool_indices=round_rows.rows_t,
            prefix_lens=prefix,
            prefix_lens_cpu=round_rows.prefix,
            out_cache_loc=round_rows.slots[:, :n].reshape(-1),
            positions=(prefix[:, None] + tree.depths).reshape(-1),
            mode=ForwardMode.VERIFY,
            logits_indices=self._arange(batch_size * n),
            capture_layers=self.capture_layers,
            # With top-1 drafting the tree is a chain: each node sees the rows before it (causal).
            custom_mask=None if is_chain else tree_attention_mask(tree, prefix, max(round_rows.prefix) + n, self.backend.spec),
            greedy_ids_only=round_rows.greedy_only,
        )
        with self._verify_clock:
            output = self.runner.forward(batch)
        if output.greedy_ids is not None:
            return (verify_greedy_ids(tree.tokens, tree.parents, output.greedy_ids.view(batch_size, n), self.backend.spec), None,
                    output.aux_hidden_states)
        with self._grammar_clock:
            raw_logits = mask_verify_logits(output.logits.view(batch_size, n, -1), tree, requests)
        logits = raw_logits if round_rows.greedy_only else self._process_tree_logits(requests, tree, raw_logits)
        sampled_rows = [] if round_rows.greedy_only else [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        result = verify_greedy(tree.tokens, tree.parents, logits, self.backend.spec)
        if sampled_rows:
            idx = torch.tensor(sampled_rows)
            probs = shaped_probs(
                logits[idx].reshape(len(sampled_rows) * n, -1),
                [requests[i].sampling_params for i in sampled_rows for _ in range(n)],
            ).view(len(sampled_rows), n, -1)
            sampled = verify_sampling(
                tree.tokens[idx], tree.parents[idx], probs, [requests[i].generator for i in sampled_rows]
            )
            result = result.with_rows(idx, sampled)
        return result, raw_logits, output.aux_hidden_states

    def _process_tree_logits(self, requests: list[Request], tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
        """Penalties, logit bias and min_tokens per tree node, each node's history being the committed
        output plus the draft tokens on its path (so node i is processed exactly as plain decoding
        would process that position)."""
        if not any(r.sampling_params.needs_logits_processing for r in requests):
            return logits
        batch_size, n = tree.tokens.shape
        tokens = tree.tokens.tolist()
        rows = []
        for b, (req, paths) in enumerate(zip(requests, tree.node_paths())):
            for path in paths:
                drafted = [tokens[b][j] for j in path if j != 0]
                rows.append(LogitsRow(req.sampling_params, req.prompt_token_ids, req.output_token_ids + drafted))
        flat = process_logits(logits.reshape(batch_size * n, -1), rows, self.eos_token_ids)
        return flat.view(batch_size, n, -1)

    def _commit(
        self,
        requests: list[Request],
        round_rows: RoundRows,
        tree: DraftTree,
        result: VerifyResult,
        raw_logits: torch.Tensor,
        features: torch.Tensor,
        is_chain: bool,
    ) -> RoundResult:
        """Keeps each request's accepted path, then runs the draft extend over root + path."""
        commit = result.commit_table(tree.tokens, round_rows.slots, round_rows.prefix_t, self.backend.spec)
        src_slots, dst_slots, positions, feature_rows, ids = commit.entries.unbind(0)
        path_lens_t, seq_lens, last_entries = commit.per_request.unbind(0)
        path_lens = path_lens_t.tolist()  # per request: num_accepted + 1
        ids_list = ids.tolist()
        # Per request: the accepted tokens then the bonus (the path's tokens rotated by one).
        starts = itertools.accumulate(path_lens, initial=0)
        new_tokens = [ids_list[start : start + n] for start, n in zip(starts, path_lens)]
        if not is_chain:  # the target's entries of accepted nodes move to row indices n+1 .. n+a
            self.runner.copy_target_slots(src_slots, dst_slots)
        self.cache.truncate_rows(
            round_rows.rows, [p + n for p, n in zip(round_rows.prefix, path_lens)], reserve=self.spec.scratch_len
        )
        for req, n in zip(requests, path_lens):
            req.num_cached_tokens += n
        if not round_rows.greedy_only and any(r.sampling_params.logprobs is not None for r in requests):
            # Logprobs of each emitted token come from the target's logits at its parent node.
            path = torch.cat([torch.zeros_like(result.num_accepted)[:, None], result.accepted_nodes.clamp(min=0)], dim=1)
            parent_logits = raw_logits.gather(1, path[:, :, None].expand(-1, -1, raw_logits.shape[-1]))
            record_logprobs(requests, parent_logits, result.emitted_tokens(tree.tokens))
        batch = ForwardBatch.ragged(
            input_ids=ids,
            positions=positions,
            out_cache_loc=dst_slots,
            req_pool_indices=round_rows.rows_t,
            prefix_lens=round_rows.prefix_t,
            extend_seq_lens=path_lens_t,
            seq_lens=seq_lens,
            token_starts=commit.entry_starts,
            logits_indices=last_entries,
            prefix_lens_cpu=round_rows.prefix,
            extend_seq_lens_cpu=path_lens,
            mode=ForwardMode.EXTEND,
        )
        self.drafter.extend(batch, features, round_rows.rows_t, feature_rows=feature_rows)
        return RoundResult(new_tokens, [n - 1 for n in path_lens], tree.tokens.shape[1] - 1)
