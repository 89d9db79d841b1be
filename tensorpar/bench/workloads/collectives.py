"""Symmetric collectives: tensorpar next to the raw ``torch.distributed`` call on the same bytes.

Equal chunks: ``all_gather``, ``reduce_scatter``, ``all_reduce`` (out of place and in place) and
``all_to_all``, each against the raw call allocating its output (as tensorpar does) and against
the raw call into a preallocated output. Uneven chunks: ``all_to_all`` against three ways of
doing it by hand: the backend's own uneven ``all_to_all_single`` (what tensorpar's dim-0
exchange with ``sizes`` calls), padding every chunk to the largest, and point-to-point sends
(what tensorpar does on gloo for its other uneven exchanges).

Each equal-chunk call is also timed with validation mode on (`tensorpar.validation`): the
"validation" rows give its cost, on over off, call by call as above and over blocks of up
to ``_BLOCK`` calls in a row (five blocks of each, between barriers, off and on in turn,
the slowest rank's time), as a loop that leaves validation on would see it.

Every payload is a 1-D float32 tensor, so the split/concat dim is the only one and no reshaping
copy is ever needed. ``nbytes`` is the size of the tensor each rank passes in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorpar.collectives.functional import all_gather, all_reduce, all_to_all, reduce_scatter
from tensorpar.validation import validation

__all__ = ["native_all_to_all", "padded_all_to_all", "p2p_all_to_all", "run_rank",
           "uneven_splits"]

_BLOCK = 20
"""Calls per block in the validation loop timing (fewer for slow calls)."""
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def uneven_splits(numel: int, world: int) -> list[int]:
    """Split lengths sending about twice as much to rank 0 as to every other rank."""
    unit = numel // (world + 1)
    return [numel - unit * (world - 1)] + [unit] * (world - 1)


def native_all_to_all(x: torch.Tensor, splits: Sequence[int]) -> torch.Tensor:
    """Uneven 1-D all-to-all as the backend's own: ``all_to_all_single`` with split lists.

    ``splits`` (one length per destination) must be the same on every rank.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    out = x.new_empty(world * splits[rank])
    dist.all_to_all_single(out, x, [splits[rank]] * world, list(splits))
    return out


def padded_all_to_all(x: torch.Tensor, splits: Sequence[int]) -> torch.Tensor:
    """Uneven 1-D all-to-all as an equal one: pad every chunk to the largest, then slice.

    ``splits`` (one length per destination) must be the same on every rank.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    width = max(splits)
    send = x.new_empty((world, width))  # the padding is sent but never read
    for r, part in enumerate(x.split(list(splits))):
        send[r, : part.numel()].copy_(part)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv[:, : splits[rank]].reshape(-1)


def p2p_all_to_all(x: torch.Tensor, splits: Sequence[int]) -> torch.Tensor:
    """Uneven 1-D all-to-all as one isend/irecv per peer plus a local copy for this rank.

    ``splits`` (one length per destination) must be the same on every rank.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    n = splits[rank]  # every source sends this rank the same length
    out = x.new_empty(world * n)
    parts = x.split(list(splits))
    ops = []
    for peer in range(world):
        if peer != rank:
            ops.append(dist.P2POp(dist.isend, parts[peer], peer))
            ops.append(dist.P2POp(dist.irecv, out[peer * n: (peer + 1) * n], peer))
    works = dist.batch_isend_irecv(ops)
    out[rank * n: (rank + 1) * n].copy_(parts[rank])  # overlaps the transfers
    for work in works:
        work.wait()
    return out


def _repeat(call: Callable[[], object], times: int) -> Callable[[], object]:
    def run() -> None:
        for _ in range(times):
            call()
    return run


def _validated(call: Callable[[], object]) -> Callable[[], object]:
    """``call`` with validation mode on (every rank switches alike, around each call)."""
    def run() -> object:
        with validation(True):
            return call()
    return run


