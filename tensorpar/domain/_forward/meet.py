"""Pooled features brought back into the tiles: squeeze-and-excitation, image pooling.

A global pooling's output is replicated: every rank holds the whole pooled features, the
layers after it run as dense, and its gradient is whole on every rank while it stays
apart from the tiles (a head on it). A model may also bring it back: a gate multiplied
into the tiles (squeeze-and-excitation), or the pooled features spread over the tile's
points and concatenated with it (DeepLab's image-pooling branch). Each tile's use then
gives the gradient of its own points only, a partial one: the dense gradient is its sum
over the domain.

So where that happens the pooled operand enters the tiles through `copy_to_group` over
each split dim's group (the identity forward, the gradient summed over the domain
backward): the pooled side's gradient is whole again on every rank, as a replicated
tensor's must be (the parameters it reaches give their shares, `shares`). The call's
output is a tile.

The sum needs a gradient of the same shape on every rank, so it goes where the pooled
operand is still replicated: a gate of size 1 along every split dim (broadcast over the
tile), or the input of a call that spreads it to the tile's extent (``F.interpolate`` to
the tile's size, ``expand``, ``repeat``), whose output is then a tile. Whether such a
call spreads to the tile (its output has every rank's tile size along each split dim) is
agreed by all ranks in one small all-reduce, so that the sums run on every rank or none.

Where the tiles along a split dim are all of one size, the spread's size does not tell a
tile from a fixed grid of that size (a head's): the output stays pooled, and its tile
version is kept aside, carried through the layers and calls after it, for the call where
it meets a tile (`into_tiles`). One that reaches a global pooling or the model's output
as an image first raises (`ambiguous_spread`).

This module also decides the road of replicated data given alone to a converted layer
(`runs_dense`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tensorpar._torch import tree_map
from tensorpar.collectives.regions import copy_to_group
from tensorpar.domain._forward.flow import mixing_error
from tensorpar.domain._forward.points import MATMULS, einsum_args, einsum_subscripts
from tensorpar.domain._tiles.agree import agreed_flags, on_any_rank
from tensorpar.domain._tiles.layout import DomainContext
from tensorpar.domain._tiles.marks import POOLED, TILE, Kind, Scan, tensors_in

__all__ = ["SPREADING", "ambiguous_spread", "interpolate_to_empty", "into_tiles", "runs_dense",
           "spread_input", "spreads_to_tiles"]

PointsOf = Callable[[Any], "frozenset[int] | None"]
"""The dims of a tile holding points (``None``: not a tile, or not known)."""

SPREADING = frozenset({F.interpolate, torch.Tensor.expand, torch.Tensor.broadcast_to,
                       torch.broadcast_to, torch.Tensor.repeat, torch.Tensor.tile, torch.tile})
"""Calls that spread their first argument over more points: to the tile's, perhaps."""


def _enter_tiles(ctx: DomainContext, t: torch.Tensor) -> torch.Tensor:
    for g in ctx.groups:
        t = copy_to_group(t, group=g)
    ctx.marks.mark(t, POOLED)  # (the same values; its gradient is whole: no share)
    return t


def _broadcast_over_tiles(ctx: DomainContext, t: torch.Tensor) -> bool:
    """Whether ``t`` has size 1 (or no dim) at every split dim: the same on every tile."""
    return all(t.dim() < -d or t.shape[d] == 1 for d in ctx.dims)


