import torch
from torch import nn


def merge_image_features(
    embed_tokens: nn.Embedding, input_ids: torch.Tensor, placeholder_rows: torch.Tensor, features: torch.Tensor
) -> torch.Tensor:
    """Token embeddings with the rows at ``placeholder_rows`` replaced by ``features``.

    Placeholder ids are never looked up in embed_tokens (they may lie outside a draft's table).
    """
    ids = input_ids.clone()
    ids[placeholder_rows] = 0
    embeds = embed_tokens(ids)
    embeds[placeholder_rows] = features.to(embeds.dtype)
    return embeds
