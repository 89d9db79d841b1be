"""Pixel shuffle and unshuffle over a split domain (depth-to-space, space-to-depth).

``pixel_shuffle(x, r)`` turns each pixel's ``r * r`` channel groups into an ``r x r`` block
of output pixels; ``pixel_unshuffle`` does the reverse. Both act on the last two dims only
(MONAI's ``SubpixelUpsample`` shuffles the last 1, 2 or 3 dims the same way).
Output row ``o`` of a shuffle comes from input row ``o // r``; output row ``o`` of an
unshuffle from input rows ``[o * r, o * r + r)``. Each rank fetches the input rows its output
rows come from (a block that straddles two tiles needs rows from both), runs the dense
operation on them and keeps its own rows: any tile sizes, including rows the factor does
not divide, a 1-row tile and an empty one.

The output's split follows the usual rule (`tensorpar.domain._tiles.layout`): the split this
forward recorded for that length, else each output row goes to the rank that owns the first
input row it comes from (a shuffle multiplies every tile by ``r``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tensorpar.domain._layers.window import spatial_index
from tensorpar.domain._tiles.layout import DomainContext, anchor_sizes
from tensorpar.domain._tiles.rows import gather_rows, offsets

__all__ = ["pixel_shuffle", "shuffle_forward"]


def shuffle_forward(module: Any, ctx: DomainContext, x: torch.Tensor) -> torch.Tensor:
    """``nn.PixelShuffle`` / ``nn.PixelUnshuffle`` on this rank's tile."""
    if ctx.dense:
        return type(module).forward(module, x)  # type: ignore[no-any-return]
    if isinstance(module, torch.nn.PixelShuffle):
        return pixel_shuffle(ctx, x, module.upscale_factor, up=True)
    return pixel_shuffle(ctx, x, module.downscale_factor, up=False)


def pixel_shuffle(ctx: DomainContext, x: torch.Tensor, r: int, *, up: bool, k: int = 2,
                  local: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``F.pixel_shuffle(x, r)`` (``up``) or ``F.pixel_unshuffle(x, r)`` of the tiles.

    ``k``, ``local``: a shuffle over the last ``k`` dims, the same channel order, done on
    the fetched rows by ``local`` (MONAI's N-dimensional ``pixelshuffle``).

    Raises:
        ValueError: a split dim that is not one of the last ``k``, a shape torch refuses
            (channels, or an unsplit dim, the factor does not divide), or (unshuffle) a
            domain length ``r`` does not divide; on every rank alike.
    """
    name = "pixel_shuffle" if up else "pixel_unshuffle"
    where = f"{name} (domain-parallel)"
    if x.dim() < k + 1:
        raise ValueError(f"{where}: expects at least {k + 1} dims, got a tile of shape "
                         f"{tuple(x.shape)}")
    js = spatial_index(ctx, x, k, where)  # (a split dim outside them would be the channels')
    # what torch checks, checked on every rank alike (an empty tile would not raise)
    if up and x.shape[-k - 1] % r**k:
        raise ValueError(f"{where}: {x.shape[-k - 1]} channels are not divisible by the "
                         f"upscale factor to the power {k}, {r**k}")
    for j in range(k):
        if not up and j not in js and x.shape[x.dim() - k + j] % r:
            raise ValueError(f"{where}: dim {j - k} has {x.shape[x.dim() - k + j]} rows, not "
                             f"divisible by the downscale factor {r}")
    crops = []
    for i, d in enumerate(ctx.dims):
        sizes_in = ctx.sizes_of(i, x.shape[d], where, x.device)
        n = sum(sizes_in)
        if not up and n % r:
            raise ValueError(f"{where}: the domain's {n} rows along dim {d} are not divisible "
                             f"by the downscale factor {r} (dense raises too)")
        m = n * r if up else n // r

        def natural(sizes_in: tuple[int, ...] = sizes_in, m: int = m) -> tuple[int, ...]:
            if up:
                return tuple(s * r for s in sizes_in)
            return anchor_sizes(sizes_in, m, lambda b: -(-b // r))
        sizes_out = ctx.out_sizes(i, m, natural)
        oo, oi = offsets(sizes_out), offsets(sizes_in)
        if up:  # output rows [a, b) come from input rows [a // r, ceil(b / r))
            spans = [(oo[q] // r, -(-oo[q + 1] // r)) for q in range(len(sizes_in))]
        else:
            spans = [(oo[q] * r, oo[q + 1] * r) for q in range(len(sizes_in))]
        wants = [span if sizes_out[q] else (oi[q], oi[q]) for q, span in enumerate(spans)]
        g = ctx.groups[i]
        x = gather_rows(x, x.dim() + d, ctx.plan(sizes_in, wants, g.rank, "zeros"), g, 0.0)
        # (a shuffle's fetched rows give whole blocks: keep this rank's rows of them)
        start = oo[g.rank] - wants[g.rank][0] * r if up and sizes_out[g.rank] else 0
        crops.append((d, start, sizes_out[g.rank]))
    if x.numel():
        y = local(x) if local is not None else \
            F.pixel_shuffle(x, r) if up else F.pixel_unshuffle(x, r)
    else:  # (torch would return an empty input's shape unchanged: the output's, joined)
        c, points = x.shape[-k - 1], x.shape[-k:]
        shape = (c // r**k, *(n * r for n in points)) if up else \
            (c * r**k, *(n // r for n in points))
        y = x.reshape(*x.shape[:-k - 1], *shape)
    for d, start, length in crops:
        if start or y.shape[d] != length:
            y = y.narrow(y.dim() + d, start, length)
    return y
