"""The ragged batch contract: everything a forward pass needs to know about a flat batch.

A forward runs over ONE flat buffer holding the new tokens of every request, request after request.
Per request i (in batch order):

- ``extend_start_loc[i]``: offset of its first new token in the flat buffer;
- ``extend_seq_lens[i]``: how many new tokens it has (1 for a decode step);
- ``extend_prefix_lens[i]``: how many of its tokens are already in the KV cache;
- ``seq_lens[i] = extend_prefix_lens[i] + extend_seq_lens[i]``;
- ``req_pool_indices[i]``: its row in the request-to-slots table (``ReqToTokenPool``), whose first
  ``seq_lens[i]`` entries are the cache slots of its tokens in order.

Per token t of the flat buffer:

- ``positions[t]``: its RoPE position;
- ``out_cache_loc[t]``: the cache slot this forward writes its K/V latent to;
- ``input_ids[t]``: its token id (multimodal placeholders included; see ``input_embeds``).

Any per-request operation on the flat buffer must use the request's own segment
``[extend_start_loc[i], extend_start_loc[i] + extend_seq_lens[i])``: the last token of request i
is ``extend_start_loc[i] + extend_seq_lens[i] - 1``, never ``x[-1]`` of the buffer.

By default token t attends to the cache entries of its request at row indices
``<= extend_prefix_lens[i] + (t - extend_start_loc[i])`` (causal). Tree verification and draft tree
steps pass ``custom_mask`` instead: ``custom_mask[t, j]`` says whether token t sees row index j of
its request's table; row index and RoPE position differ there (siblings share a position).

A forward returns logits only at ``logits_indices`` (default: each request's last token), or with
``greedy_ids_only`` possibly just their argmax (``ForwardOutput.greedy_ids``), and,
when ``capture_layers`` is set, the residual stream after each of those layers, concatenated
along the hidden dimension, at every token (EAGLE-3 reads three of them).
"""

from __future__ import annotations

import array
import functools
import itertools
from dataclasses import dataclass, field
from enum import Enum, auto

import torch


def long_tensor(values: list[int]) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.long)`` for a flat list, through an int64 array: 4-6x
    faster for the short lists of a decode step (torch.tensor parses every element as a Python
    object; about 6 us for 80 ints where this takes 1.5)."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array.array("q", values), dtype=torch.long)


