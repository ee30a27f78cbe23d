"""Inputs of the draft extend that follows a target forward over the same ragged batch.

Draft slot p holds (token p+1, target features at p, position p): ids and input embeddings are
rotated left by one WITHIN each request's segment, and each request's tail slot
(``extend_start_loc + extend_seq_lens - 1``, for every request, not only the flat buffer's last
row) receives that request's tail: the newly sampled token after a final prefill chunk or a
verify, the next prompt token after a non-final chunk.
"""

from __future__ import annotations

import torch

from eaglet.runtime.forward_batch import ForwardBatch


def rotate_segments(batch: ForwardBatch, values: torch.Tensor, tails: torch.Tensor) -> torch.Tensor:
    """out[p] = values[p + 1] inside each segment; out[last row of segment i] = tails[i]. A new tensor."""
    out = torch.empty_like(values)
    out[:-1] = values[1:]
    out[ForwardBatch.last_token_indices(batch.extend_start_loc, batch.extend_seq_lens)] = tails.to(values.dtype)
    return out


def draft_extend_inputs(
    batch: ForwardBatch, tail_ids: torch.Tensor, tail_embeds: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input ids, input embeddings or None) of the draft extend over ``batch``.

    ``batch.input_embeds`` are the target's merged embeddings (image features at placeholder rows);
    when present they are rotated like the ids, into a fresh tensor the target never touches, and
    every tail row gets ``tail_embeds``. Without them the draft embeds the rotated ids itself.
    """
    ids = rotate_segments(batch, batch.input_ids, tail_ids)
    if batch.input_embeds is None:
        return ids, None
    if tail_embeds is None:
        raise ValueError("a multimodal draft extend needs the tail tokens' embeddings")
    return ids, rotate_segments(batch, batch.input_embeds, tail_embeds)
