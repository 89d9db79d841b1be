"""Data parallelism.

The bucketed in-place gradient all-reduce, its end-of-backward sync, comm hooks, and the DDP-
style wrapper with join.
"""
