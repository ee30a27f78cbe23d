"""Speculative decoding settings, named as in SGLang."""

from __future__ import annotations

from dataclasses import dataclass

from eaglet.errors import ConfigError


@dataclass(frozen=True)
class SpeculativeConfig:
    draft_model_path: str
    algorithm: str = "EAGLE3"
    num_steps: int = 3  # tree depth: draft tokens along one path
    eagle_topk: int = 1  # branching per step; 1 drafts a chain
    num_draft_tokens: int = 4  # tree size including the root

    def __post_init__(self) -> None:
        if self.algorithm.upper() not in ("EAGLE3", "EAGLE-3"):
            raise ConfigError(f"speculative_algorithm {self.algorithm!r} is not supported (EAGLE3)")
        for name in ("num_steps", "eagle_topk", "num_draft_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"speculative_{name} must be a positive integer, got {value!r}")
        if self.num_draft_tokens < 2:
            raise ConfigError("speculative_num_draft_tokens must be at least 2 (the root and one draft token)")
        if self.num_draft_tokens - 1 > self.num_candidates:
            raise ConfigError(
                f"speculative_num_draft_tokens {self.num_draft_tokens} exceeds the {self.num_candidates} candidates "
                f"that {self.num_steps} steps of top-{self.eagle_topk} drafting produce (+1 for the root)"
            )

    @property
    def num_candidates(self) -> int:
        """Draft nodes recorded while growing the tree: topk at step 0, topk^2 at each later step."""
        return self.eagle_topk + (self.num_steps - 1) * self.eagle_topk**2

    @property
    def scratch_len(self) -> int:
        """Row indices past the committed prefix that one round uses (draft scratch or the verify tree)."""
        return max(self.num_draft_tokens, (self.num_steps - 1) * self.eagle_topk)
