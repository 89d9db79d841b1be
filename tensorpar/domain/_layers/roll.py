"""``torch.roll`` along a split dim: each tile takes its rows of the rolled domain.

Rolled by ``s`` rows along a split dim, the domain's row ``g`` holds what row ``g - s``
held, wrapped round the domain. So rank ``p``, which owns rows ``[start_p, end_p)``, takes
rows ``[start_p - s, end_p - s)`` modulo the domain's length: some of its own and the rest
from the tiles that hold them, in one row gather (a circular boundary's); every tile keeps
its size, and the backward sends each row's gradient back to its owner. A periodic finite
difference (``u.roll(1, -2) - 2 * u + u.roll(-1, -2)``) and Swin's shifted windows are
such rolls. The shifts along split dims are agreed by the ranks (one small all-reduce): a
shift read from the tile's own size is refused. Dims that are not split roll as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tensorpar.comm._comm import exchange_ints
from tensorpar.domain._tiles.agree import agreed_values
from tensorpar.domain._tiles.layout import DomainContext
from tensorpar.domain._tiles.rows import gather_rows, offsets

__all__ = ["roll"]


def roll(ctx: DomainContext, x: torch.Tensor, shifts: int | Sequence[int],
         dims: int | Sequence[int], split_at: Mapping[int, int], image: bool = True
         ) -> torch.Tensor:
    """``torch.roll(x, shifts, dims)`` of this rank's tile: its tile of the dense result.

    ``split_at``: the dims of ``x`` that hold a split dim's points, each with its index in
    ``ctx.dims``, each dim's elements in the domain's order (the split dims of an
    image-shaped tile; or the one dim of a strip's reshaped tile whose points are its
    outermost part: tokens, windows). ``image``: they are the split dims themselves, so
    the tiles' sizes are this forward's split; otherwise the ranks exchange them.
    """
    where = "roll (domain-parallel)"
    shifts = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if len(shifts) != len(dims):
        raise ValueError(f"{where}: shifts {shifts} and dims {dims} differ in length")
    along = [0] * len(ctx.dims)  # the shift along each split dim
    rest_shifts, rest_dims = [], []
    for s, d in zip(shifts, dims, strict=True):
        d = d % max(x.dim(), 1)
        if d in split_at:
            along[split_at[d]] += int(s)
        else:
            rest_shifts.append(int(s))
            rest_dims.append(d)
    agreed = agreed_values(ctx, None if x.numel() == 0 else [float(s) for s in along],
                           len(along), x.device)
    if agreed is None:
        raise ValueError(
            f"{where}: the ranks roll the split dims by different amounts ({tuple(along)} on "
            f"this rank); a shift computed from the tile's shape sees the tile's size, not "
            f"the domain's")
    at = {i: d for d, i in split_at.items()}
    for i, agreed_shift in enumerate(agreed):
        d, g = at[i], ctx.groups[i]
        sizes = ctx.sizes_of(i, x.shape[d], where, x.device) if image else \
            tuple(r[0] for r in exchange_ints(g, [x.shape[d]], x.device))
        n = sum(sizes)
        if not n or not int(agreed_shift) % n:
            continue
        shift = int(agreed_shift) % n
        starts = offsets(sizes)
        wants = [(starts[p] - shift, starts[p + 1] - shift) for p in range(len(sizes))]
        x = gather_rows(x, d, ctx.plan(sizes, wants, g.rank, "circular"), g, 0.0)
    return torch.roll(x, rest_shifts, rest_dims) if rest_dims else x
