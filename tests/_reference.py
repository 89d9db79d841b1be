"""Cases for the collective tests: each one runs a collective and its single-process reference.

A case describes, for rank ``r`` of a group of ``p`` ranks:

- ``make(r, p)``: the rank's input (a float64 tensor, or None on ranks without data);
- ``run(x, group)``: the distributed call;
- ``ref(xs, p)``: every rank's expected output computed in one process from every rank's
  input (None where the rank gets a placeholder);
- ``loss``: ``"summed"`` (each rank's loss counts; the total is their sum) or
  ``"replicated"`` (every rank holds the same loss, counted once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import tensorpar as tp


def data(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def weights(rank: int, shape: torch.Size) -> torch.Tensor:
    return data(1000 + rank, *shape)


@dataclass(frozen=True)
class Case:
    make: Callable[[int, int], torch.Tensor | None]
    run: Callable[[torch.Tensor | None, object], object]
    ref: Callable[[list, int], list]
    loss: str = "summed"
    replicated_input: bool = False


def _split(x: torch.Tensor, p: int, dim: int) -> list[torch.Tensor]:
    return list(torch.tensor_split(x, p, dim))


def _root(p: int) -> int:
    return p - 1  # the last rank: catches code that assumes rank 0


CASES: dict[str, Case] = {
    "scatter": Case(
        make=lambda r, p: data(7, 5, 7) if r == _root(p) else None,
        run=lambda x, g: tp.scatter(x, dim=1, src=_root(_size(g)), group=g),
        ref=lambda xs, p: _split(xs[_root(p)], p, 1)),
    "gather": Case(
        make=lambda r, p: data(r, r + 1, 3),
        run=lambda x, g: tp.gather(x, dim=0, dst=_root(_size(g)), group=g),
        ref=lambda xs, p: [torch.cat(xs, 0) if r == _root(p) else None for r in range(p)]),
    "all_gather": Case(
        make=lambda r, p: data(r, 3, r + 2),
        run=lambda x, g: tp.all_gather(x, dim=1, group=g),
        ref=lambda xs, p: [torch.cat(xs, 1)] * p),
    "all_gather_sizes": Case(
        make=lambda r, p: data(r, r + 1, 2),
        run=lambda x, g: tp.all_gather(x, dim=0, group=g, sizes=list(range(1, _size(g) + 1))),
        ref=lambda xs, p: [torch.cat(xs, 0)] * p),
    "reduce_scatter": Case(
        make=lambda r, p: data(r, 7, 2),
        run=lambda x, g: tp.reduce_scatter(x, dim=0, group=g),
        ref=lambda xs, p: _split(sum(xs), p, 0)),
    "reduce_scatter_mean_dim1": Case(
        make=lambda r, p: data(r, 2, 7),
        run=lambda x, g: tp.reduce_scatter(x, dim=1, op="mean", group=g),
        ref=lambda xs, p: _split(sum(xs) / p, p, 1)),
    "all_reduce_sum": Case(
        make=lambda r, p: data(r, 4, 3),
        run=lambda x, g: tp.all_reduce(x, group=g),
        ref=lambda xs, p: [sum(xs)] * p),
    "all_reduce_identity": Case(
        make=lambda r, p: data(r, 4, 3),
        run=lambda x, g: tp.all_reduce(x, backward="identity", group=g),
        ref=lambda xs, p: [sum(xs)] * p, loss="replicated"),
    "all_reduce_mean": Case(
        make=lambda r, p: data(r, 5),
        run=lambda x, g: tp.all_reduce(x, op="mean", group=g),
        ref=lambda xs, p: [sum(xs) / p] * p),
    "broadcast": Case(
        make=lambda r, p: data(3, 4, 3) if r == _root(p) else None,
        run=lambda x, g: tp.broadcast(x, src=_root(_size(g)), group=g),
        ref=lambda xs, p: [xs[_root(p)]] * p),
    "reduce": Case(
        make=lambda r, p: data(r, 4, 3),
        run=lambda x, g: tp.reduce(x, dst=_root(_size(g)), group=g),
        ref=lambda xs, p: [sum(xs) if r == _root(p) else None for r in range(p)]),
    "reduce_mean": Case(
        make=lambda r, p: data(r, 3),
        run=lambda x, g: tp.reduce(x, dst=0, op="mean", group=g),
        ref=lambda xs, p: [sum(xs) / p if r == 0 else None for r in range(p)]),
    "all_to_all": Case(  # uneven per-rank lengths along both dims
        make=lambda r, p: data(r, r + 1, 7),
        run=lambda x, g: tp.all_to_all(x, split_dim=1, concat_dim=0, group=g),
        ref=lambda xs, p: [torch.cat([_split(x, p, 1)[r] for x in xs], 0) for r in range(p)]),
    "all_to_all_0_to_1": Case(
        make=lambda r, p: data(r, 7, 2, 3),
        run=lambda x, g: tp.all_to_all(x, split_dim=0, concat_dim=1, group=g),
        ref=lambda xs, p: [torch.cat([_split(x, p, 0)[r] for x in xs], 1) for r in range(p)]),
    "all_to_all_sizes": Case(
        make=lambda r, p: data(r, 3, 7),
        run=lambda x, g: tp.all_to_all(x, split_dim=-1, concat_dim=0, group=g,
                                       sizes=_uneven(7, _size(g))),
        ref=lambda xs, p: [torch.cat([x.split(_uneven(7, p), -1)[r] for x in xs], 0)
                           for r in range(p)]),
    "copy_to_group": Case(
        make=lambda r, p: data(11, 4, 3),
        run=lambda x, g: tp.copy_to_group(x, group=g),
        ref=lambda xs, p: [xs[0]] * p, replicated_input=True),
    "reduce_from_group": Case(
        make=lambda r, p: data(r, 4, 3),
        run=lambda x, g: tp.reduce_from_group(x, group=g),
        ref=lambda xs, p: [sum(xs)] * p, loss="replicated"),
    "split_to_group": Case(
        make=lambda r, p: data(11, 3, 7),
        run=lambda x, g: tp.split_to_group(x, dim=-1, group=g),
        ref=lambda xs, p: _split(xs[0], p, -1), replicated_input=True),
    "gather_from_group": Case(
        make=lambda r, p: data(r, 3, r + 1),
        run=lambda x, g: tp.gather_from_group(x, dim=-1, group=g),
        ref=lambda xs, p: [torch.cat(xs, -1)] * p, loss="replicated"),
}


def _uneven(length: int, p: int) -> list[int]:
    """An uneven split with a zero: everything past rank 0's share goes to the last rank."""
    sizes = [0] * p
    sizes[0] = min(2, length)
    sizes[-1] += length - sizes[0]
    return sizes


def _size(group: object) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_initialized() else 1  # type: ignore[arg-type]
