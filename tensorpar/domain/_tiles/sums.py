"""Sums and counts over the whole domain: every rank's tile taken together."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tensorpar.collectives.functional import all_reduce
from tensorpar.domain._tiles.agree import all_reduced
from tensorpar.domain._tiles.layout import DomainContext

__all__ = ["global_count", "over_domain", "sum_over_domain"]


def sum_over_domain(ctx: DomainContext, t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over every rank of the domain (backward: the gradients summed too)."""
    for g in ctx.groups:
        if not g.is_single:
            t = all_reduce(t, backward="sum", group=g)
    return t


def global_count(ctx: DomainContext, x: torch.Tensor, dims: Sequence[int], where: str) -> int:
    """The domain's number of points of ``x`` (the image's dims) over ``dims``."""
    count = 1
    split = {x.dim() + d: i for i, d in enumerate(ctx.dims)}
    for dim in dims:
        i = split.get(dim)
        count *= x.shape[dim] if i is None else sum(
            ctx.sizes_of(i, x.shape[dim], where, x.device))
    return count


def over_domain(ctx: DomainContext, x: torch.Tensor, dims: Sequence[int], name: str, *,
                mean: bool = True, image: bool = True, keepdim: bool = True,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """The sum (or mean) of the tiles over ``dims`` (every dim holding points among them).

    Replicated (every rank holds it whole); counts as a global pooling of the forward.
    ``image``: ``x`` has the image's dims, whose split sizes this forward recorded;
    otherwise the count is the ranks' counts added up (one small all-reduce).
    """
    dims = sorted({d % x.dim() for d in dims})
    total = x.sum(dims, keepdim=keepdim, dtype=dtype)
    for g in ctx.groups:
        if not g.is_single:
            total = all_reduce(total, backward="identity", group=g)
    ctx.poolings += 1
    if not mean:
        return total
    if image:
        count = global_count(ctx, x, dims, f"{name} (domain-parallel)")
    else:  # (the ranks' counts added up)
        mine = math.prod(x.shape[d] for d in dims)
        count = int(all_reduced(ctx, [float(mine)], "sum", total.device)[0])
    return total / count
