"""Which dims of a tile hold the split dims' points, followed through a forward's calls.

An image-shaped tile holds them in its split dims. A call that moves or reshapes a tile
(``permute``, ``flatten``, ``view``, ``einsum``, ``cat``, a reduction along other dims)
gives a tile whose points `points.follow` reads from the call; a reshape that regroups a
dim holding points (tokens back into an image, windows of rows) is read from sizes, which
differ between ranks, so the ranks agree on its reading in one small all-reduce. What
cannot be read is marked not followed (`marks.UNREAD`): a call that would need its points
raises (`calls`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from tensorpar.domain._forward.points import (
    Block,
    after_reduction,
    einsum_points,
    follow,
    follow_block,
    reading_block,
    readings,
    reduced_dims,
    regroups,
)
from tensorpar.domain._tiles import agree
from tensorpar.domain._tiles.layout import DomainContext
from tensorpar.domain._tiles.marks import TILE, UNREAD, tensors_in

__all__ = ["Follower"]

_MOVES_DIMS = frozenset({"permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis",
                         "t", "__getitem__", "expand", "expand_as", "broadcast_to", "repeat",
                         "adjoint", "mT", "mH", "T", "H"})
"""Calls that move dims or elements: what they give of a tile not followed is not its
image's row-major order any more."""

_KEEPS_ORDER = frozenset({"view", "reshape", "view_as", "reshape_as", "unflatten", "flatten",
                          "squeeze", "unsqueeze", "contiguous"})
"""Reshapes: what they give of a tile keeps its elements' row-major order."""


