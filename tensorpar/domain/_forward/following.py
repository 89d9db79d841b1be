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
    call_name,
    einsum_args,
    einsum_points,
    follow,
    follow_block,
    reading_block,
    readings,
    reduced_dims,
    regroups,
    reshape_groups,
    tensordot_free,
)
from tensorpar.domain._tiles import agree
from tensorpar.domain._tiles.layout import DomainContext
from tensorpar.domain._tiles.marks import TILE, UNREAD, Merged, tensors_in

__all__ = ["Follower", "refuse_unless_image"]

_MOVES_DIMS = frozenset({"permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis",
                         "t", "__getitem__", "expand", "expand_as", "broadcast_to", "repeat",
                         "adjoint", "mT", "mH", "T", "H"})
"""Calls that move dims or elements: what they give of a tile not followed is not its
image's row-major order any more."""

_KEEPS_ORDER = frozenset({"view", "reshape", "view_as", "reshape_as", "unflatten", "flatten",
                          "squeeze", "unsqueeze", "contiguous"})
"""Reshapes: what they give of a tile keeps its elements' row-major order."""

_PERMUTES = frozenset({"permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis",
                       "t", "adjoint", "mT", "mH", "T", "H"})
"""Calls that reorder dims: on a mesh's tile, which dim holds which split dim is followed
dim by dim (the set of dims holding points may stay the same: ``x.transpose(-2, -1)``)."""

