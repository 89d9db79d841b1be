"""Pixel shuffle and unshuffle over a split domain (depth-to-space, space-to-depth).

``pixel_shuffle(x, r)`` turns each pixel's ``r * r`` channel groups into an ``r x r`` block
of output pixels; ``pixel_unshuffle`` does the reverse. Both act on the last two dims only.
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


def pixel_shuffle(ctx: DomainContext, x: torch.Tensor, r: int, *, up: bool) -> torch.Tensor:
    """``F.pixel_shuffle(x, r)`` (``up``) or ``F.pixel_unshuffle(x, r)`` of the tiles.

    Raises:
        ValueError: a split dim that is not one of the last two, or (unshuffle) a domain
            length ``r`` does not divide; on every rank alike.
    """
    name = "pixel_shuffle" if up else "pixel_unshuffle"
    where = f"{name} (domain-parallel)"
    if x.dim() < 3:
        raise ValueError(f"{where}: expects at least 3 dims, got a tile of shape "
                         f"{tuple(x.shape)}")
    js = spatial_index(ctx, x, 2, where)  # (a split dim outside H, W would be the channels')
    # what torch checks, checked on every rank alike (an empty tile would not raise)
    if up and x.shape[-3] % (r * r):
        raise ValueError(f"{where}: {x.shape[-3]} channels are not divisible by the upscale "
                         f"factor squared, {r * r}")
    for j in range(2):
        if not up and j not in js and x.shape[x.dim() - 2 + j] % r:
            raise ValueError(f"{where}: dim {j - 2} has {x.shape[x.dim() - 2 + j]} rows, not "
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
        y = F.pixel_shuffle(x, r) if up else F.pixel_unshuffle(x, r)
    else:  # (torch returns an empty input's shape unchanged: the right one, still joined)
        c, h, w = x.shape[-3:]
        shape = (c // (r * r), h * r, w * r) if up else (c * r * r, h // r, w // r)
        y = x.reshape(*x.shape[:-3], *shape)
    for d, start, length in crops:
        if start or y.shape[d] != length:
            y = y.narrow(y.dim() + d, start, length)
    return y
