"""Scatter + gather of one tensor: tensorpar vs a raw ``dist.scatter`` + ``dist.gather``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tensorpar.collectives.functional import gather, scatter
from tensorpar.placeholder import TensorPlaceholder


def run_rank(nbytes: int, rounds: int) -> dict[str, Any]:
    """One rank's part: float32 tensor of ``nbytes`` scattered from 0 and gathered back."""
    from tensorpar.bench.workloads._timing import equal_on_every_rank, time_side_by_side

    rank, world = dist.get_rank(), dist.get_world_size()
    numel = nbytes // 4
    full = torch.randn(numel) if rank == 0 else None
    placeholder = TensorPlaceholder((numel,), torch.float32, owner=0)
    source = full if rank == 0 else placeholder
    chunk_numel = numel // world
    raw_out = torch.empty(chunk_numel)
    raw_gathered = torch.empty(numel) if rank == 0 else None

    def raw() -> None:
        chunks = list(full.split(chunk_numel)) if full is not None else None
        dist.scatter(raw_out, chunks, src=0)
        rows = list(raw_gathered.split(chunk_numel)) if raw_gathered is not None else None
        dist.gather(raw_out, rows, dst=0)

    def raw_alloc() -> None:  # the same calls, allocating outputs as an out-of-place API must
        chunks = list(full.split(chunk_numel)) if full is not None else None
        out = torch.empty(chunk_numel)
        dist.scatter(out, chunks, src=0)
        gathered = torch.empty(numel) if rank == 0 else None
        dist.gather(out, list(gathered.split(chunk_numel)) if gathered is not None else None,
                    dst=0)

    def ours(exchange_meta: bool) -> Any:
        chunk = scatter(source, exchange_meta=exchange_meta)
        return gather(chunk, sizes=[chunk_numel] * world if not exchange_meta else None)

    for exchange_meta in (True, False):  # the same result as the raw calls' before timing
        back = ours(exchange_meta)
        raw()
        whole = full[:chunk_numel * world] if full is not None else None  # (rank 0's)
        equal_on_every_rank(back if whole is not None else None, whole, "tensorpar's gather")
        equal_on_every_rank(raw_gathered, whole, "the raw gather")
    times = time_side_by_side({
        "raw": raw,
        "raw_alloc": raw_alloc,
        "tensorpar": lambda: ours(True),
        "tensorpar_known_meta": lambda: ours(False),
    }, rounds=rounds, rotate=True, pairs=(("tensorpar", "raw"), ("tensorpar", "raw_alloc"),
                                          ("tensorpar_known_meta", "raw_alloc")))
    return {"world_size": world, "nbytes": nbytes, **times}
