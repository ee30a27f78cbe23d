"""MoonViT vision tower and patch-merger projector of Kimi-K2.5, for inference.

Parameter names follow the published checkpoint (relative to ``vision_tower.`` and
``mm_projector.``). The fused ``wqkv`` keeps the published row order, in which the query and key
heads use the interleaved (complex) 2-D RoPE layout: pair ``2i`` of a head rotates by the column
index and pair ``2i + 1`` by the row index, both at frequency ``theta ** (-4i / head_dim)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import skip_init

from eaglet.errors import ConfigError, InvalidRequestError


def _linear(in_features: int, out_features: int) -> nn.Linear:
    return skip_init(nn.Linear, in_features, out_features)


def _layer_norm(dim: int, eps: float) -> nn.LayerNorm:
    return skip_init(nn.LayerNorm, dim, eps=eps)


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

_MISSING = object()


def _pick(section: dict[str, Any], where: str, *names: str, default: Any = _MISSING) -> Any:
    """The value under the first of ``names`` present; two spellings that disagree are an error."""
    found = [(name, section[name]) for name in names if section.get(name) is not None]
    if not found:
        if default is _MISSING:
            raise ConfigError(f"{where}: missing {' / '.join(names)}")
        return default
    name, value = found[0]
    for other, other_value in found[1:]:
        if other_value != value:
            raise ConfigError(f"{where}: {name}={value!r} disagrees with {other}={other_value!r}")
    return value


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def _positive_float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def _require_value(section: dict[str, Any], key: str, allowed: tuple[Any, ...], where: str) -> None:
    value = section.get(key)
    if value is not None and value not in allowed:
        raise ConfigError(f"{where}.{key}={value!r} is not supported (expected one of {list(allowed)})")


@dataclass(frozen=True)
class KimiVisionConfig:
    patch_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    pos_emb_height: int
    pos_emb_width: int
    pos_emb_time: int
    merge_kernel_size: tuple[int, int]
    rope_theta: float
    layer_norm_eps: float
    projector_ln_eps: float
    text_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def merged_hidden_size(self) -> int:
        return self.hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @classmethod
    def from_hf(cls, top_level_config: dict) -> KimiVisionConfig:
        """Read the vision part of a whole Kimi-K2.5 ``config.json`` (published or transformers spelling)."""
        if not isinstance(top_level_config, dict):
            raise ConfigError(f"config must be a dict, got {type(top_level_config).__name__}")
        vision = top_level_config.get("vision_config")
        if not isinstance(vision, dict):
            raise ConfigError("config.json: missing vision_config")
        text = top_level_config.get("text_config")
        text = text if isinstance(text, dict) else {}
        where = "vision_config"

        _require_value(vision, "hidden_act", ("gelu_pytorch_tanh", "gelu_tanh"), where)
        _require_value(vision, "projector_hidden_act", ("gelu",), where)
        _require_value(vision, "pos_emb_type", ("divided_fixed",), where)
        _require_value(vision, "merge_type", ("sd2_tpool",), where)
        _require_value(vision, "mm_projector_type", ("patchmerger",), where)

        hidden = _positive_int(_pick(vision, where, "vt_hidden_size", "hidden_size"), f"{where}.vt_hidden_size")
        heads = _positive_int(
            _pick(vision, where, "vt_num_attention_heads", "num_attention_heads"), f"{where}.vt_num_attention_heads"
        )
        if hidden % heads:
            raise ConfigError(f"{where}: vt_hidden_size {hidden} is not divisible by vt_num_attention_heads {heads}")
        if (hidden // heads) % 4:
            raise ConfigError(
                f"{where}: vision head dim {hidden // heads} (vt_hidden_size / vt_num_attention_heads) "
                "must be divisible by 4 for the 2-D RoPE"
            )

        merge = _pick(vision, where, "merge_kernel_size", default=[2, 2])
        if isinstance(merge, int) and not isinstance(merge, bool):
            merge = [merge, merge]
        if not isinstance(merge, (list, tuple)) or len(merge) != 2:
            raise ConfigError(f"{where}.merge_kernel_size must be two positive integers, got {merge!r}")
        merge_kernel = (
            _positive_int(merge[0], f"{where}.merge_kernel_size"),
            _positive_int(merge[1], f"{where}.merge_kernel_size"),
        )

        rope_theta: Any = 10000.0  # MoonViT hard-codes it; transformers writes it in rope_parameters
        rope_parameters = vision.get("rope_parameters")
        if rope_parameters is not None:
            if not isinstance(rope_parameters, dict):
                raise ConfigError(f"{where}.rope_parameters must be a dict, got {rope_parameters!r}")
            _require_value(rope_parameters, "rope_type", ("axial", "default"), f"{where}.rope_parameters")
            rope_theta = rope_parameters.get("rope_theta", rope_theta)
        rope_theta = vision.get("rope_theta", rope_theta)

        mm_hidden = _pick(vision, where, "mm_hidden_size", default=None)
        if mm_hidden is None:
            mm_hidden = top_level_config.get("projection_hidden_size")
            mm_key = "projection_hidden_size"
        else:
            mm_key = f"{where}.mm_hidden_size"
        if mm_hidden is not None and mm_hidden != hidden:
            raise ConfigError(f"{mm_key}={mm_hidden!r} must equal the vision hidden size {hidden}")

        projector_eps = vision.get("projector_ln_eps")
        projector_eps_key = f"{where}.projector_ln_eps"
        if projector_eps is None:
            projector_eps = top_level_config.get("projection_layer_norm_eps", 1e-5)
            projector_eps_key = "projection_layer_norm_eps"

        text_hidden = vision.get("text_hidden_size")
        lm_hidden = text.get("hidden_size")
        if text_hidden is None and lm_hidden is None:
            raise ConfigError(f"config.json: missing {where}.text_hidden_size / text_config.hidden_size")
        if text_hidden is not None and lm_hidden is not None and text_hidden != lm_hidden:
            raise ConfigError(
                f"{where}.text_hidden_size={text_hidden!r} disagrees with text_config.hidden_size={lm_hidden!r}"
            )
        text_hidden = text_hidden if text_hidden is not None else lm_hidden

        return cls(
            patch_size=_positive_int(_pick(vision, where, "patch_size"), f"{where}.patch_size"),
            hidden_size=hidden,
            num_hidden_layers=_positive_int(
                _pick(vision, where, "vt_num_hidden_layers", "num_hidden_layers"), f"{where}.vt_num_hidden_layers"
            ),
            num_attention_heads=heads,
            intermediate_size=_positive_int(
                _pick(vision, where, "vt_intermediate_size", "intermediate_size"), f"{where}.vt_intermediate_size"
            ),
            pos_emb_height=_positive_int(
                _pick(vision, where, "init_pos_emb_height", "pos_emb_height"), f"{where}.init_pos_emb_height"
            ),
            pos_emb_width=_positive_int(
                _pick(vision, where, "init_pos_emb_width", "pos_emb_width"), f"{where}.init_pos_emb_width"
            ),
            pos_emb_time=_positive_int(
                _pick(vision, where, "init_pos_emb_time", "pos_emb_time", default=4), f"{where}.init_pos_emb_time"
            ),
            merge_kernel_size=merge_kernel,
            rope_theta=_positive_float(rope_theta, f"{where}.rope_parameters.rope_theta"),
            layer_norm_eps=_positive_float(vision.get("layer_norm_eps", 1e-5), f"{where}.layer_norm_eps"),
            projector_ln_eps=_positive_float(projector_eps, projector_eps_key),
            text_hidden_size=_positive_int(text_hidden, f"{where}.text_hidden_size"),
        )


# ---------------------------------------------------------------------------------------------
# Vision tower
# ---------------------------------------------------------------------------------------------


class KimiPositionEmbedding(nn.Module):
    """Learned (h, w) table resampled bicubically to each grid, plus a fixed sin/cos time table."""

    def __init__(self, config: KimiVisionConfig) -> None:
        super().__init__()
        self.num_frames = config.pos_emb_time
        self.weight = nn.Parameter(torch.empty(config.pos_emb_height, config.pos_emb_width, config.hidden_size))

    def time_table(self, num_frames: int) -> Tensor:
        """[num_frames, D] float32: sin then cos of frame * 10000^(-2i/D)."""
        dim = self.weight.shape[-1]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=self.weight.device) / dim))
        freqs = torch.outer(torch.arange(num_frames, dtype=torch.float32, device=self.weight.device), inv_freq)
        return torch.cat([freqs.sin(), freqs.cos()], dim=1)

    def spatial(self, height: int, width: int) -> Tensor:
        """[height * width, D] float32, in raster order."""
        if (height, width) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1).float()
        table = self.weight.float().permute(2, 0, 1).unsqueeze(0)
        resized = F.interpolate(table, size=(height, width), mode="bicubic", align_corners=False)
        return resized.squeeze(0).flatten(1).t()

    def forward(self, grids: list[tuple[int, int, int]]) -> Tensor:
        parts = []
        for t, h, w in grids:
            pos = self.spatial(h, w)
            if t > 1:  # single frames get no time term
                if t > self.num_frames:
                    raise InvalidRequestError(f"{t} frames exceed the vision time table ({self.num_frames})")
                pos = pos.unsqueeze(0) + self.time_table(t)[:, None, :]
            parts.append(pos.reshape(-1, pos.shape[-1]))
        return torch.cat(parts)


class KimiPatchEmbed(nn.Module):
    def __init__(self, config: KimiVisionConfig) -> None:
        super().__init__()
        p = config.patch_size
        self.proj = skip_init(nn.Conv2d, 3, config.hidden_size, kernel_size=p, stride=p)
        self.pos_emb = KimiPositionEmbedding(config)

    def forward(self, pixel_values: Tensor, grids: list[tuple[int, int, int]]) -> Tensor:
        x = self.proj(pixel_values).flatten(1)  # one p x p patch -> one [D] vector
        return x + self.pos_emb(grids).to(x.dtype)


class KimiVisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc0 = _linear(dim, hidden)
        self.fc1 = _linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate consecutive pairs (x[2j], x[2j+1]) by angle j. x [N, H, hd]; cos/sin [N, hd/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class KimiVisionBlock(nn.Module):
    def __init__(self, config: KimiVisionConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.norm0 = _layer_norm(dim, config.layer_norm_eps)
        self.norm1 = _layer_norm(dim, config.layer_norm_eps)
        self.wqkv = _linear(dim, 3 * dim)
        self.wo = _linear(dim, dim)
        self.mlp = KimiVisionMLP(dim, config.intermediate_size)

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, seq_lens: list[int]) -> Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q = apply_rope_interleaved(q, cos, sin)
        k = apply_rope_interleaved(k, cos, sin)
        outputs = []
        # Each image (or video clip) attends only to itself.
        for q_i, k_i, v_i in zip(q.split(seq_lens), k.split(seq_lens), v.split(seq_lens)):
            o = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q_i, k_i, v_i)))
            outputs.append(o.squeeze(0).transpose(0, 1))
        return self.wo(torch.cat(outputs).reshape(n, -1))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, seq_lens: list[int]) -> Tensor:
        x = x + self.attention(self.norm0(x), cos, sin, seq_lens)
        return x + self.mlp(self.norm1(x))


class KimiVisionEncoder(nn.Module):
    def __init__(self, config: KimiVisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(KimiVisionBlock(config) for _ in range(config.num_hidden_layers))
        self.final_layernorm = _layer_norm(config.hidden_size, config.layer_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, seq_lens: list[int]) -> Tensor:
        for block in self.blocks:
            x = block(x, cos, sin, seq_lens)
        return self.final_layernorm(x)


class KimiVisionTower(nn.Module):
    def __init__(self, config: KimiVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = KimiPatchEmbed(config)
        self.encoder = KimiVisionEncoder(config)

    def rope_cos_sin(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[Tensor, Tensor]:
        """Per-patch angles [N, hd/2]: pair 2i by column * f_i, pair 2i+1 by row * f_i."""
        positions = []
        for t, h, w in grids:
            rows = torch.arange(h, device=device).repeat_interleave(w)
            cols = torch.arange(w, device=device).repeat(h)
            positions.append(torch.stack((cols, rows), dim=-1).repeat(t, 1))
        pos = torch.cat(positions).float()  # [N, 2] as (col, row)
        hd = self.config.head_dim
        # Computed here in float32 rather than kept as a buffer that .to(bfloat16) would round.
        exponents = torch.arange(hd // 4, dtype=torch.float32, device=device) * 4 / hd
        inv_freq = 1.0 / (self.config.rope_theta**exponents)
        angles = (pos[:, None, :] * inv_freq[:, None]).flatten(1)  # [N, hd/4, 2] -> [N, hd/2]
        return angles.cos(), angles.sin()

    def check_inputs(self, pixel_values: Tensor, grid_thws: Tensor) -> list[tuple[int, int, int]]:
        p = self.config.patch_size
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise InvalidRequestError(f"pixel_values must be [N, 3, {p}, {p}], got {list(pixel_values.shape)}")
        if grid_thws.ndim != 2 or grid_thws.shape[1] != 3 or grid_thws.shape[0] == 0:
            raise InvalidRequestError(f"grid_thws must be [n_images, 3], got {list(grid_thws.shape)}")
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thws.tolist()]
        kh, kw = self.config.merge_kernel_size
        for t, h, w in grids:
            if t <= 0 or h <= 0 or w <= 0 or h % kh or w % kw:
                raise InvalidRequestError(f"grid (t={t}, h={h}, w={w}) is not a positive multiple of the merge kernel")
        total = sum(t * h * w for t, h, w in grids)
        if total != pixel_values.shape[0]:
            raise InvalidRequestError(
                f"grid_thws describe {total} patches but pixel_values has {pixel_values.shape[0]}"
            )
        return grids

    def merge(self, x: Tensor, grids: list[tuple[int, int, int]]) -> Tensor:
        """[sum t*h*w, D] -> [sum (h/kh)*(w/kw), kh*kw, D], averaging over frames."""
        kh, kw = self.config.merge_kernel_size
        merged = []
        for x_i, (t, h, w) in zip(x.split([t * h * w for t, h, w in grids]), grids):
            blocks = x_i.view(t, h // kh, kh, w // kw, kw, -1).permute(0, 1, 3, 2, 4, 5)
            merged.append(blocks.float().mean(0).reshape((h // kh) * (w // kw), kh * kw, -1).to(x.dtype))
        return torch.cat(merged)

    def forward(self, pixel_values: Tensor, grid_thws: Tensor) -> Tensor:
        grids = self.check_inputs(pixel_values, grid_thws)
        weight = self.patch_embed.proj.weight
        x = self.patch_embed(pixel_values.to(device=weight.device, dtype=weight.dtype), grids)
        cos, sin = self.rope_cos_sin(grids, x.device)
        x = self.encoder(x, cos, sin, [t * h * w for t, h, w in grids])
        return self.merge(x, grids)


class KimiProjector(nn.Module):
    """LayerNorm each sub-patch, concatenate the merge block, then Linear -> GELU -> Linear."""

    def __init__(self, config: KimiVisionConfig) -> None:
        super().__init__()
        merged = config.merged_hidden_size
        self.pre_norm = _layer_norm(config.hidden_size, config.projector_ln_eps)
        self.proj = nn.Sequential(_linear(merged, merged), nn.GELU(), _linear(merged, config.text_hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.pre_norm(x).flatten(1))
