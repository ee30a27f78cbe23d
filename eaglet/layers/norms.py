import torch
from torch import nn

from eaglet.backends.base import LayerOps


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, weight applied in the input dtype (as DeepSeek-V3 does), by the
    backend's ``rms_norm``."""

    def __init__(self, hidden_size: int, eps: float, ops: LayerOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)
