"""A model's decoder layers, or an MLA EAGLE-3 draft's midlayer and its drafting, in one C++ call
(``torch.classes.eaglet.DecoderStack``).

A small model's decode step is dominated by Python: about 20 op calls and 8 module calls per
layer, each some microseconds, around kernels that take tens. The stack runs the same kernels the
layers reach one by one (norms, MLA projections and attention, routing, SwiGLU, routed experts),
on the same inputs and in the same order, from C++: the same bits (tests/test_decoder_stack.py).
It applies where every matrix of every layer is in tile layout or quantized (int4, int8 or FP8, a
layer's quantized matrices all alike), to every bfloat16 batch without autograd (prefill chunks,
decode, verify, draft extends); under autograd the layers run one by one. It holds the tile copies
and quantized matrices the weight methods made: inference never changes a weight in place
afterwards (draft training runs under autograd, which takes the layers).
"""

from __future__ import annotations

import torch

from eaglet.backends.base import LinearMethod
from eaglet.backends.cpu.mla_attention import CpuMLAAttention
from eaglet.backends.cpu.quantized_weights import KernelQuantizedExperts, KernelQuantizedLinear
from eaglet.backends.cpu.weights import TileExperts, TileLinear, TileSwiGLU
from eaglet.backends.pytorch.weights import TorchSwiGLU
from eaglet.backends.quantized_matrix import QuantizedMatrix
from eaglet.backends.stack import StackConfig, StackLayer
from eaglet.distributed.shm_communicator import ShmCommunicator
from eaglet.runtime.forward_batch import ForwardBatch


class _LayerMatrices:
    """A layer's matrices by role as DecoderStack.add_layer takes them: ``role`` -> a tile copy, or
    ``role_codes`` / ``role_scales`` -> a quantized matrix; all its quantized matrices alike."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.quant: set[tuple[str, int, bool]] = set()  # (format, group_size, int8_activations)

    def add(self, role: str, method: object) -> bool:
        """Takes ``method``'s matrix; False where it is in neither form."""
        if isinstance(method, TileLinear):
            self.tensors[role] = method.tiles
            return True
        if isinstance(method, KernelQuantizedLinear):
            return self._add_quantized(role, method.weight, method.int8_activations)
        return False

    def add_experts(self, method: object) -> bool:
        if isinstance(method, TileExperts):
            self.tensors |= dict(zip(("experts_w13", "experts_w2"), method.tiles))
            return True
        if isinstance(method, KernelQuantizedExperts):
            return (self._add_quantized("experts_w13", method.w13, method.int8_activations)
                    and self._add_quantized("experts_w2", method.w2, method.int8_activations))
        return False

    def _add_quantized(self, role: str, matrix: QuantizedMatrix, int8_activations: bool) -> bool:
        codes = matrix.codes if matrix.format != "fp8" else matrix.codes.view(torch.uint8)
        self.tensors |= {f"{role}_codes": codes, f"{role}_scales": matrix.scales}
        self.quant.add((matrix.format, matrix.group_size, int8_activations))
        return len(self.quant) == 1

    def layer_args(self) -> dict[str, str | int | bool]:
        fmt, group, int8_activations = next(iter(self.quant)) if self.quant else ("", 0, False)
        return {"quant_format": fmt, "quant_group": group, "int8_activations": int8_activations}


def _layer_weights(layer: StackLayer) -> tuple[dict[str, torch.Tensor], dict[str, int | str | bool]] | None:
    """The layer's tensors by the roles DecoderStack.add_layer takes and its other arguments, or
    None where one of its matrices is neither in tile layout nor quantized alike."""
    matrices = _LayerMatrices()
    if not all(matrices.add(role, getattr(layer, role)) for role in ("first", "q_proj", "o_proj")):
        return None
    weights = {"input_norm": layer.input_norm, "post_norm": layer.post_norm, "kv_a_norm": layer.kv_a_norm,
               "w_uk": layer.w_uk, "w_uv_t": layer.w_uv_t}
    optional = {"hidden_norm": layer.hidden_norm, "q_a_norm": layer.q_a_norm, "first_bias": layer.first_bias,
                "o_bias": layer.o_bias}
    weights |= {name: t for name, t in optional.items() if t is not None}
    if layer.absorbed_projections:
        weights |= dict(zip(("uk_packed", "uv_packed"), layer.absorbed_projections))
    if isinstance(layer.mlp, TileSwiGLU):
        weights |= dict(zip(("mlp_w13", "mlp_w2"), layer.mlp.tiles))
    elif isinstance(layer.mlp, TorchSwiGLU):
        if not (matrices.add("mlp_w13", layer.mlp.gate_up) and matrices.add("mlp_w2", layer.mlp.down)):
            return None
    elif layer.mlp is not None:
        return None
    if layer.experts is not None:
        if not matrices.add_experts(layer.experts):
            return None
        weights |= {"router_weight": layer.router_weight, "router_bias": layer.router_bias}
    weights |= matrices.tensors
    args = {"mlp_inter": layer.mlp_inter if layer.mlp is not None else 0,
            "expert_inter": layer.expert_inter if layer.experts is not None else 0, **matrices.layer_args()}
    return {name: t.detach() for name, t in weights.items()}, args


