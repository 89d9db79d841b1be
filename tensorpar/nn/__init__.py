"""Modules: drop-in data-parallel wrapper (and, later, model-parallel layers)."""

from tensorpar.nn.data_parallel import DataParallel

__all__ = ["DataParallel"]
