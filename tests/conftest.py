import pytest
import torch

from eaglet import kernels
from eaglet.backends import Backend, cpu_backend, torch_backend

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _deterministic_seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=["cpu", "pytorch"])
def backend(request) -> Backend:
    """Each backend in turn, through the same interfaces (the C++ one where it builds here)."""
    if request.param == "pytorch":
        return torch_backend()
    if not kernels.available():
        pytest.skip(f"eaglet CPU kernels unavailable: {kernels.unavailable_reason()}")
    return cpu_backend()
