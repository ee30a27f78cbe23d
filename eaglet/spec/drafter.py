"""A round's drafting: the draft extend that leaves each request's proposals, and the chain or tree
drafted from them. ``Drafter`` is the interface; ``TorchDrafter`` drafts as Python around the
draft's forward, one forward per step (the PyTorch backend's drafting, and the fallback of the C++
one, ``stack_drafter.StackDrafter``, for the batches it does not take).

A draft step runs the draft on each request's frontier (B * k tokens) at scratch row indices
n + (step - 1) * k + f, position n - 1 + step, seeing the committed prefix and its own ancestors.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from eaglet.backends.base import SpecOps
from eaglet.backends.pytorch.gqa_attention import TorchGQAAttention
from eaglet.backends.pytorch.mla_attention import MLAAttentionBackend
from eaglet.models.eagle3 import Eagle3Draft
from eaglet.runtime.forward_batch import ForwardBatch, ForwardMode
from eaglet.spec.metrics import PhaseClock
from eaglet.spec.round_state import DraftState, RoundRows
from eaglet.spec.tree import CandidateRecorder, DraftTree


class Drafter(Protocol):
    def extend(
        self, batch: ForwardBatch, features: torch.Tensor, rows: torch.Tensor, feature_rows: torch.Tensor | None = None,
        timed: bool = True,
    ) -> None:
        """The draft extend over ``batch`` from the target's ``features`` (token t's:
        ``features[feature_rows[t]]`` where given); the requests of cache ``rows`` get their
        proposals (top-k of the draft at their last token) and the hidden fed back at step 1.
        ``timed``: inside a round (the draft clock runs)."""
        ...

    def chain(self, round_rows: RoundRows, length: int, final_ids: torch.Tensor | None) -> torch.Tensor:
        """Top-1 drafting: [B, n] the roots, step 0's tokens and each later step's best (n <=
        length + 1: fewer once every request drafted one of its ``final_ids`` [B, S], -1 padded)."""
        ...

    def tree(self, round_rows: RoundRows, steps: int, num_nodes: int, k: int) -> DraftTree:
        """EAGLE-2 tree drafting: ``steps - 1`` steps over each request's best k, then the best
        ``num_nodes - 1`` candidates under the roots."""
        ...


class TorchDrafter:
    def __init__(
        self, draft: Eagle3Draft, attention: MLAAttentionBackend | TorchGQAAttention, states: DraftState, k: int,
        spec_ops: SpecOps, clock: PhaseClock,
    ) -> None:
        self.draft, self.attention, self.states, self.k = draft, attention, states, k
        self.spec_ops = spec_ops
        self.clock = clock  # times the draft's forwards
        self._aranges: dict[int, torch.Tensor] = {}

    def extend(
        self, batch: ForwardBatch, features: torch.Tensor, rows: torch.Tensor, feature_rows: torch.Tensor | None = None,
        timed: bool = True,
    ) -> None:
        with self.clock if timed else contextlib.nullcontext():
            if feature_rows is not None:
                features = features.index_select(0, feature_rows)
            out = self.draft(batch, self.attention, features, hidden_is_target_features=True)
        self.set_states(rows, out.logits, out.hidden_out)

    def set_states(self, rows: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """Each request's proposals for its next round from the draft's logits at its root. Top-1
        drafting needs only the argmax, so it skips the log_softmax over the draft vocabulary."""
        if self.k == 1:
            self.states.topk_tokens[rows, 0] = self.draft.greedy_target_ids(logits)
        else:
            logprobs, top_ids = self.draft.top_k_target_ids(logits, self.k)
            self.states.topk_tokens[rows] = top_ids
            self.states.topk_logprobs[rows] = logprobs.float()
        self.states.hidden[rows] = hidden

    def chain(self, round_rows: RoundRows, length: int, final_ids: torch.Tensor | None) -> torch.Tensor:
        batch_size = len(round_rows.rows)
        first = self.states.topk_tokens[:, 0].index_select(0, round_rows.rows_t)  # [B]: step 0's token
        hidden = self.states.hidden.index_select(0, round_rows.rows_t)
        tokens = [round_rows.roots, first][: length + 1]  # [B] each
        ended = torch.zeros(batch_size, dtype=torch.bool)
        for step in range(1, length):
            if final_ids is not None:
                ended |= (tokens[-1][:, None] == final_ids).any(dim=1)
                if bool(ended.all()):
                    break
            step_batch = self._step_batch(round_rows, tokens[-1][:, None], None, step)
            with self.clock:
                out = self.draft(step_batch, self.attention, hidden, hidden_is_target_features=False)
            tokens.append(self.draft.greedy_target_ids(out.logits))
            hidden = out.hidden_out
        return torch.stack(tokens, dim=1)

    def tree(self, round_rows: RoundRows, steps: int, num_nodes: int, k: int) -> DraftTree:
        batch_size = len(round_rows.rows)
        # index_select: a few us less than indexing with a tensor, each.
        frontier_tokens = self.states.topk_tokens[:, :k].index_select(0, round_rows.rows_t)  # [B, k]
        frontier_scores = self.states.topk_logprobs[:, :k].index_select(0, round_rows.rows_t)
        hidden = self.states.hidden.index_select(0, round_rows.rows_t)
        recorder = CandidateRecorder()
        frontier_hidden = hidden[:, None, :].expand(-1, k, -1)
        frontier_ids = recorder.add(frontier_tokens, frontier_scores, torch.full((batch_size, k), -1), depth=1)
        frontier_ids = frontier_ids.expand(batch_size, k)
        scratch = (steps - 1) * k
        # ancestry[b, f, s]: scratch slot s holds an ancestor-or-self of frontier node f.
        ancestry = torch.zeros(batch_size, k, scratch, dtype=torch.bool)
        for step in range(1, steps):
            own = (step - 1) * k + torch.arange(k)
            ancestry[:, torch.arange(k), own] = True
            step_batch = self._step_batch(round_rows, frontier_tokens, ancestry, step)
            with self.clock:
                out = self.draft(
                    step_batch, self.attention, frontier_hidden.reshape(batch_size * k, -1), hidden_is_target_features=False
                )
            top_logprobs, top_ids = self.draft.top_k_target_ids(out.logits, k)
            child_tokens = top_ids.view(batch_size, k * k)
            child_scores = (frontier_scores[:, :, None] + top_logprobs.view(batch_size, k, k)).view(batch_size, k * k)
            child_parents = frontier_ids[:, :, None].expand(-1, -1, k).reshape(batch_size, k * k)
            child_ids = recorder.add(child_tokens, child_scores, child_parents, depth=step + 1)
            if step == steps - 1:
                break
            # The k best children, the earlier first among equal scores (as DecoderStack.draft_tree).
            best = child_scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]  # [B, k]
            parent_rank = best // k
            frontier_tokens = child_tokens.gather(1, best)
            frontier_scores = child_scores.gather(1, best)
            frontier_ids = child_ids[best]
            frontier_hidden = out.hidden_out.view(batch_size, k, -1).gather(
                1, parent_rank[:, :, None].expand(-1, -1, out.hidden_out.shape[-1])
            )
            ancestry = ancestry.gather(1, parent_rank[:, :, None].expand(-1, -1, scratch))
        return recorder.build_tree(round_rows.roots, num_nodes, self.spec_ops)

    def _arange(self, n: int) -> torch.Tensor:
        """torch.arange(n), made once per n (rounds of one shape ask for the same ones; read-only)."""
        if n not in self._aranges:
            self._aranges[n] = torch.arange(n)
        return self._aranges[n]

    def _step_batch(
        self, round_rows: RoundRows, frontier_tokens: torch.Tensor, ancestry: torch.Tensor | None, step: int
    ) -> ForwardBatch:
        """Draft step ``step``'s batch: each request's frontier at scratch row indices
        n + (step-1)*k .. n + step*k - 1, all at position n - 1 + step."""
        batch_size, k = frontier_tokens.shape
        prefix = round_rows.prefix_t
        first = (step - 1) * k  # scratch index of this step's first frontier slot
        mask = None  # a chain's frontier token sees every row before it: the default causal mask
        if k > 1:
            num_keys = max(round_rows.prefix) + step * k
            scratch = ancestry.shape[-1]
            width = max(round_rows.prefix) + scratch
            mask = (torch.arange(width)[None, None, :] < prefix[:, None, None]).expand(batch_size, k, width).clone()
            columns = (prefix[:, None] + torch.arange(scratch))[:, None, :].expand(batch_size, k, scratch)
            mask.scatter_(2, columns, ancestry)
            mask = mask[:, :, :num_keys].reshape(batch_size * k, num_keys)
        positions = prefix + (step - 1)
        return ForwardBatch.build(
            input_ids=frontier_tokens.reshape(-1),
            req_pool_indices=round_rows.rows,
            extend_prefix_lens=[p + first for p in round_rows.prefix],
            extend_seq_lens=[k] * batch_size,
            out_cache_loc=round_rows.slots[:, first : first + k].reshape(-1),
            positions=positions if k == 1 else positions.repeat_interleave(k),
            mode=ForwardMode.VERIFY,
            logits_indices=self._arange(batch_size * k),
            custom_mask=mask,
        )
