"""The benchmark suites' workloads: what each rank runs and times, and the timing itself.

One module per suite (`tensorpar.bench.suites` runs them over ranks and prints their
tables); `_timing` times competitors side by side in interleaved rounds.
"""
