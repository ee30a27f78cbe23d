"""Tensor and expert parallelism: the rank group, its collectives (shared memory on one machine,
gloo across machines), and binding each rank to its cores and NUMA node."""
