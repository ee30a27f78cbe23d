"""The differentiable EAGLE-3 training forward: eaglet's own draft module over a dense attention.

The training forward calls :meth:`Eagle3Draft.forward` itself (fc / fc_norm, the midlayer, norm,
lm_head: the very code inference runs) with a flat batch of B padded rows and an attention
that keeps no paged cache: :class:`DenseTTTMLABackend` / :class:`DenseTTTGQABackend` attend densely
and differentiably under the training-time-test mask, remembering the keys and values of the
earlier unroll steps.

Unroll (``ttt_length`` steps) over draft rows t (row t: target features at t, token t+1):

* step 0: hidden = fc(features[t]), input token t+1, position t; queries attend causally to the
  step-0 keys (as the draft extend does at inference);
* step k: hidden = step k-1's output at row t, input token t+1+k, position t+k; queries attend to
  the step-0 keys at rows <= t plus the key of each step 1..k at row t itself (as draft step k
  attends to the committed prefix plus its own chain at inference, at position prefix-1+k);
* step k at row t learns the target's distribution at position t+1+k (predicting token t+2+k).

Loss: soft cross-entropy of each step's draft distribution against softmax(target logits
restricted to the hot vocabulary), over response positions whose target argmax lies in the hot
vocabulary, weighted 0.8^k and summed over steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eaglet.runtime.forward_batch import ForwardBatch, ForwardMode
from eaglet.layers.gqa_attention import GQAAttention
from eaglet.layers.mla import MLAAttention
from eaglet.layers.moe import SwiGLU
from eaglet.models.eagle3 import Eagle3Draft

STEP_WEIGHT_DECAY = 0.8


class _DenseTTTAttention:
    """The TTT attention over [B, L] rows, one call per unroll step (keys/values of earlier steps kept)."""

    def __init__(self, batch_size: int, num_rows: int) -> None:
        self.batch_size = batch_size
        self.num_rows = num_rows
        self.keys: list[torch.Tensor] = []  # per step [B, L, Hq, Dk]
        self.values: list[torch.Tensor] = []  # per step [B, L, Hq, Dv]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q/k: [T, Hq, Dk], v: [T, Hq, Dv] of this step (T = B * L). Returns [T, Hq, Dv]."""
        b, n = self.batch_size, self.num_rows
        q, k, v = (x.reshape(b, n, x.shape[1], x.shape[2]) for x in (q, k, v))
        self.keys.append(k)
        self.values.append(v)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = torch.einsum("blhd,bshd->bhls", q, self.keys[0]).float() * scale
        scores = scores.masked_fill(~causal, float("-inf"))
        # Step i's own-row keys of steps 1..i: one score per (row, head) each.
        own = [(q * key).sum(-1).float().permute(0, 2, 1)[..., None] * scale for key in self.keys[1:]]
        probs = torch.cat([scores, *own], dim=-1).softmax(dim=-1).to(v.dtype)  # [B, H, L, L + i]
        out = torch.einsum("bhls,bshd->blhd", probs[..., :n], self.values[0])
        for j, value in enumerate(self.values[1:]):
            out = out + probs[..., n + j].permute(0, 2, 1)[..., None] * value
        return out.reshape(b * n, out.shape[2], out.shape[3])


class DenseTTTMLABackend(_DenseTTTAttention):
    """MLA in the decompressed form: k = [kv_b_proj(c_kv) nope part, k_pe], v = its v part."""

    def forward(
        self,
        layer: MLAAttention,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        num_tokens, heads = q_nope.shape[0], layer.num_heads
        kv = F.linear(c_kv, layer.kv_b_proj.weight).view(num_tokens, heads, -1)
        k_nope, v = kv.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(num_tokens, heads, layer.qk_rope_head_dim)], dim=-1)
        return self.attend(torch.cat([q_nope, q_pe], dim=-1), k, v, layer.scaling)


class DenseTTTGQABackend(_DenseTTTAttention):
    """Grouped-query attention: query heads kv*G .. kv*G+G-1 share kv head kv (as at inference)."""

    def forward(
        self, layer: GQAAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        group = layer.num_heads // layer.num_kv_heads
        return self.attend(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), layer.scaling)


def dense_backend(draft: Eagle3Draft, batch_size: int, num_rows: int) -> DenseTTTMLABackend | DenseTTTGQABackend:
    if draft.config.kind == "mla":
        return DenseTTTMLABackend(batch_size, num_rows)
    return DenseTTTGQABackend(batch_size, num_rows)


