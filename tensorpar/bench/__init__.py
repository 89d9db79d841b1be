"""Benchmark suites, run as ``python -m tensorpar.bench SUITE [options]``.

Every suite times tensorpar next to its competitor in the same run, interleaving the two,
and reports ratios: on a shared, noisy machine a ratio measured side by side means far
more than an absolute time.
"""
