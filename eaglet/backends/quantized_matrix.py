"""A weight matrix stored quantized as a checkpoint ships it: codes plus one scale per row per group of
columns. Two formats:

- ``int4``: compressed-tensors ``pack-quantized`` (Kimi-K2.5's routed experts). ``codes`` int32
  [..., out, in / 8], eight values per int32 stored as value + 8 in unsigned nibbles, the least
  significant nibble first along the input dimension; ``scales`` [..., out, in / group_size].
- ``int8``: what ``--quantization int8`` makes at load time: ``codes`` int8 [..., out, in],
  symmetric (compressed-tensors' rule, as for int4), ``scales`` [..., out, in / group_size].
- ``fp8``: DeepSeek-V3's e4m3 block quantization. ``codes`` float8_e4m3fn [..., out, in]; the
  checkpoint's one ``weight_scale_inv`` per 128 x 128 block is kept per row ([..., out, ceil(in /
  128)] float32, 3% of the codes' bytes) so that matrices concatenate by rows at any row count
  (gate with up, q_a with kv_a) and every format is "one scale per row per column group".

The weight is ``code * scale`` for each element; methods multiply by it without ever holding the
whole matrix dequantized. Integer weights can also meet their activations quantized to int8
(``int8_activation_values``, W4A8 / W8A8, opt-in): llama.cpp's Q8_0 rule per block of 32 values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_PER_INT32 = 8
INT4_OFFSET = 8
FORMATS = ("int4", "int8", "fp8")
INTEGER_FORMATS = ("int4", "int8")  # the formats int8 activations run against
ACTIVATION_BLOCK = 32  # activation values per int8 scale (W4A8)


@dataclass(frozen=True)
class QuantizedMatrix:
    format: str  # one of FORMATS
    codes: torch.Tensor
    scales: torch.Tensor
    group_size: int  # columns per scale
    in_features: int

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"quantized matrix format {self.format!r} is not one of {FORMATS}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., out, in] shape."""
        return (*self.codes.shape[:-1], self.in_features)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def __getitem__(self, index: int) -> QuantizedMatrix:
        """One matrix of a stack (an expert of [E, out, in])."""
        return QuantizedMatrix(self.format, self.codes[index], self.scales[index], self.group_size, self.in_features)

    def rows(self, start: int, stop: int) -> QuantizedMatrix:
        """Output rows start..stop of a 2-D matrix (a view)."""
        return QuantizedMatrix(self.format, self.codes[start:stop], self.scales[start:stop], self.group_size, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [..., out, in] weight, computed in float32 (exact for int4 codes times bfloat16 scales)."""
        if self.format == "int4":
            values = unpack_int4(self.codes, self.in_features).float()
        else:
            values = self.codes.float()  # int8 and fp8 codes hold one value each
        scales = self.scales.float().repeat_interleave(self.group_size, dim=-1)[..., : self.in_features]
        return (values * scales).to(dtype)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int8 values [..., out, in] of pack-quantized int32 words [..., out, in / 8]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed[..., None] >> shifts) & 0xF
    return (nibbles.reshape(*packed.shape[:-1], -1)[..., :in_features] - INT4_OFFSET).to(torch.int8)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """The inverse of ``unpack_int4`` for int values in [-8, 7], in % 8 == 0."""
    nibbles = (values.to(torch.int32) + INT4_OFFSET).reshape(*values.shape[:-1], -1, INT4_PER_INT32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (nibbles << shifts).sum(-1, dtype=torch.int32)


def quantize_int4(weight: torch.Tensor, group_size: int) -> QuantizedMatrix:
    """Symmetric int4 of a [..., out, in] weight by compressed-tensors' rule: per group of
    ``group_size`` columns a bfloat16 scale absmax / 7.5, values round(w / scale) clamped to [-8, 7]."""
    values, scales = _symmetric_groups(weight, group_size, 4)
    return QuantizedMatrix("int4", pack_int4(values), scales, group_size, weight.shape[-1])


def quantize_int8(weight: torch.Tensor, group_size: int) -> QuantizedMatrix:
    """Symmetric int8 of a [..., out, in] weight by the same rule in 8 bits: per group a bfloat16
    scale absmax / 127.5, values round(w / scale) clamped to [-128, 127]."""
    values, scales = _symmetric_groups(weight, group_size, 8)
    return QuantizedMatrix("int8", values.to(torch.int8), scales, group_size, weight.shape[-1])


def _symmetric_groups(weight: torch.Tensor, group_size: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, bfloat16 scales) of compressed-tensors' symmetric rule for ``bits`` per group of columns."""
    if weight.shape[-1] % group_size:
        raise ValueError(f"groups of {group_size} columns do not divide a width of {weight.shape[-1]}")
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    groups = weight.reshape(*weight.shape[:-1], -1, group_size)
    scales = (groups.float().abs().amax(-1) / ((high - low) / 2)).bfloat16()
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    # Divided in the weight's dtype (bfloat16 / bfloat16 rounds to bfloat16), as compressed-tensors does.
    values = (groups / scales[..., None]).round().clamp(low, high).reshape(weight.shape)
    return values, scales


def int8_activation_values(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as W4A8 multiplies it, in float32: per row and block of 32 values a float32 scale
    d = absmax / 127 and codes round(x * (1 / d)) (ties to even), times d. The same arithmetic as
    the int4_linear_a8 / int8_linear_a8 kernels' quantization, so both see the same int8 codes."""
    rows, width = x.shape
    padded = -width % ACTIVATION_BLOCK
    blocks = torch.nn.functional.pad(x.float(), (0, padded)).view(rows, -1, ACTIVATION_BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    codes = (blocks * inverse).round().clamp(-127, 127)
    return (codes * scale).view(rows, -1)[:, :width]


def cat_rows(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Matrices of one format, group size and input width stacked by rows (gate on up)."""
    first = parts[0]
    _check_alike(parts)
    return QuantizedMatrix(
        first.format, torch.cat([p.codes for p in parts], dim=-2), torch.cat([p.scales for p in parts], dim=-2),
        first.group_size, first.in_features,
    )


def stack(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Equal-shaped matrices as one [E, out, in] stack (a layer's experts)."""
    first = parts[0]
    _check_alike(parts)
    return QuantizedMatrix(
        first.format, torch.stack([p.codes for p in parts]), torch.stack([p.scales for p in parts]),
        first.group_size, first.in_features,
    )


def _check_alike(parts: list[QuantizedMatrix]) -> None:
    first = parts[0]
    for p in parts[1:]:
        if (p.format, p.group_size, p.in_features, p.scales.dtype) != (
            first.format, first.group_size, first.in_features, first.scales.dtype
        ):
            raise ValueError(
                f"cannot join quantized matrices of different forms: {p.format}/{p.group_size}/{p.in_features} "
                f"and {first.format}/{first.group_size}/{first.in_features}"
            )
