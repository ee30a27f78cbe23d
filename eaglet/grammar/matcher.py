"""One request's grammar state and the token masks it gives.

A mask allows exactly the tokens the grammar can take next. The request's final tokens (EOS, its
stop token ids) are allowed only where the grammar accepts the output as complete; a token that
ends the request is never consumed by the grammar. Speculative rounds ask for masks along draft
paths (``path_masks``): the matcher consumes a path's tokens, gives the mask, and rolls back, so
its state is always that after the request's emitted tokens.
"""

from __future__ import annotations

from typing import Any

import torch

_BITS = torch.arange(8, dtype=torch.uint8)


class GrammarMatcher:
    def __init__(self, matcher: Any, vocab_size: int, final_token_ids: tuple[int, ...]) -> None:
        self._matcher = matcher  # llguidance.LLMatcher
        self.vocab_size = vocab_size
        self._final_ids = torch.tensor([t for t in final_token_ids if t < vocab_size], dtype=torch.long)

    @property
    def finished(self) -> bool:
        """Nothing but an end of sequence can follow: the output is complete."""
        return self._matcher.is_stopped()

    def accept(self, token: int) -> None:
        """Advances past an emitted token (one the mask allowed)."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar rejected emitted token {token}: {self._matcher.get_error()}")

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens that may come next."""
        bits = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits[:, None] >> _BITS) & 1).view(-1)[: self.vocab_size].bool()
        if len(allowed) < self.vocab_size:  # ids past the tokenizer's vocabulary are never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(self.vocab_size - len(allowed))])
        allowed[self._final_ids] = self._matcher.is_accepting()
        return allowed

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar takes in a row from here (the state is unchanged)."""
        taken = self._matcher.try_consume_tokens(tokens)
        self._matcher.rollback(taken)
        return taken

    def path_masks(self, paths: list[list[int]]) -> list[torch.Tensor | None]:
        """Per path (draft tokens after the emitted ones), the mask after it; None where the
        grammar rejects one of its tokens."""
        masks: list[torch.Tensor | None] = []
        for path in paths:
            taken = self._matcher.try_consume_tokens(path)
            masks.append(self.allowed() if taken == len(path) else None)
            self._matcher.rollback(taken)
        return masks


def mask_logits(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """``logits`` [R, V] with each grammar row's disallowed tokens at -inf (a copy; ``logits``
    itself when no row has a grammar)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    allowed = torch.stack([matchers[i].allowed() for i in rows]).to(logits.device)
    out = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    out[index] = out[index].masked_fill(~allowed, float("-inf"))
    return out
