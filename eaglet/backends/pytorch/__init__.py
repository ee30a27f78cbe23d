"""The PyTorch backend: every op in PyTorch, on any device, under autograd too."""