@functools.lru_cache(maxsize=256)
def _same_length_offsets(batch_size: int, new_tokens: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(extend_seq_lens, extend_start_loc, token_starts) of ``batch_size`` requests of ``new_tokens``
    new tokens each; made once per shape (a speculative round's verify asks for the same ones every
    round) and only ever read. Made outside inference mode so any later caller may read them."""
    with torch.inference_mode(False):
        total = batch_size * new_tokens
        starts = torch.arange(0, total + 1, new_tokens, device=device)
        return torch.full((batch_size,), new_tokens, dtype=torch.long, device=device), starts[:-1], starts


def _check_flat_buffer(input_ids: torch.Tensor, out_cache_loc: torch.Tensor, positions: torch.Tensor, total: int) -> None:
    if input_ids.shape[0] != total or out_cache_loc.shape[0] != total or positions.shape[0] != total:
        raise ValueError(f"flat buffer holds {input_ids.shape[0]} ids / {out_cache_loc.shape[0]} slots / "
                         f"{positions.shape[0]} positions, expected {total}")


class ForwardMode(Enum):
    EXTEND = auto()  # prefill / chunked prefill: new tokens attend in the decompressed form
    DECODE = auto()  # one new token per request: absorbed attention over the latent cache
    VERIFY = auto()  # speculative tree/chain tokens after a cached prefix: absorbed, custom mask


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    extend_seq_lens: torch.Tensor  # [B] int64
    extend_prefix_lens: torch.Tensor  # [B] int64
    extend_start_loc: torch.Tensor  # [B] int64
    logits_indices: torch.Tensor  # [K] int64 rows of the flat buffer to compute logits at
    # Host copies of the per-request lengths, for loops and shapes without device syncs.
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    # Token embeddings to use instead of embed_tokens(input_ids) (multimodal merge), [T, D].
    input_embeds: torch.Tensor | None = None
    # Layer ids whose output residual stream is returned (EAGLE-3 auxiliary hidden states).
    capture_layers: tuple[int, ...] = ()
    # [T, max(seq_lens)] bool: which row indices of its request each token sees (None: causal).
    custom_mask: torch.Tensor | None = None
    # Only the greedy token of each logits row is wanted (every request greedy, without logits
    # processing or logprobs): the forward may return ``greedy_ids`` instead of ``logits``.
    greedy_ids_only: bool = False
    # Per-forward memo of derived tensors (every layer asks for the same ones).
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def token_to_request(self) -> torch.Tensor:
        """[T]: the batch index of the request each flat-buffer token belongs to."""
        if "token_to_request" not in self._memo:
            self._memo["token_to_request"] = torch.repeat_interleave(
                torch.arange(self.batch_size, device=self.input_ids.device), self.extend_seq_lens, output_size=self.num_tokens
            )
        return self._memo["token_to_request"]

    def token_starts(self) -> torch.Tensor:
        """[B + 1]: offset of each request's first new token, then the token count."""
        if "token_starts" not in self._memo:
            self._memo["token_starts"] = torch.cat([self.extend_start_loc, self.extend_start_loc.new_tensor([self.num_tokens])])
        return self._memo["token_starts"]

    def new_tokens_per_request(self) -> int | None:
        """n when every request has the same number n of new tokens (decode: 1; verify and draft
        tree steps: the tree or frontier size), else None."""
        if "new_tokens_per_request" not in self._memo:
            lens = self.extend_seq_lens_cpu
            self._memo["new_tokens_per_request"] = lens[0] if all(n == lens[0] for n in lens) else None
        return self._memo["new_tokens_per_request"]

    def attention_mask(self, num_keys: int) -> torch.Tensor:
        """[T, num_keys] bool over row indices: ``custom_mask`` if set, else causal per request."""
        if self.custom_mask is not None:
            return self.custom_mask[:, :num_keys]
        key = ("attention_mask", num_keys)
        if key not in self._memo:
            token_req = self.token_to_request()
            offsets = torch.arange(self.num_tokens, device=self.input_ids.device) - self.extend_start_loc[token_req]
            query_index = self.extend_prefix_lens[token_req] + offsets
            self._memo[key] = torch.arange(num_keys, device=self.input_ids.device)[None, :] <= query_index[:, None]
        return self._memo[key]

    @staticmethod
    def last_token_indices(extend_start_loc: torch.Tensor, extend_seq_lens: torch.Tensor) -> torch.Tensor:
        return extend_start_loc + extend_seq_lens - 1

    @classmethod
    def same_length(
        cls,
        *,
        new_tokens: int,
        input_ids: torch.Tensor,
        req_pool_indices: torch.Tensor,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: list[int],
        out_cache_loc: torch.Tensor,
        positions: torch.Tensor,
        mode: ForwardMode,
        logits_indices: torch.Tensor,
        capture_layers: tuple[int, ...] = (),
        custom_mask: torch.Tensor | None = None,
        greedy_ids_only: bool = False,
    ) -> "ForwardBatch":
        """``build`` for ``new_tokens`` new tokens per request whose rows and prefix lengths are
        already tensors (a speculative round's verify): the same values from one tensor op (the
        lengths and offsets, and the attention's token_starts, are shared per shape) instead of a
        host copy and its unbinding."""
        batch_size = len(prefix_lens_cpu)
        total = batch_size * new_tokens
        if new_tokens <= 0 or req_pool_indices.shape != (batch_size,) or prefix_lens.shape != (batch_size,):
            raise ValueError("same_length: one row index and prefix length per request, and at least one new token")
        _check_flat_buffer(input_ids, out_cache_loc, positions, total)
        extend_seq_lens, extend_start_loc, token_starts = _same_length_offsets(batch_size, new_tokens, str(input_ids.device))
        return cls(
            mode=mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_pool_indices,
            seq_lens=prefix_lens + new_tokens,
            extend_seq_lens=extend_seq_lens,
            extend_prefix_lens=prefix_lens,
            extend_start_loc=extend_start_loc,
            logits_indices=logits_indices,
            seq_lens_cpu=[p + new_tokens for p in prefix_lens_cpu],
            extend_seq_lens_cpu=[new_tokens] * batch_size,
            extend_prefix_lens_cpu=list(prefix_lens_cpu),
            capture_layers=capture_layers,
            custom_mask=custom_mask,
            greedy_ids_only=greedy_ids_only,
            _memo={"token_starts": token_starts},
        )

    @classmethod
    def ragged(
        cls,
        *,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_seq_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        token_starts: torch.Tensor,
        logits_indices: torch.Tensor,
        prefix_lens_cpu: list[int],
        extend_seq_lens_cpu: list[int],
        mode: ForwardMode,
    ) -> "ForwardBatch":
        """``build`` where a kernel already made the per-request tensors (a speculative round's
        draft extend, from ``commit_table``): ``token_starts`` [B + 1] is each request's first new
        token, then the token count. The host lists must hold the tensors' values: shapes are
        checked here, values are not (that would cost a copy back)."""
        batch_size = len(prefix_lens_cpu)
        total = sum(extend_seq_lens_cpu)
        per_request = (req_pool_indices, prefix_lens, extend_seq_lens, seq_lens, logits_indices)
        if (len(extend_seq_lens_cpu) != batch_size or any(t.shape != (batch_size,) for t in per_request)
                or token_starts.shape != (batch_size + 1,)):
            raise ValueError("ragged: one row index, prefix length, new-token count, sequence length and logits row per "
                             "request, and B + 1 token starts")
        if extend_seq_lens_cpu and min(extend_seq_lens_cpu) <= 0:
            raise ValueError("every request in a forward batch needs at least one new token")
        _check_flat_buffer(input_ids, out_cache_loc, positions, total)
        return cls(
            mode=mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            extend_seq_lens=extend_seq_lens,
            extend_prefix_lens=prefix_lens,
            extend_start_loc=token_starts[:-1],
            logits_indices=logits_indices,
            seq_lens_cpu=[p + n for p, n in zip(prefix_lens_cpu, extend_seq_lens_cpu)],
            extend_seq_lens_cpu=list(extend_seq_lens_cpu),
            extend_prefix_lens_cpu=list(prefix_lens_cpu),
            _memo={"token_starts": token_starts},
        )

    @classmethod
    def build(
        cls,
        *,
        input_ids: list[int] | torch.Tensor,
        req_pool_indices: list[int],
        extend_prefix_lens: list[int],
        extend_seq_lens: list[int],
        out_cache_loc: torch.Tensor,
        positions: torch.Tensor | None = None,
        mode: ForwardMode | None = None,
        logits_indices: torch.Tensor | None = None,
        input_embeds: torch.Tensor | None = None,
        capture_layers: tuple[int, ...] = (),
        custom_mask: torch.Tensor | None = None,
        greedy_ids_only: bool = False,
        device: torch.device | str = "cpu",
    ) -> "ForwardBatch":
        """Derives every offset from the per-request lengths, so callers cannot get them inconsistent."""
        if len(req_pool_indices) != len(extend_prefix_lens) or len(extend_prefix_lens) != len(extend_seq_lens):
            raise ValueError("req_pool_indices, extend_prefix_lens and extend_seq_lens differ in length")
        if extend_seq_lens and min(extend_seq_lens) <= 0:
            raise ValueError("every request in a forward batch needs at least one new token")
        if isinstance(input_ids, list):
            ids = long_tensor(input_ids).to(device)
        else:
            ids = input_ids.to(device=device, dtype=torch.long)  # no copy where it is already so
        start_loc_cpu = list(itertools.accumulate(extend_seq_lens, initial=0))
        total = start_loc_cpu.pop()
        if ids.shape[0] != total or out_cache_loc.shape[0] != total:
            raise ValueError(f"flat buffer holds {ids.shape[0]} ids / {out_cache_loc.shape[0]} slots, expected {total}")
        seq_lens_cpu = [p + n for p, n in zip(extend_prefix_lens, extend_seq_lens)]
        vectors = [*extend_seq_lens, *extend_prefix_lens, *start_loc_cpu, *seq_lens_cpu, *req_pool_indices]
        if logits_indices is None:  # each request's last token
            vectors += [s + n - 1 for s, n in zip(start_loc_cpu, extend_seq_lens)]
        # The per-request vectors in one host-to-tensor copy: rows of a [5 or 6, B] tensor, then
        # the attention's token_starts (start_loc and the total).
        host = long_tensor(vectors + start_loc_cpu + [total]).to(device)
        num_vectors = len(vectors) // max(1, len(extend_seq_lens))
        ext_lens, prefix_lens, start_loc, seq_lens, pool_indices, *last_tokens = host[: len(vectors)].view(
            num_vectors, len(extend_seq_lens)
        ).unbind(0)
        if positions is None:
            positions = long_tensor(
                list(itertools.chain.from_iterable(range(p, p + n) for p, n in zip(extend_prefix_lens, extend_seq_lens)))
            ).to(device)
        if mode is None:
            mode = ForwardMode.DECODE if all(n == 1 for n in extend_seq_lens) else ForwardMode.EXTEND
        if logits_indices is None:
            logits_indices = last_tokens[0]
        return cls(
            mode=mode,
            input_ids=ids,
            positions=positions,
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.long),
            req_pool_indices=pool_indices,
            seq_lens=seq_lens,
            extend_seq_lens=ext_lens,
            extend_prefix_lens=prefix_lens,
            extend_start_loc=start_loc,
            logits_indices=logits_indices,
            seq_lens_cpu=seq_lens_cpu,
            extend_seq_lens_cpu=list(extend_seq_lens),
            extend_prefix_lens_cpu=list(extend_prefix_lens),
            input_embeds=input_embeds,
            capture_layers=capture_layers,
            custom_mask=custom_mask,
            greedy_ids_only=greedy_ids_only,
            _memo={"token_starts": host[len(vectors) :]},
        )
