"""A request's images: preprocessed pixels, placeholder expansion, and where the features go."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglet.errors import InvalidRequestError


@dataclass
class MultimodalInputs:
    pixel_values: torch.Tensor  # [total_patches, 3, p, p]
    grid_thws: torch.Tensor  # [n_images, 3]
    # Positions (in the expanded prompt) of the placeholder tokens, in image order; one feature row each.
    placeholder_positions: torch.Tensor  # [N] int64, increasing
    features: torch.Tensor | None = None  # [N, hidden], filled by the model runner on first use

    def feature_rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Placeholders at positions [start, end): (their offsets from start, their feature row ids)."""
        lo = int(torch.searchsorted(self.placeholder_positions, start))
        hi = int(torch.searchsorted(self.placeholder_positions, end))
        return self.placeholder_positions[lo:hi] - start, torch.arange(lo, hi)


def expand_placeholders(
    token_ids: list[int], image_token_id: int, tokens_per_image: list[int]
) -> tuple[list[int], torch.Tensor]:
    """Repeats the i-th image placeholder tokens_per_image[i] times.

    Returns the expanded ids and the positions of every placeholder in them.
    """
    found = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(found) != len(tokens_per_image):
        raise InvalidRequestError(
            f"the prompt holds {len(found)} image placeholder token(s) (id {image_token_id}) but "
            f"{len(tokens_per_image)} image(s) were given; put exactly one placeholder per image"
        )
    expanded: list[int] = []
    positions: list[int] = []
    previous = 0
    for index, count in zip(found, tokens_per_image):
        expanded.extend(token_ids[previous:index])
        positions.extend(range(len(expanded), len(expanded) + count))
        expanded.extend([image_token_id] * count)
        previous = index + 1
    expanded.extend(token_ids[previous:])
    return expanded, torch.tensor(positions, dtype=torch.long)