Order = tuple[int, ...]


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

    def image_order(self) -> Order:
        return tuple(self.ctx.ndim + d for d in self.ctx.dims)

    def order(self, t: Any) -> Order | None:
        """The dim of the tile ``t`` holding each split dim's points, in the split dims' order.

        ``None``: not known, or several split dims in one dim (`merged`). On a strip, the
        one dim holding points.
        """
        held = self.points(t)
        if held is None:
            return None
        if len(self.ctx.dims) == 1:
            return tuple(held) if len(held) == 1 else None
        recorded, order, _ = self.ctx.marks.order(t)
        if recorded:
            return order
        return self.image_order() if self.ctx.marks.points(t) is None else None

    def merged(self, t: Any) -> Merged | None:
        """The parts of the tile ``t``'s one dim holding several split dims (a mesh's tokens)."""
        if not isinstance(t, torch.Tensor) or len(self.ctx.dims) == 1:
            return None
        return self.ctx.marks.order(t)[2]

    def laid_out_as_image(self, t: torch.Tensor) -> bool:
        """Whether the tile ``t`` holds its points where the image does, in the same order."""
        return self.ctx.marks.points(t) is None and t.dim() == self.ctx.ndim

    def follow_call(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any],
                    out: Any) -> None:
        """Record which dims of the reshaped tile ``out`` hold points (`points`).

        A sequence of tensors (``chunk``, ``split``): those with the input's dims hold
        the points where it does. What a tile not followed gives is not followed either
        (`UNREAD`), and so is a reshape the ranks do not read alike.
        """
        unread = next((t for t in tensors_in((args, kwargs)) if self.unread(t)), None)
        if unread is not None:
            name = call_name(func)
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
            args = einsum_args(args)
            held, _ = einsum_points(args, self.points)
            if isinstance(out, torch.Tensor) and held is not None:
                first = next((t for t in args[1:] if self.points(t)), None)
                self.hold(out, held, None, self._einsum_order(args, first),
                          self.merged(first) if len(held) == 1 else None)
            return
        if func is torch.tensordot:  # the free dims of a, then of b
            self._follow_tensordot(args, kwargs, out)
            return
        x = args[0] if args else kwargs.get("input")
        name = call_name(func)
        if name in ("stack", "cat", "concat", "concatenate") and isinstance(x, (tuple, list)) \
                and isinstance(out, torch.Tensor):  # the first tile's points
            first = next((t for t in x if self.points(t)), None)
            src = self.points(first)
            if src is not None and name == "stack":  # a new dim at ``dim``
                at = (args[1] if len(args) > 1
                      else kwargs.get("dim", kwargs.get("axis", 0))) % out.dim()
                src = frozenset(d + (d >= at) for d in src)
            if src is not None:
                self.hold(out, src, None, _in_order(self.order(first), src),
                          self.merged(first))
            return
        src = self.points(x)
        if src is None or not isinstance(x, torch.Tensor):
            return
        order, merged = self.order(x), self.merged(x)
        if not isinstance(out, torch.Tensor) and \
                (dims := reduced_dims(func, args, kwargs, x.dim())) is not None:
            for t in tensors_in(out):  # ``values, indices = x.max(-1)``
                if (held := after_reduction(src, dims, x.dim(), t.dim())) is not None:
                    self.hold(t, held, None, _in_order(order, held), merged)
            return
        if not isinstance(out, torch.Tensor):
            n, block = x.dim(), self.block(x, src)
            if call_name(func) in ("unbind", "__iter__"):  # ``q, k, v = t``
                gone = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % x.dim()
                if gone in src:
                    return
                src, n = frozenset(d - (d > gone) for d in src), n - 1
            for t in tensors_in(out):
                if t.dim() == n:
                    self.hold(t, src, block, _in_order(order, src), merged)
            return
        if merged is not None and regroups(func, x.dim(), out.dim()):
            self._split_merged(x, out, src, merged)
            return
        block = self.block(x, src)
        held = follow(func, args, kwargs, src, x.shape, out, block)
        regroup = regroups(func, x.dim(), out.dim())
        out_block = None if held is None or regroup else \
            follow_block(func, args, kwargs, src, block, x.shape, out)
        if regroup:  # read from sizes: every rank's verdict
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
        if held is None:
            return
        if name in _PERMUTES and order is not None and len(order) > 1:  # dim by dim
            moved = [follow(func, args, kwargs, frozenset({d}), x.shape, out) for d in order]
            out_order = tuple(next(iter(m)) for m in moved if m is not None and len(m) == 1)
            self.hold(out, held, out_block, out_order if len(out_order) == len(order) else None,
                      merged)
        elif len(held) == 1 and order is not None and len(order) > 1:  # merged in one dim
            self.hold(out, held, out_block, None, _merged_parts(x.shape, out.shape, order))
        else:
            self.hold(out, held, out_block, _in_order(order, held),
                      merged if len(held) == 1 else None)

    def _follow_tensordot(self, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """Where ``tensordot``'s output holds its one tile's points (two are refused)."""
        operands = tensordot_free(args, kwargs)
        if operands is None or not isinstance(out, torch.Tensor):
            return
        start = 0
        for t, free in operands:
            src = self.points(t)
            if src and src <= set(free):
                order = self.order(t)
                self.hold(out, frozenset(start + free.index(d) for d in src), None,
                          None if order is None else tuple(start + free.index(d)
                                                           for d in order),
                          self.merged(t) if len(src) == 1 else None)
                return
            start += len(free)

    def _einsum_order(self, args: Sequence[Any], first: Any) -> Order | None:
        """Where ``einsum`` puts each of the tile ``first``'s split dims (dim by dim)."""
        order = self.order(first)
        if order is None:
            return None
        out = []
        for d in order:
            def one(t: Any, d: int = d) -> frozenset[int] | None:
                return frozenset({d}) if t is first else None
            held, _ = einsum_points(args, one)
            if held is None or len(held) != 1:
                return None
            out.append(next(iter(held)))
        return tuple(out)

    def _split_merged(self, x: torch.Tensor, out: torch.Tensor, src: frozenset[int],
                      merged: Merged) -> None:
        """A reshape of a mesh's tile whose one dim holds several split dims (`merged`).

        Split back into its parts (``x.view(b, h, w, c)`` of tokens ``(b, h * w, c)``),
        each output dim that is one part holds that part's split dim; parts kept together
        stay merged. Read from sizes, which differ between ranks: agreed in one small
        all-reduce (a rank with an empty tile, or a one-row part, takes the others'
        reading). What is not read alike is not followed (`UNREAD`).
        """
        n, k = out.dim(), len(self.ctx.dims)
        mine = _merged_codes(x.shape, out.shape, next(iter(src)), merged, k) \
            if x.numel() else None
        values = [-math.inf] * (2 * n) if mine is None else [*mine, *(-c for c in mine)]
        every = agree.all_reduced(self.ctx, values, "max", out.device)
        high, low = every[:n], [-v for v in every[n:]]
        if any(h != lo or h < 0 for h, lo in zip(high, low, strict=True)):
            self.ctx.marks.mark_unread(out, None)
            return
        held = frozenset(j for j in range(n) if high[j] > 0)
        alone = {int(high[j]) - 1: j for j in range(n) if 0 < high[j] <= k}
        if len(alone) == k:
            self.hold(out, held, None, tuple(alone[i] for i in range(k)))
        elif len(held) == 1:
            self.hold(out, held, None, None, _merged_parts(x.shape, out.shape, None, merged,
                                                         next(iter(src))))
        else:
            self.ctx.marks.mark_unread(out, None)

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

    def hold(self, t: torch.Tensor, held: frozenset[int], block: Block | None = None,
             order: Order | None = None, merged: Merged | None = None) -> None:
        """Record the dims of ``t`` holding points (and their block), unless the image's.

        On a mesh also which dim holds which split dim (``order``), or the parts of the one
        dim holding several (``merged``): a tile whose dims hold the image's points in
        another order (``x.transpose(-2, -1)``) is not the image.
        """
        mesh = len(self.ctx.dims) > 1
        # (a block (1, k) on the image's dim: the rows in units of k, in order, as the
        # image holds them; a window partition split back gives it)
        if t.dim() != self.ctx.ndim or held != self.image_points() or \
                (block is not None and block[0] != 1) or \
                (mesh and order != self.image_order()):
            self.ctx.marks.hold_points(t, held, block)
            if mesh:
                self.ctx.marks.hold_order(t, order, merged)
        else:
            self.ctx.marks.image_again(t)


def _in_order(order: Order | None, held: frozenset[int]) -> Order | None:
    """``order``'s split dims on the dims ``held`` (after a call that moves no dims)."""
    if order is None or len(held) != len(order):
        return None
    ranked, out = sorted(order), sorted(held)
    return tuple(out[ranked.index(d)] for d in order)


def _merged_parts(in_shape: Sequence[int], out_shape: Sequence[int], order: Order | None,
                  merged: Merged | None = None, merged_dim: int = -1) -> Merged:
    """The parts of the one output dim a reshape merges a tile's dims holding points into.

    ``order``: the input's dims holding each split dim; or ``merged``, the parts of its
    one dim ``merged_dim`` holding several. Where this rank cannot list them (an empty
    tile's sizes), the split dims' parts alone, each of size -1: every rank keeps a
    merged record alike.
    """
    unknown = tuple((-1, order.index(d)) for d in sorted(order)) if order else \
        tuple((-1, i) for _, i in merged or () if i >= 0)
    wanted = {i for _, i in unknown}
    for gi, gj in reshape_groups(in_shape, out_shape) or ():
        parts: list[tuple[int, int]] = []
        for d in gi:
            if d == merged_dim and merged is not None:
                parts += merged
            else:
                parts.append((in_shape[d], order.index(d) if order and d in order else -1))
        if any(i >= 0 for _, i in parts):  # (a one-row part grouped apart: not listed)
            whole = {i for _, i in parts if i >= 0} == wanted
            return tuple(parts) if whole and len([j for j in gj if out_shape[j] != 1]) <= 1 \
                else unknown
    return unknown


def _merged_codes(in_shape: Sequence[int], out_shape: Sequence[int], d: int, merged: Merged,
                  k: int) -> list[float] | None:
    """This rank's reading of a reshape of the merged dim ``d``: a code per output dim.

    ``i + 1``: the dim is part ``i``'s split dim alone (with parts of size 1); ``k + 1``:
    it holds several split dims' parts; 0: none; every code -1: not read. ``None``: this
    rank abstains (a split dim's part one row wide reads several ways, or its size is not
    known: -1).
    """
    if not merged or any(size <= 1 for size, i in merged if i >= 0):
        return None  # (a size -1: this rank could not list the parts)
    n = len(out_shape)
    for gi, gj in reshape_groups(in_shape, out_shape) or ():
        if d not in gi:
            continue
        parts = [p for e in gi for p in (merged if e == d else ((in_shape[e], -1),))]
        codes = [0.0] * n
        at = 0
        for j in gj:  # each output dim takes the next parts whose sizes make it up
            size, tagged = 1, []
            while at < len(parts) and size * parts[at][0] <= out_shape[j] and \
                    (size < out_shape[j] or parts[at][0] == 1):
                size *= parts[at][0]
                if parts[at][1] >= 0:
                    tagged.append(parts[at])
                at += 1
            if size != out_shape[j]:
                return [-1.0] * n
            if len(tagged) == 1 and tagged[0][0] == size:  # that part alone
                codes[j] = float(tagged[0][1] + 1)
            elif tagged:
                codes[j] = float(k + 1)
        return codes if at == len(parts) else [-1.0] * n
    return [-1.0] * n


def refuse_unless_image(ctx: DomainContext, x: torch.Tensor, what: str) -> None:
    """Raise where the tile ``x`` is known to hold its points elsewhere than the image does.

    For a converted layer or functional call that works along the image's split dims (a
    stencil, a resampling, a pad): on a tile transposed, permuted or reshaped into other
    dims, it would run along other dims than the image's. The marks are the same on every
    rank, so every rank raises. A tile reshaped in a way the ranks cannot read
    (`UNREAD`) is taken for the image, as the reshapes back that fail to read (tiles one
    row wide) are.
    """
    held = ctx.marks.points(x)
    if held is None or held == UNREAD:  # (not read: taken for the image, see the docs)
        return
    image = [ctx.ndim + d for d in ctx.dims]
    order = ctx.marks.order(x)[1]
    how = f"dims {list(order)} of {x.dim()}" if order is not None \
        else f"dim(s) {sorted(held)} of {x.dim()}"
    raise ValueError(
        f"{what} (domain-parallel) takes a tile laid out as the image, its split points in "
        f"dims {image} of {ctx.ndim} in the split dims' order; this tile holds them in "
        f"{how}, so it would run along other dims than the image's. Undo the reshape, "
        f"transpose or permute before it (or call it before them)")
