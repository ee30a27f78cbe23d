"""A round's drafting in one C++ call each (the CPU backend's decoder stack of an MLA draft's
midlayer): the draft extend with its top-k proposals, a top-1 chain, an EAGLE-2 tree. The same
``Drafter`` interface as ``drafter.TorchDrafter``, which runs the batches the stack does not take
(image embeddings, an fc_norm, autograd, too many rows)."""

from __future__ import annotations

import contextlib

import torch

from eaglet.backends.pytorch.mla_attention import MLAAttentionBackend
from eaglet.models.eagle3 import Eagle3Draft
from eaglet.runtime.forward_batch import ForwardBatch
from eaglet.spec.drafter import TorchDrafter
from eaglet.spec.round_state import DraftState, RoundRows
from eaglet.spec.tree import DraftTree


class StackDrafter:
    def __init__(
        self, draft: Eagle3Draft, attention: MLAAttentionBackend, states: DraftState, k: int, fallback: TorchDrafter
    ) -> None:
        self.draft, self.attention, self.states, self.k = draft, attention, states, k
        self.stack = draft.stack
        self.fallback = fallback
        self.clock = fallback.clock
        self._head: bool | None = None  # whether the stack took the draft's head (decided on first use)

    def _has_head(self) -> bool:
        """The draft's head goes to the stack on first use (a shared lm_head is the target's,
        prepared after the draft): a round calls the stack twice, and gathering and passing the head
        each time would cost a sizable share of a small draft's extend."""
        if self._head is None:
            draft = self.draft
            self._head = self.stack.set_draft_head(
                fc=None if draft.fc_norm is not None else draft.fc.method, fc_out=draft.fc.out_features,
                embed=draft.embed_weight(), norm_weight=draft.norm.weight, norm_eps=draft.norm.eps,
                lm_head=draft.lm_head_module().method, d2t=draft.d2t, norm_output=draft.config.norm_output,
            )
        return self._head

    def _rope_table(self, hidden: torch.Tensor, positions: int) -> torch.Tensor | None:
        """The draft's rotary table of at least ``positions`` rows, or None where a call on ``hidden``
        would not run on the stack."""
        if not self._has_head() or not self.stack.takes(self.attention, hidden.dtype):
            return None
        return self.draft.rotary.table_as(positions, torch.bfloat16)

    def extend(
        self, batch: ForwardBatch, features: torch.Tensor, rows: torch.Tensor, feature_rows: torch.Tensor | None = None,
        timed: bool = True,
    ) -> None:
        table = None
        if self._has_head() and self.stack.extends and batch.input_embeds is None and features.shape[-1] == self.draft.fc.in_features:
            table = self._rope_table(features, max(batch.seq_lens_cpu))
        if table is None:
            self.fallback.extend(batch, features, rows, feature_rows, timed)
            return
        states = self.states
        with self.clock if timed else contextlib.nullcontext():
            done = self.stack.extend_proposals(
                batch, self.attention, features=features, feature_rows=feature_rows, rope_table=table, k=self.k,
                state_rows=rows, state_tokens=states.topk_tokens, state_logprobs=states.topk_logprobs,
                state_hidden=states.hidden,
            )
        if not done:
            self.fallback.extend(batch, features, rows, feature_rows, timed)

    def chain(self, round_rows: RoundRows, length: int, final_ids: torch.Tensor | None) -> torch.Tensor:
        table = None
        if length > 1:
            table = self._rope_table(self.states.hidden, max(round_rows.prefix) + length - 1)
        if table is None:
            return self.fallback.chain(round_rows, length, final_ids)
        # Row indices prefix .. prefix + length - 2 get the steps' entries; step s reads < prefix + s.
        states = self.states
        with self.clock:
            return self.stack.draft_chain(
                self.attention, roots=round_rows.roots, state_rows=round_rows.rows_t, prefix=round_rows.prefix_t,
                state_tokens=states.topk_tokens, state_hidden=states.hidden, rope_table=table, steps=length - 1,
                final_ids=final_ids,
            )

    def tree(self, round_rows: RoundRows, steps: int, num_nodes: int, k: int) -> DraftTree:
        table = self._rope_table(self.states.hidden, max(round_rows.prefix) + steps)
        if table is None:
            return self.fallback.tree(round_rows, steps, num_nodes, k)
        # Row indices prefix .. prefix + (steps - 1) * k - 1 get the steps' entries.
        states = self.states
        with self.clock:
            tokens, parents, depths = self.stack.draft_tree(
                self.attention, roots=round_rows.roots, state_rows=round_rows.rows_t, prefix=round_rows.prefix_t,
                state_tokens=states.topk_tokens, state_logprobs=states.topk_logprobs, state_hidden=states.hidden,
                rope_table=table, steps=steps, k=k, num_nodes=num_nodes,
            )
        return DraftTree(tokens, parents, depths)