class Follower:
    """The dims holding points of the tiles a converted model's forward makes (`marks`)."""

    def __init__(self, ctx: DomainContext) -> None:
        self.ctx = ctx

    def points(self, t: Any) -> frozenset[int] | None:
        """The dims of the tile ``t`` that hold the split dims' points (``None``: unknown)."""
        ctx = self.ctx
        if not isinstance(t, torch.Tensor) or ctx.marks.kind_of(t) != TILE:
            return None
        held = ctx.marks.points(t)
        if held == UNREAD:
            return None
        return held if held is not None or t.dim() != ctx.ndim else self.image_points()

    def unread(self, t: Any) -> bool:
        """Whether ``t`` is a tile reshaped in a way that is not followed (`UNREAD`)."""
        return isinstance(t, torch.Tensor) and self.ctx.marks.points(t) == UNREAD

    def image_points(self) -> frozenset[int]:
        return frozenset(self.ctx.ndim + d for d in self.ctx.dims)

    def follow_call(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any],
                       out: Any) -> None:
        """Record which dims of the reshaped tile ``out`` hold points (`points`).

        A sequence of tensors (``chunk``, ``split``): those with the input's dims hold
        the points where it does. What a tile not followed gives is not followed either
        (`UNREAD`), and so is a reshape the ranks do not read alike.
        """
        unread = next((t for t in tensors_in((args, kwargs)) if self.unread(t)), None)
        if unread is not None:
            name = getattr(func, "__name__", "")
            # the row-major order of the image it came from is kept by reshapes and by
            # calls that keep the shape without moving dims: back at that shape, an image
            origin = self.ctx.marks.origin(unread) if name not in _MOVES_DIMS else None
            for t in tensors_in(out):
                kept = origin if name in _KEEPS_ORDER or t.shape == unread.shape else None
                if kept is not None and t.shape == kept:
                    self.ctx.marks.image_again(t)
                else:
                    self.ctx.marks.mark_unread(t, kept)
            return
        if func is torch.einsum:  # its subscripts name the dims
            held, _ = einsum_points(args, self.points)
            if isinstance(out, torch.Tensor) and held is not None:
                self.hold(out, held)
            return
        x = args[0] if args else kwargs.get("input")
        name = getattr(func, "__name__", "")
        if name in ("stack", "cat", "concat", "concatenate") and isinstance(x, (tuple, list)) \
                and isinstance(out, torch.Tensor):  # the first tile's points
            src = next((p for t in x if (p := self.points(t))), None)
            if src is not None and name == "stack":  # a new dim at ``dim``
                at = (args[1] if len(args) > 1
                      else kwargs.get("dim", kwargs.get("axis", 0))) % out.dim()
                src = frozenset(d + (d >= at) for d in src)
            if src is not None:
                self.hold(out, src)
            return
        src = self.points(x)
        if src is None or not isinstance(x, torch.Tensor):
            return
        if not isinstance(out, torch.Tensor) and \
                (dims := reduced_dims(func, args, kwargs, x.dim())) is not None:
            for t in tensors_in(out):  # ``values, indices = x.max(-1)``
                if (held := after_reduction(src, dims, x.dim(), t.dim())) is not None:
                    self.hold(t, held)
            return
        if not isinstance(out, torch.Tensor):
            n, block = x.dim(), self.block(x, src)
            if getattr(func, "__name__", "") in ("unbind", "__iter__"):  # ``q, k, v = t``
                gone = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % x.dim()
                if gone in src:
                    return
                src, n = frozenset(d - (d > gone) for d in src), n - 1
            for t in tensors_in(out):
                if t.dim() == n:
                    self.hold(t, src, block)
            return
        block = self.block(x, src)
        held = follow(func, args, kwargs, src, x.shape, out, block)
        out_block = None if held is None or regroups(func, x.dim(), out.dim()) else \
            follow_block(func, args, kwargs, src, block, x.shape, out)
        if regroups(func, x.dim(), out.dim()):  # read from sizes: every rank's verdict
            # (an empty tile's sizes tell nothing, nor do a one-row tile's: it takes the
            # others')
            rows = [x.shape[d] // (block[0] * block[1]) for d in src] if block is not None \
                else [x.shape[d] for d in src]
            codes = None if not x.numel() or all(r <= 1 for r in rows) else \
                readings(src, block, x.shape, out.shape, held) or {}
            held, out_block = self._agreed_reading(codes, out)
            if held is None:
                image = self.ctx.marks.points(x) is None and x.dim() == self.ctx.ndim
                self.ctx.marks.mark_unread(out, x.shape if image else None)
        if held is not None:
            self.hold(out, held, out_block)

    def _agreed_reading(self, codes: dict[int, float] | None, out: torch.Tensor
                        ) -> tuple[frozenset[int] | None, Block | None]:
        """The dims of a reshaped tile holding points, and their block, read alike by all.

        ``codes``: this rank's `readings` (``None``: it abstains; empty: it cannot read
        them). One small all-reduce of each output dim's code and size: a dim every rank
        that reads gives the same code holds the points; several such dims (one window per
        tile everywhere: read two ways alike) all hold them, with no block, so that only
        a reduction over all of them is the domain's. Unknown where no dim is read alike,
        or where a dim that does not hold them differs in size between ranks (a split read
        from the tile's own size).
        """
        n = out.dim()
        mine = [-math.inf] * (4 * n) if codes is None else \
            [*(codes.get(j, -1.0) for j in range(n)), *map(float, out.shape)]
        if codes is not None:
            mine += [-v for v in mine]
        every = agree.all_reduced(self.ctx, mine, "max", out.device)
        high, low = every[:2 * n], [-v for v in every[2 * n:]]
        read = {j: high[j] for j in range(n) if high[j] == low[j] and high[j] >= 0}
        if not read or any(high[n + j] != low[n + j] for j in range(n) if j not in read):
            return None, None
        if len(read) > 1:
            return frozenset(read), None
        ((j, code),) = read.items()
        return frozenset({j}), reading_block(code)

    def block(self, t: torch.Tensor, held: frozenset[int]) -> Block | None:
        """The `Block` of the tile ``t``'s dim holding points (``None``: not known)."""
        if self.ctx.marks.points(t) is not None:
            return self.ctx.marks.block(t)
        return (1, 1) if len(held) == 1 and held == self.image_points() else None

    def hold(self, t: torch.Tensor, held: frozenset[int], block: Block | None = None) -> None:
        """Record the dims of ``t`` holding points (and their block), unless the image's."""
        if t.dim() != self.ctx.ndim or held != self.image_points() or \
                block not in (None, (1, 1)):
            self.ctx.marks.hold_points(t, held, block)
