"""Side-by-side timing on every rank: interleaved rounds, barrier-aligned, median of ranks' max."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["format_table", "time_side_by_side"]


def time_side_by_side(cases: dict[str, Callable[[], object]], *, rounds: int,
                      warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each case, measured in interleaved rounds.

    Each round runs every case once, in turn, between barriers; a call's time is the slowest
    rank's (an all-reduce of MAX), since a collective is only done when every rank is.
    Runs on every rank; returns the same numbers everywhere.
    """
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(warmup + rounds):
        for name, fn in cases.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                samples[name].append(elapsed.item())
    return {name: statistics.median(values) for name, values in samples.items()}


def format_table(header: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-flavoured markdown table."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