@dataclass
class TTTBatch:
    """B padded sequences of N draft rows; ``ttt_length - 1`` extra rows hold the later steps' inputs."""

    features: torch.Tensor  # [B, N, len(aux) * H_t]
    input_embeds: torch.Tensor  # [B, N + ttt_length - 1, H]: row r = embedding of token r+1
    target_probs: torch.Tensor  # [B, N + ttt_length - 1, draft_vocab]: row r = target at position r+1
    loss_mask: torch.Tensor  # [B, N + ttt_length - 1] bool: row r's target is a trained response position

    @property
    def batch_size(self) -> int:
        return int(self.features.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.features.shape[1])


def bind_trainable_fused_weights(draft: Eagle3Draft) -> None:
    """Points the fused matrices inference reads (set by process_weights_after_loading from detached
    parameters: SwiGLU's gate_up_weight, MLA's qkv_a_weight / qkv_a_bias) at differentiable
    concatenations of the current parameters, so gradients reach the checkpoint-named parameters.
    ``restore_inference_weights`` puts the inference form back."""
    for module in draft.modules():
        if isinstance(module, SwiGLU):
            module.gate_up_weight = torch.cat([module.gate_proj.weight, module.up_proj.weight])
        elif isinstance(module, MLAAttention) and module.has_q_lora:
            q_a, kv_a = module.q_a_proj, module.kv_a_proj_with_mqa
            module.qkv_a_weight = torch.cat([q_a.weight, kv_a.weight])
            module.qkv_a_bias = torch.cat([q_a.bias, kv_a.bias]) if q_a.bias is not None else None


def restore_inference_weights(draft: Eagle3Draft) -> None:
    """Re-derives every module's inference-time tensors from the (trained) parameters."""
    with torch.no_grad():
        for module in draft.modules():
            if module is not draft and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()


def ttt_forward(draft: Eagle3Draft, batch: TTTBatch, ttt_length: int) -> list[torch.Tensor]:
    """Draft logits [B, N, draft_vocab] (float32) of each unroll step 0 .. ttt_length-1."""
    b, n = batch.batch_size, batch.num_rows
    bind_trainable_fused_weights(draft)
    backend = dense_backend(draft, b, n)
    positions = torch.arange(n, device=batch.features.device).repeat(b)
    hidden = batch.features.reshape(b * n, -1)
    step_logits = []
    for step in range(ttt_length):
        embeds = batch.input_embeds[:, step : step + n].reshape(b * n, -1)
        forward_batch = ForwardBatch.build(
            input_ids=torch.zeros(b * n, dtype=torch.long),
            req_pool_indices=list(range(b)),
            extend_prefix_lens=[0] * b,
            extend_seq_lens=[n] * b,
            out_cache_loc=torch.zeros(b * n, dtype=torch.long),
            positions=positions + step,
            mode=ForwardMode.EXTEND,
            logits_indices=torch.arange(b * n),
            input_embeds=embeds,
            device=batch.features.device,
        )
        out = draft(forward_batch, backend, hidden, hidden_is_target_features=step == 0)
        step_logits.append(out.logits.view(b, n, -1))
        hidden = out.hidden_out
    return step_logits


@dataclass
class TTTLoss:
    loss: torch.Tensor  # weighted sum over steps (differentiable)
    step_losses: list[float]
    step_accuracies: list[float]  # top-1 agreement with the target (restricted argmax) per step
    num_positions: list[int]  # trained positions per step


def ttt_loss(step_logits: list[torch.Tensor], batch: TTTBatch) -> TTTLoss:
    n = batch.num_rows
    total = step_logits[0].new_zeros(())
    target_argmax = batch.target_probs.argmax(dim=-1)
    losses, accuracies, counts = [], [], []
    for step, logits in enumerate(step_logits):
        probs = batch.target_probs[:, step : step + n]
        mask = batch.loss_mask[:, step : step + n]
        count = int(mask.sum())
        per_row = -(probs * logits.log_softmax(dim=-1)).sum(-1)
        loss = (per_row * mask).sum() / max(count, 1)
        total = total + STEP_WEIGHT_DECAY**step * loss
        agree = logits.detach()[mask].argmax(-1) == target_argmax[:, step : step + n][mask]
        losses.append(float(loss.detach()))
        accuracies.append(float(agree.sum()) / max(count, 1))
        counts.append(count)
    return TTTLoss(total, losses, accuracies, counts)