def _check(name: str, *outputs: object) -> None:
    """Assert that every output equals the first, bit for bit (run once, before timing)."""
    first = outputs[0]
    assert isinstance(first, torch.Tensor)
    for i, other in enumerate(outputs[1:], 1):
        assert isinstance(other, torch.Tensor)
        assert torch.equal(first, other), \
            f"rank {dist.get_rank()}: {name}: output {i} differs from output 0"


def run_rank(nbytes: int, rounds: int, budget_s: float = 1.5) -> list[dict[str, Any]]:
    """One rank's part: every case at ``nbytes`` (rounded down to a multiple of 4 * world).

    Each case runs back to back, ``calls`` times (as many calls of the raw case as fit in
    ``budget_s`` seconds, at least ``rounds``), interleaved call by call with the others.
    Returns one dict per table row, the same on every rank. Rows with
    ``table="collectives"`` carry ``raw``, ``raw_prealloc`` and ``tensorpar`` median seconds
    per call, and ``noise``: the raw call timed a second time as its own case, over the first
    (how far apart two identical cases land in this run; out-of-place rows only), and the
    same two ratios paired call by call (``paired_ratio``, ``paired_noise``: the median over
    turns of the ratio of two calls made in the same turn). Rows with
    ``table="validation"`` carry ``off``, ``on``, their ``ratio`` and ``paired_ratio``, and the
    loop timings. Rows with ``table="uneven_all_to_all"`` carry ``tensorpar``, ``padded`` and
    ``p2p``.
    """
    from tensorpar.bench.workloads._timing import (
        back_to_back_samples,
        calls_within,
        paired_ratio,
        time_side_by_side,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    numel = nbytes // 4 // world * world
    chunk = numel // world
    even = [chunk] * world  # reduce_scatter / all_to_all: x split into equal chunks
    whole = [numel] * world  # all_gather: every rank's chunk is all of its x
    torch.manual_seed(rank)
    x = torch.randn(numel)
    # preallocated outputs for the raw "prealloc" variants
    gathered = torch.empty(world * numel)
    scattered = torch.empty(chunk)
    reduced = torch.empty(numel)
    exchanged = torch.empty(numel)
    # in-place all-reduce targets: zeros stay zeros however often they are summed
    raw_inplace, tp_inplace = torch.zeros(numel), torch.zeros(numel)

    def raw_all_gather() -> torch.Tensor:
        out = torch.empty(world * numel)
        _all_gather_flat(out, x)
        return out

    def raw_reduce_scatter() -> torch.Tensor:
        out = torch.empty(chunk)
        _reduce_scatter_flat(out, x)
        return out

    def raw_all_reduce() -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out

    def raw_all_reduce_prealloc() -> torch.Tensor:
        reduced.copy_(x)
        dist.all_reduce(reduced)
        return reduced

    def raw_all_to_all() -> torch.Tensor:
        out = torch.empty(numel)
        dist.all_to_all_single(out, x)
        return out

    groups: dict[str, dict[str, Callable[[], object]]] = {
        "all_gather": {
            "raw": raw_all_gather,
            "raw_prealloc": lambda: _all_gather_flat(gathered, x),
            "tensorpar": lambda: all_gather(x, sizes=whole),
            "tensorpar_exchange": lambda: all_gather(x),
        },
        "reduce_scatter": {
            "raw": raw_reduce_scatter,
            "raw_prealloc": lambda: _reduce_scatter_flat(scattered, x),
            "tensorpar": lambda: reduce_scatter(x),
        },
        "all_reduce": {
            "raw": raw_all_reduce,
            "raw_prealloc": raw_all_reduce_prealloc,
            "tensorpar": lambda: all_reduce(x),
            "raw_inplace": lambda: dist.all_reduce(raw_inplace),
            "tensorpar_inplace": lambda: all_reduce(tp_inplace, inplace=True),
        },
        "all_to_all": {
            "raw": raw_all_to_all,
            "raw_prealloc": lambda: dist.all_to_all_single(exchanged, x),
            "tensorpar": lambda: all_to_all(x, split_dim=0, concat_dim=0, sizes=even),
        },
    }
    for cases in groups.values():  # the same call with validation mode on
        cases["tensorpar_validated"] = _validated(cases["tensorpar"])
    _check("all_gather", raw_all_gather(), groups["all_gather"]["tensorpar"](),
           groups["all_gather"]["tensorpar_exchange"]())
    _check("reduce_scatter", raw_reduce_scatter(), groups["reduce_scatter"]["tensorpar"]())
    _check("all_reduce", raw_all_reduce(), groups["all_reduce"]["tensorpar"]())
    _check("all_to_all", raw_all_to_all(), groups["all_to_all"]["tensorpar"]())

    rows: list[dict[str, Any]] = []

    def row(collective: str, t: dict[str, float], ours: str, raw: str = "raw",
            prealloc: str | None = "raw_prealloc") -> None:
        rows.append({"table": "collectives", "collective": collective, "world_size": world,
                     "nbytes": numel * 4, "calls": calls, "raw": t[raw],
                     "raw_prealloc": None if prealloc is None else t[prealloc],
                     "tensorpar": t[ours], "ratio": t[ours] / t[raw],
                     "ratio_prealloc": None if prealloc is None else t[ours] / t[prealloc],
                     "noise": t["raw_again"] / t["raw"] if raw == "raw" else None,
                     "paired_ratio": paired_ratio(samples, ours, raw),
                     "paired_noise": paired_ratio(samples, "raw_again", "raw")
                     if raw == "raw" else None})

    for name, cases in groups.items():
        # "raw_again" is the raw call timed as a second case: raw_again/raw shows the noise
        calls = calls_within(budget_s, cases["raw"], minimum=rounds)
        samples = back_to_back_samples({**cases, "raw_again": cases["raw"]}, calls=calls)
        t = {case: times.median().item() for case, times in samples.items()}
        row(name, t, "tensorpar")
        # and as a loop of calls would see it: blocks of calls, off and on in turn (up to
        # _BLOCK calls a block, as many as fit in a fifth of the budget)
        block = max(1, min(_BLOCK, int(budget_s / 5 / max(t["tensorpar"], 1e-9))))
        loop = time_side_by_side({"off": _repeat(cases["tensorpar"], block),
                                  "on": _repeat(cases["tensorpar_validated"], block)},
                                 rounds=5, warmup=1)
        rows.append({"table": "validation", "collective": name, "world_size": world,
                     "nbytes": numel * 4, "calls": calls, "off": t["tensorpar"],
                     "on": t["tensorpar_validated"],
                     "ratio": t["tensorpar_validated"] / t["tensorpar"],
                     "paired_ratio": paired_ratio(samples, "tensorpar_validated", "tensorpar"),
                     "loop_off": loop["off"] / block, "loop_on": loop["on"] / block,
                     "loop_ratio": loop["on"] / loop["off"]})
        if name == "all_gather":
            row("all_gather (exchange sizes)", t, "tensorpar_exchange")
        if name == "all_reduce":
            row("all_reduce (in place)", t, "tensorpar_inplace", raw="raw_inplace",
                prealloc=None)

    splits = uneven_splits(numel, world)
    strategies: dict[str, Callable[[], object]] = {
        "tensorpar": lambda: all_to_all(x, split_dim=0, concat_dim=0, sizes=splits),
        "native": lambda: native_all_to_all(x, splits),
        "padded": lambda: padded_all_to_all(x, splits),
        "p2p": lambda: p2p_all_to_all(x, splits),
    }
    _check("uneven all_to_all", *(fn() for fn in strategies.values()))
    calls = calls_within(budget_s, strategies["tensorpar"], minimum=rounds)
    samples = back_to_back_samples(strategies, calls=calls)
    t = {case: times.median().item() for case, times in samples.items()}
    rows.append({"table": "uneven_all_to_all", "world_size": world, "nbytes": numel * 4,
                 "calls": calls, "splits": splits, "padded_nbytes": world * max(splits) * 4, **t,
                 **{f"{case}_over_native": paired_ratio(samples, case, "native")  # (paired)
                    for case in ("tensorpar", "padded", "p2p")}})
    return rows
