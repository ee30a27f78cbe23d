"""The CPU backend: eaglet's C++ kernels (``eaglet.kernels``), with the PyTorch ops for inputs a
kernel does not take."""
