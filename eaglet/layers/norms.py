import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, weight applied in the input dtype (as DeepSeek-V3 does)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps
        self.fused = False  # torch.ops.eaglet.rms_norm (eaglet.kernels.use_cpu_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dtype == self.weight.dtype and not torch.is_grad_enabled():
            return torch.ops.eaglet.rms_norm(x, self.weight, self.eps)
        # F.rms_norm without a weight is x * rsqrt(mean(x^2) + eps) in float32, bit for bit
        # (tests/test_layer_fast_paths.py), in one op instead of five.
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)
