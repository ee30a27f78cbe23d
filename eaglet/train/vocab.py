"""The draft's hot vocabulary: the target ids its lm_head predicts, chosen by response-token frequency.

As SpecForge builds it: count the response tokens, keep the ``draft_vocab_size`` most frequent ids
(ties broken by the lower id, so the choice is deterministic), sort them ascending, and store

* ``d2t`` int64 [draft_vocab]: offsets, ``target_id = draft_id + d2t[draft_id]``;
* ``t2d`` bool [vocab]: whether a target id is in the draft vocabulary.

When the responses hold fewer distinct ids than ``draft_vocab_size``, the lowest unused ids fill
the rest (the draft's lm_head must have exactly ``draft_vocab_size`` rows).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HotVocab:
    used_ids: torch.Tensor  # [draft_vocab] int64 target ids, ascending
    d2t: torch.Tensor  # [draft_vocab] int64 offsets
    t2d: torch.Tensor  # [vocab] bool

    @property
    def draft_vocab_size(self) -> int:
        return int(self.used_ids.numel())

    @property
    def vocab_size(self) -> int:
        return int(self.t2d.numel())

    @classmethod
    def from_used_ids(cls, used_ids: torch.Tensor, vocab_size: int) -> HotVocab:
        used = used_ids.to(torch.long).sort().values
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[used] = True
        return cls(used_ids=used, d2t=used - torch.arange(used.numel()), t2d=t2d)


def build_hot_vocab(token_sequences: Iterable[Iterable[int]], vocab_size: int, draft_vocab_size: int) -> HotVocab:
    """The ``draft_vocab_size`` most frequent ids of ``token_sequences`` (the targets' responses)."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, vocab_size {vocab_size}]")
    counts: Counter[int] = Counter()
    for tokens in token_sequences:
        counts.update(tokens)
    bad = [t for t in counts if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids outside the vocabulary [0, {vocab_size}): {sorted(bad)[:5]}")
    ranked = sorted(counts, key=lambda token: (-counts[token], token))[:draft_vocab_size]
    if len(ranked) < draft_vocab_size:
        chosen = set(ranked)
        fill = (t for t in range(vocab_size) if t not in chosen)
        ranked += [next(fill) for _ in range(draft_vocab_size - len(ranked))]
    return HotVocab.from_used_ids(torch.tensor(ranked, dtype=torch.long), vocab_size)