def build_decoder_stack(config: StackConfig, layers: list[StackLayer]) -> CpuDecoderStack | None:
    """The C++ stack of ``layers``; None if one of them has a matrix neither in tile layout nor
    quantized as the others."""
    if not layers or any(layer.input_norm.dtype != torch.bfloat16 for layer in layers):
        return None
    stack = torch.classes.eaglet.DecoderStack(
        hidden_size=config.hidden_size, num_heads=config.num_heads, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank, rope_interleave=config.rope_interleave, rms_norm_eps=config.rms_norm_eps,
        softmax_scale=config.softmax_scale, num_experts_per_tok=config.num_experts_per_tok, n_group=config.n_group,
        topk_group=config.topk_group, norm_topk_prob=config.norm_topk_prob,
        routed_scaling_factor=config.routed_scaling_factor,
    )
    for layer in layers:
        entry = _layer_weights(layer)
        if entry is None:
            return None
        weights, args = entry
        stack.add_layer(weights, **args)
    return CpuDecoderStack(stack)


class CpuDecoderStack:
    """``DecoderStack`` (eaglet.backends.stack) over the C++ class, and an MLA draft's drafting calls
    (``eaglet.spec.stack_drafter``)."""

    def __init__(self, stack: torch.ScriptObject) -> None:
        self.stack = stack
        self.extends = False  # set_draft_head found fc in tile layout: extend_proposals can run

    @staticmethod
    def takes(attention: object, dtype: torch.dtype) -> bool:
        """Whether a call on ``dtype`` hidden states runs here (else the layers run one by one)."""
        return isinstance(attention, CpuMLAAttention) and dtype == torch.bfloat16 and not torch.is_grad_enabled()

    def _inputs(self, attention: object, hidden: torch.Tensor, batch: ForwardBatch) -> dict[str, torch.Tensor | None] | None:
        if not self.takes(attention, hidden.dtype):
            return None
        return attention.absorbed_inputs(batch)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, attention: object,
        capture_layers: list[int],
    ) -> list[torch.Tensor] | None:
        inputs = self._inputs(attention, hidden, batch)
        if inputs is None:
            return None
        return self.stack.forward(hidden=hidden, cos=cos, sin=sin, capture_layers=capture_layers, **inputs)

    def use_all_reduce(self, comm: object) -> bool:
        """Under tensor parallelism: all-reduces each layer's attention and MLP outputs through
        ``comm``'s shared memory from C++; False (the layers run one by one) for another communicator."""
        if not isinstance(comm, ShmCommunicator):
            return False
        self.stack.set_tensor_parallel(
            address=comm.address, rank=comm.rank, size=comm.size, slot_bytes=comm.slot_bytes,
            message_bytes=comm.message_bytes, seq=comm.seq, time=comm.native_time, pids=comm.pids,
            timeout_s=comm.timeout_s,
        )
        return True

    def forward_eagle3(
        self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
        attention: object,
    ) -> torch.Tensor | None:
        inputs = self._inputs(attention, hidden, batch)
        if inputs is None:
            return None
        return self.stack.forward_eagle3(emb=emb, hidden=hidden, cos=cos, sin=sin, **inputs)

    def set_draft_head(
        self, fc: LinearMethod | None, fc_out: int, embed: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float,
        lm_head: LinearMethod | None, d2t: torch.Tensor, norm_output: bool,
    ) -> bool:
        """Hands the draft's head to the stack for the drafting calls, once: fc (None where an fc_norm
        comes first), the embeddings, the final norm, the lm_head, d2t. False (the drafting calls
        cannot run) where the lm_head or a tensor is not in the stack's form; ``extends`` says
        whether the draft extend can run too (fc in tile layout)."""
        bf16 = torch.bfloat16
        if (not isinstance(lm_head, TileLinear) or embed.dtype != bf16 or norm_weight.dtype != bf16
                or (lm_head.bias is not None and lm_head.bias.dtype != bf16)):
            return False
        self.extends = isinstance(fc, TileLinear)
        self.stack.set_draft_head(
            fc=fc.tiles if self.extends else None, fc_out=fc_out, embed=embed.detach(), norm_weight=norm_weight.detach(),
            norm_eps=norm_eps, lm_head=lm_head.tiles, vocab=lm_head.out_features,
            lm_head_bias=None if lm_head.bias is None else lm_head.bias.detach(), d2t=d2t, norm_output=norm_output,
        )
        return True

    def extend_proposals(self, batch: ForwardBatch, attention: object, **named: torch.Tensor | int | None) -> bool:
        """A draft extend with its top-k proposals (``DecoderStack.extend_proposals``, ``named``
        its remaining arguments); False (nothing written) where the batch does not run here."""
        inputs = self._inputs(attention, named["features"], batch)
        if inputs is None:
            return False
        self.stack.extend_proposals(ids=batch.input_ids, positions=batch.positions, logits_rows=batch.logits_indices,
                                    **named, **inputs)
        return True

    def draft_chain(self, attention: CpuMLAAttention, **named: torch.Tensor | int | None) -> torch.Tensor:
        """A round's top-1 chain (``DecoderStack.draft_chain``) over ``attention``'s pool."""
        return self.stack.draft_chain(kv=attention.pool.kv, req_to_token=attention.cache.req_to_token, **named)

    def draft_tree(
        self, attention: CpuMLAAttention, **named: torch.Tensor | int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A round's EAGLE-2 tree (``DecoderStack.draft_tree``): (tokens, parents, depths)."""
        tokens, parents, depths = self.stack.draft_tree(kv=attention.pool.kv, req_to_token=attention.cache.req_to_token, **named)
        return tokens, parents, depths
