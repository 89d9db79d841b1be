"""``F.pad`` calls (and the constant-padding modules) over a split domain.

Along a split dim the padded tensor is the domain's: the rows before it on the first tile,
the rows after it on the last, in every mode (constant, reflect, replicate, circular: the
mirrored, repeated or wrapped rows come from the tiles that hold them, as for a
convolution's ``padding_mode``). The padded split is recorded for this forward, so the
layers after it find their halos; where this forward already split as many rows another
way, each rank takes its rows of that split instead (a forward records one split per
length). One row gather per split dim does both. Other dims are padded as they are. A
negative pad (a crop) along a split dim is refused with an error naming the call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tensorpar.domain._tiles.agree import agreed_values
from tensorpar.domain._tiles.layout import DomainContext
from tensorpar.domain._tiles.rows import gather_rows, offsets

__all__ = ["pad"]


def pad(ctx: DomainContext, x: torch.Tensor, pad: Sequence[int], mode: str = "constant",
        value: float | None = None) -> torch.Tensor:
    """``F.pad(x, pad, mode, value)`` of this rank's tile: its tile of the dense result."""
    where = f"pad(mode={mode!r}) (domain-parallel)"
    if len(pad) % 2:
        raise ValueError(f"{where}: pad has an odd number of entries: {tuple(pad)}")
    pad = _agreed(ctx, x, pad, where)
    local = list(pad)
    for i, d in enumerate(ctx.dims):
        j = -1 - d  # F.pad's pairs run from the last dim
        if 2 * j + 1 >= len(pad):
            continue
        local[2 * j] = local[2 * j + 1] = 0  # (the split dims: padded by the row gather)
        if not (pad[2 * j] or pad[2 * j + 1]):
            continue  # this split dim is not padded
        before, after = pad[2 * j], pad[2 * j + 1]
        if before < 0 or after < 0:
            raise ValueError(f"{where}: a negative pad crops split dim {d} ({before}, {after}), "
                             f"which may take rows of several tiles; not converted")
        sizes = ctx.sizes_of(i, x.shape[d], where, x.device)
        padded = _edges_grown(sizes, before, after)
        split = ctx.out_sizes(i, sum(padded), lambda: padded)  # noqa: B023 (called at once)
        starts = offsets(split)
        wants = [(starts[p] - before, starts[p + 1] - before) for p in range(len(split))]
        g = ctx.groups[i]
        plan = ctx.plan(sizes, wants, g.rank, "zeros" if mode == "constant" else mode)
        x = gather_rows(x, x.dim() + d, plan, g, fill=value or 0.0)
    if not any(local):
        return x
    if x.numel() == 0:  # an empty tile: nothing to mirror (torch refuses), only the shape
        return F.pad(x, local)
    return F.pad(x, local, mode=mode, value=value)


def _agreed(ctx: DomainContext, x: torch.Tensor, pad: Sequence[int], where: str
            ) -> list[int]:
    """``pad`` where every rank pads the split dims alike (one small all-reduce).

    A rank with an empty tile takes the others' (it may have read its amounts from its
    size).

    Raises:
        ValueError: the ranks pad a split dim by different amounts (read from the tile's
            size?): the padded domain would not be the dense one.
    """
    at = [k for d in ctx.dims for k in (-2 - 2 * d, -1 - 2 * d) if k < len(pad)]
    if not at or ctx.domain_size == 1:
        return list(pad)
    mine = None if x.numel() == 0 else [float(pad[k]) for k in at]
    agreed = agreed_values(ctx, mine, len(at), x.device)
    if agreed is None:
        raise ValueError(
            f"{where}: the ranks pad the split dim by different amounts ({tuple(pad)} on this "
            f"rank); amounts computed from the tile's shape (x.shape[-2]) see the tile's size, "
            f"not the domain's. Pad before the split, or compute them from the domain's size")
    out = list(pad)
    for k, v in zip(at, agreed, strict=True):
        out[k] = int(v)
    return out


def _edges_grown(sizes: Sequence[int], before: int, after: int) -> tuple[int, ...]:
    """The split ``sizes`` with ``before`` rows more on the first tile, ``after`` on the last."""
    grown = list(sizes)
    grown[0] += before
    grown[-1] += after
    return tuple(grown)