def into_tiles(ctx: DomainContext, func: Any, args: Sequence[Any], kwargs: dict[str, Any],
               points: PointsOf) -> tuple[Any, Any] | None:
    """A call taking tiles and pooled features: the pooled ones entered into the tiles.

    ``points(t)``: the dims of the tile ``t`` holding points (``None``: unknown). ``None``
    where no tile argument has the image's dims and the call is no product whose pooled
    operands are read as broadcast over the points (`_over_points`): pooled features
    meeting a tile's partial reduction (a loss made of both parts) are left to
    `flow.output_kind`.

    Raises:
        RuntimeError: a pooled operand with the tile's extent along a split dim that no
            followed call spread (its gradient would differ in shape between ranks).
    """
    over_points = _over_points(ctx, func, args, kwargs, points)
    if over_points is None and not any(t.dim() == ctx.ndim and ctx.marks.kind_of(t) == TILE
                                       for t in tensors_in((args, kwargs))):
        return None
    name = getattr(func, "__name__", str(func))
    pooled = [t for t in tensors_in((args, kwargs))
              if ctx.marks.kind_of(t) == POOLED and ctx.marks.as_tiles(t) is None]
    refused = not all(id(t) in over_points if over_points is not None
                      else _broadcast_over_tiles(ctx, t) for t in pooled)
    if any(1 in sizes for table in ctx.layouts for sizes in table.values()):
        # a pooled operand spread to a 1-row tile's size has size 1 there: agree
        refused = on_any_rank(ctx, refused, pooled[0].device) if pooled else refused
    if refused:
        raise mixing_error(name)

    def enter(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or ctx.marks.kind_of(v) != POOLED:
            return v
        if (as_tiles := ctx.marks.take_tiles(v)) is not None:
            return as_tiles
        return _enter_tiles(ctx, v)
    return tree_map(enter, args), tree_map(enter, kwargs)


def _over_points(ctx: DomainContext, func: Any, args: Sequence[Any], kwargs: dict[str, Any],
                 points: PointsOf) -> set[int] | None:
    """The ids of a product's operands that are broadcast over its tiles' points.

    ``einsum``: the operands whose subscripts name no dim holding a tile's points (a gate
    ``"bchw,bc->bchw"``; Transolver's slices back to the points ``"bhgc,bhng->bhnc"``).
    ``a @ b`` of a tile ``a`` whose points lie in its rows or batch dims: ``b``, where it
    has size 1 (or no dim) at each batch dim holding them (linear attention's
    ``q @ (k^T v)``). ``None`` where not read (another call, a tile's points unknown).
    """
    if func is torch.einsum:
        read = einsum_subscripts(args)
        if read is None:
            return None
        operands = einsum_args(args)[1:]
        split: set[str] = set()
        for sub, t in zip(read[0], operands, strict=True):
            held = points(t)
            if held is None and isinstance(t, torch.Tensor) and ctx.marks.kind_of(t) == TILE:
                return None  # (a tile whose points are not known)
            split.update(sub[d] for d in held or ())
        return {id(t) for sub, t in zip(read[0], operands, strict=True) if not split & set(sub)}
    if func not in MATMULS or kwargs or len(args) != 2:
        return None
    a, b = args
    held = points(a)
    if not held or not isinstance(b, torch.Tensor) or b.dim() < 2 or a.dim() - 1 in held:
        return None
    lead = a.dim() - b.dim()  # (b's batch dims line up with a's from the right)
    if any(0 <= d - lead < b.dim() - 2 and b.shape[d - lead] != 1 for d in held):
        return None
    return {id(b)}


def spread_input(ctx: DomainContext, func: Any, args: Sequence[Any], kwargs: dict[str, Any],
                 scan: Scan) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A spreading call's arguments with its pooled input entered into the tiles (else None)."""
    if func not in SPREADING or scan.kinds != {POOLED}:
        return None
    given = args[0] if args else kwargs.get("input")
    if not isinstance(given, torch.Tensor) or ctx.marks.kind_of(given) != POOLED \
            or given.dim() != ctx.ndim or not _broadcast_over_tiles(ctx, given):
        return None
    entered = _enter_tiles(ctx, given)
    if args:
        return (entered, *args[1:]), kwargs
    return tuple(args), {**kwargs, "input": entered}


def spreads_to_tiles(ctx: DomainContext, out: Any) -> Kind | None:
    """Whether every rank's ``out`` has its tile's size along each split dim (agreed).

    A tile's size along a split dim is one of the splits recorded this forward (the
    input's, or a converted layer's output's). One all-reduce of a flag per split and dim.

    Returns:
        ``TILE`` where it does, and along some dim the tiles differ in size (so the sizes
        came from the tiles); ``POOLED`` where it does only with tiles all of one size
        (a fixed grid of that size would too); ``None`` where it does not.
    """
    if not isinstance(out, torch.Tensor) or out.dim() != ctx.ndim:
        return None
    splits = [(d, g, sizes) for i, (d, g) in enumerate(zip(ctx.dims, ctx.groups, strict=True))
              for _, sizes in sorted(ctx.layouts[i].items())]
    found = agreed_flags(ctx, [out.shape[d] == sizes[g.rank] for d, g, sizes in splits], "min",
                    out.device)
    if not all(any(f for f, (d, _, _) in zip(found, splits, strict=True) if d == dim)
               for dim in ctx.dims):
        return None
    told = any(f and len(set(sizes)) > 1 for f, (_, _, sizes) in zip(found, splits, strict=True))
    return TILE if told else POOLED


def ambiguous_spread(what: str) -> ValueError:
    """A spread that may be a tile or a fixed grid reached ``what`` without meeting a tile."""
    return ValueError(
        f"parallelize_domain: pooled features spread to the size every tile has along a split "
        f"dim (an even split) reach {what} without meeting a tile: whether they are a tile or "
        f"a fixed grid of that size cannot be told. Join them to a tile first, or spread them "
        f"to a size no tile has")


def runs_dense(ctx: DomainContext, kind: Kind | None, t: Any) -> bool:
    """Whether a converted layer or call given ``t`` runs as the dense one.

    Pooled features do (and what is made from nothing after the pooling); tiles do not. A
    replicated tensor made before the pooling (the early mark, `marks`) runs as dense where it
    is computed from parameters (a learned grid), lacks the image's dims, or has size 1 along
    every spatial dim (an embedding ``(B, C, 1, 1)`` through a 1x1 conv); otherwise (a
    constant, a mask made from the input's shape) it is a tile where every rank's has a
    tile's size along each split dim, agreed in one small all-reduce (1-row tiles and
    fixed grids look alike on one rank).
    """
    if ctx.pooled(kind):
        return True
    if kind == TILE or not isinstance(t, torch.Tensor):
        return False
    if t.dim() != ctx.ndim or t.requires_grad:
        return True
    wide = any(t.shape[s] != 1 for s in range(2, t.dim()))
    fits = all(any(t.shape[d] == sizes[g.rank] for sizes in ctx.layouts[i].values())
               for i, (d, g) in enumerate(zip(ctx.dims, ctx.groups, strict=True)))
    any_wide, any_misfit = agreed_flags(ctx, [wide, not fits], "max", t.device)
    return not (any_wide and not any_misfit)


def interpolate_to_empty(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``F.interpolate`` to a size with a 0 (an empty tile's), which torch refuses.

    The empty result stays joined to the input, so that its backward (a sum over the
    domain, where the input entered the tiles) runs on this rank as on the others.
    """
    size = kwargs.get("size", args[1] if len(args) > 1 else None)
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or size is None:
        return None
    sizes = list(size) if isinstance(size, (tuple, list)) else [size] * (x.dim() - 2)
    if 0 not in sizes:
        return None
    rest = {k: v for k, v in kwargs.items() if k not in ("input", "size", "scale_factor")}
    rest.update(zip(("mode", "align_corners"), args[3:5], strict=False))
    y: torch.Tensor = F.interpolate(x, size=[s or 1 for s in sizes], **rest)
    for j, s in enumerate(sizes):
        if s == 0:
            y = y.narrow(2 + j, 0, 0)
    return y
