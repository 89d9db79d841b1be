"""The public halo exchange: a tile grows by the neighbours' rows on each side."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorpar.comm._group import GroupLike, resolve_group
from tensorpar.domain._tiles.rows import gather_rows, offsets, plan_rows

__all__ = ["halo_exchange"]


def halo_exchange(x: torch.Tensor, *, dim: int, sizes: Sequence[int],
                  halo: int | tuple[int, int], periodic: bool = False,
                  group: GroupLike = None) -> torch.Tensor:
    """Extend this rank's tile by ``halo`` rows of the neighbouring tiles on each side.

    The dense tensor is split along ``dim`` in group-rank order: rank ``r`` holds global rows
    ``[off[r], off[r] + sizes[r])``. Every rank gets global rows
    ``[off[r] - lo, off[r] + sizes[r] + hi)``, wherever they live: a neighbour's tile
    narrower than the halo is passed over and the rest comes from the rank after it. Rows
    outside the domain are zeros, or with ``periodic=True`` the rows at the other end (the
    first rank's lower halo is the last rows of the domain).

    Forward: each rank sends the rows its neighbours need (point to point).
    Backward: the mirror: each halo row's gradient goes back to the rank that owns the row
    and is *added* to that row's gradient.

    Args:
        x: this rank's tile.
        dim: the split dim (negative counts from the end).
        sizes: every rank's tile size along ``dim``, in group-rank order (the same on every
            rank; tiles may be uneven or empty).
        halo: rows added on each side, or ``(lo, hi)``: ``lo`` before the tile, ``hi``
            after it.
        periodic: wrap around the ends of the domain (else zeros outside it).
        group: the process group (``None``: the default group, resolved at call time).

    Returns:
        The tile with its halo: ``lo + sizes[rank] + hi`` rows along ``dim``.

    Raises:
        ValueError: ``sizes`` does not have one non-negative entry per rank, ``x`` does not
            have ``sizes[rank]`` rows along ``dim``, a negative halo, or a periodic halo on
            an empty domain.
        TypeError: ``halo`` is neither an int nor a pair of ints.

    Shape:
        x: ``(..., sizes[rank], ...)``; output: ``(..., lo + sizes[rank] + hi, ...)``.

    Example:
        >>> import torch
        >>> halo_exchange(torch.arange(4.0), dim=0, sizes=[4], halo=1, periodic=True)
        tensor([3., 0., 1., 2., 3., 0.])
    """
    fn = "halo_exchange"
    g = resolve_group(group, fn)
    if isinstance(halo, int) and not isinstance(halo, bool):
        lo, hi = halo, halo
    elif isinstance(halo, tuple) and len(halo) == 2 and all(
            isinstance(h, int) and not isinstance(h, bool) for h in halo):
        lo, hi = halo
    else:
        raise TypeError(f"{fn}: halo must be an int or a pair (lo, hi) of ints, got {halo!r}")
    sizes = [int(s) for s in sizes]
    if len(sizes) != g.size or any(s < 0 for s in sizes):
        raise ValueError(f"{fn}: sizes must give one non-negative tile size per rank of the "
                         f"group ({g.size}), got {sizes}")
    if lo < 0 or hi < 0:
        raise ValueError(f"{fn}: halo must be >= 0 on each side, got (lo, hi) = ({lo}, {hi})")
    n = sum(sizes)
    if periodic and n == 0 and lo + hi > 0:
        raise ValueError(f"{fn}: a periodic halo needs a non-empty domain, got sizes {sizes}")
    d = dim if dim >= 0 else dim + x.dim()
    if not 0 <= d < x.dim():
        raise ValueError(f"{fn}: dim={dim} is out of range for a {x.dim()}-D tile")
    if x.shape[d] != sizes[g.rank]:
        raise ValueError(f"{fn}: rank {g.rank}'s tile has {x.shape[d]} rows along dim {dim}, "
                         f"but sizes[{g.rank}] = {sizes[g.rank]}")
    off = offsets(sizes)
    wants = [(off[p] - lo, off[p + 1] + hi) for p in range(g.size)]
    plan = plan_rows(sizes, wants, g.rank, "circular" if periodic else "zeros")
    return gather_rows(x, d, plan, g)
