"""``F.pad`` calls (and the constant-padding modules) over a split domain.

Constant padding along a split dim pads the domain's edges: the first tile gets the rows
before it, the last tile the rows after it, and every other tile is unchanged. The padded
tensor's split is recorded for this forward, so the layers after it find their halos; where
this forward already split as many rows another way, the rows move between neighbours to
that split (a forward records one split per length). Other dims are padded as they are.
Reflect, replicate and circular padding along a split dim would need rows of other tiles,
and a negative pad (a crop) may take rows from several tiles: both are refused with an
error naming the call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tensorpar.domain._layout import DomainContext
from tensorpar.domain._rows import gather_rows, offsets

__all__ = ["pad"]


def pad(ctx: DomainContext, x: torch.Tensor, pad: Sequence[int], mode: str = "constant",
        value: float | None = None) -> torch.Tensor:
    """``F.pad(x, pad, mode, value)`` of this rank's tile: its tile of the dense result."""
    where = f"pad(mode={mode!r}) (domain-parallel)"
    if len(pad) % 2:
        raise ValueError(f"{where}: pad has an odd number of entries: {tuple(pad)}")
    local = list(pad)
    moves = []  # (split dim index, the padded split, the recorded split) that differ
    for i, d in enumerate(ctx.dims):
        j = -1 - d  # F.pad's pairs run from the last dim
        if 2 * j + 1 >= len(pad) or not (pad[2 * j] or pad[2 * j + 1]):
            continue  # this split dim is not padded
        before, after = pad[2 * j], pad[2 * j + 1]
        if mode != "constant":
            raise ValueError(f"{where}: padding split dim {d} in mode {mode!r} needs rows of "
                             f"other tiles; only constant padding is converted along a split "
                             f"dim (pad the dense input before splitting it, or use a "
                             f"convolution's padding_mode, which is converted)")
        if before < 0 or after < 0:
            raise ValueError(f"{where}: a negative pad crops split dim {d} ({before}, {after}), "
                             f"which may take rows of several tiles; not converted")
        grown = list(ctx.sizes_of(i, x.shape[d], where, x.device))
        grown[0] += before
        grown[-1] += after
        padded = tuple(grown)
        recorded = ctx.layouts[i].setdefault(sum(padded), padded)  # this forward's split
        if recorded != padded:
            moves.append((i, padded, recorded))
        rank, last = ctx.groups[i].rank, len(padded) - 1
        local[2 * j] = before if rank == 0 else 0
        local[2 * j + 1] = after if rank == last else 0
    y = F.pad(x, local, mode=mode, value=value)
    for i, padded, recorded in moves:
        g, starts = ctx.groups[i], offsets(recorded)
        wants = [(starts[p], starts[p + 1]) for p in range(len(recorded))]
        y = gather_rows(y, y.dim() + ctx.dims[i], ctx.plan(padded, wants, g.rank, "zeros"), g)
    return y
