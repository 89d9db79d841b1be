"""Side-by-side timing on every rank: interleaved cases, the slowest rank's time, medians.

`time_side_by_side` starts every call from a barrier (for calls of many milliseconds: training
steps, layer stacks). `back_to_back_samples` times short collectives as they run in real
code, one after another with no barrier in between, cases interleaved call by call;
`paired_ratio` compares two of its cases turn by turn.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["back_to_back_samples", "calls_within", "equal_on_every_rank", "format_table",
           "paired_ratio", "time_side_by_side"]


def time_side_by_side(cases: dict[str, Callable[[], object]], *, rounds: int,
                      warmup: int = 2, cpu: bool = False,
                      pairs: tuple[tuple[str, str], ...] = (), rotate: bool = False
                      ) -> dict[str, float]:
    """Median seconds per call of each case, measured in interleaved rounds.

    Each round runs every case once, in turn, between barriers; a call's time is the
    slowest rank's (an all-reduce of MAX), since a collective is only done when every rank is.
    With ``cpu=True`` the result also has ``<case>_cpu``: the median CPU time of the calling
    thread (the slowest rank's), which leaves out time spent blocked waiting for other ranks.
    For each ``(case, baseline)`` in ``pairs`` the result also has ``"case/baseline"``: the
    median over rounds of the two calls' ratio within one round (see `paired_ratio`).
    With ``rotate`` each round starts one case later (round ``i`` at case ``i mod n``), so
    no case always follows the same neighbour; without it the cases run in the given order
    (for cases that rely on it: one that zeroes what the next ones use). Runs on every rank;
    returns the same numbers everywhere.
    """
    samples: dict[str, list[float]] = {name: [] for name in cases}
    cpu_samples: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for i in range(warmup + rounds):
        first = i % len(names) if rotate else 0
        for name in names[first:] + names[:first]:
            fn = cases[name]
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            fn()
            elapsed = torch.tensor([time.perf_counter() - start, time.thread_time() - start_cpu],
                                   dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                samples[name].append(elapsed[0].item())
                cpu_samples[name].append(elapsed[1].item())
    result = {name: statistics.median(values) for name, values in samples.items()}
    if cpu:
        result |= {f"{name}_cpu": statistics.median(v) for name, v in cpu_samples.items()}
    for case, baseline in pairs:
        result[f"{case}/{baseline}"] = statistics.median(
            a / b for a, b in zip(samples[case], samples[baseline], strict=True))
    return result


def equal_on_every_rank(got: torch.Tensor | None, want: torch.Tensor | None, what: str,
                        tol: float = 1e-4) -> None:
    """Raise on every rank unless every rank's ``got`` is close to its ``want``.

    ``None`` on both: nothing to compare on this rank. Before anything is timed: a case
    that computes something else is not timed, and no rank is left waiting for one that
    raised alone.
    """
    ok = (got is None and want is None) or (
        got is not None and want is not None and got.shape == want.shape
        and torch.allclose(got, want, rtol=tol, atol=tol))
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not flag.item():
        raise RuntimeError(f"benchmark: {what} differs from what it is compared with on at "
                           f"least one rank; not timed")


def back_to_back_samples(cases: dict[str, Callable[[], object]], *, calls: int,
                         warmup: int = 3) -> dict[str, torch.Tensor]:
    """Seconds of every timed call of each case (``calls`` each), in turn order.

    The cases take turns, one call each, in an order shuffled every turn (the same shuffle
    on every rank), so no case keeps following the same neighbour. Every rank times its own
    calls; a call's time is the slowest rank's (an element-wise MAX over ranks, exchanged
    once at the end). Entry ``t`` of every case comes from the same turn, so `paired_ratio`
    can compare calls made a few milliseconds apart. Runs on every rank; returns the same
    numbers everywhere.
    """
    names = list(cases)
    n = len(names)
    durations = torch.zeros(n, calls, dtype=torch.float64)
    order = list(range(n))
    shuffle = random.Random(0).shuffle  # one seed: every rank calls in the same order
    dist.barrier()
    for turn in range(warmup + calls):
        shuffle(order)
        for i in order:
            fn = cases[names[i]]
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if turn >= warmup:
                durations[i, turn - warmup] = elapsed
    dist.all_reduce(durations, op=dist.ReduceOp.MAX)
    return {name: durations[i] for i, name in enumerate(names)}


def paired_ratio(samples: dict[str, torch.Tensor], case: str, baseline: str) -> float:
    """The median over turns of ``case``'s call time over ``baseline``'s in the same turn.

    A shared machine speeds up and slows down over seconds; two calls of one turn see the
    same machine, so their ratio drifts far less than the ratio of two medians taken over
    the whole run.
    """
    return (samples[case] / samples[baseline]).median().item()


def calls_within(budget_s: float, fn: Callable[[], object], *, minimum: int,
                 maximum: int = 400) -> int:
    """How many calls of ``fn`` fit in ``budget_s`` seconds, within [minimum, maximum].

    Times one call on every rank and agrees on the slowest, so every rank gets the same count.
    """
    fn()
    dist.barrier()
    start = time.perf_counter()
    fn()
    once = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(once, op=dist.ReduceOp.MAX)
    return max(minimum, min(maximum, int(budget_s / max(once.item(), 1e-9))))


def format_table(header: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-flavoured markdown table."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
