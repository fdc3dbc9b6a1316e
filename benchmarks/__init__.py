"""The benchmark suite of remat_fn: ``python -m benchmarks [--quick] [--only ...]``.

One harness (:mod:`benchmarks.harness`: timer, spread, fresh-process memory,
the table of variants), shared models (:mod:`benchmarks.models` and the demo's
GPT), and one module per group of sections.  Nothing is asserted: timings on a
shared machine are noisy; the ratios with their spread are what to read.
"""
