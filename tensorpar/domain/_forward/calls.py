"""While a converted model runs: its functional calls followed, and converted on tiles.

A torch function mode sees every call the model's forward makes outside the converted
layers. It marks each output a tile or pooled features (`marks`), converts ``F.pad``,
``F.interpolate``, functional convolutions and poolings (as their layers), a global
pooling written as ``F.adaptive_avg_pool2d(x, 1)``, a ``sum`` or ``mean`` over every split
point (`reductions`), refuses what would silently see the tile alone (attention, any
other reduction, a softmax or a sort along the points), lets pooled features into the
tiles (`meet`), and gives the parameters used on pooled features their shares
(`shares`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tensorpar._torch import tree_map
from tensorpar.domain._forward import meet
from tensorpar.domain._forward.contract import contract_points
from tensorpar.domain._forward.converted import CONVERTED, NOT_CONVERTED, convert
from tensorpar.domain._forward.flow import (
    not_linear,
    output_kind,
    reads_only_metadata,
    refuse_checkpointed,
    refuse_spread,
)
from tensorpar.domain._forward.following import Follower
from tensorpar.domain._forward.points import (
    MATMULS,
    cut_dim,
    einsum_points,
    indexed_dims,
    pairs_points,
    reduced_dims,
    tensordot_points,
)
from tensorpar.domain._forward.reductions import loss_reduction, reduce_tile, refuse_mean_loss
from tensorpar.domain._forward.shares import share_gradients
from tensorpar.domain._layers.attention import per_point, refuse_functional
from tensorpar.domain._layers.roll import roll
from tensorpar.domain._tiles import agree
from tensorpar.domain._tiles.layout import DomainContext
from tensorpar.domain._tiles.marks import (
    EARLY,
    PARTIAL,
    POOLED,
    TILE,
    Kind,
    Scan,
    tensors_in,
)

__all__ = ["enter_functional_mode", "exit_functional_mode"]


class _FunctionalCalls(TorchFunctionMode):
    """While a converted model runs: every call outside the converted layers, followed.

    Every call's output is marked a tile or pooled features (`marks`); where pooled
    features meet the tiles, their gradient is summed over the domain (`meet`); the
    parameters (and what is computed from them alone) a call on pooled features uses give
    shares (`share_gradients`).
    """

    def __init__(self, ctx: DomainContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.follower = Follower(ctx)

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        ctx = self.ctx
        if ctx.internal and not ctx.on_pooled and func is not F.interpolate:
            return func(*args, **kwargs)  # what `_call` does with these: the common case
        if not ctx.active or ctx.internal:  # (a converted layer's own calls: not tracked)
            return self._call(func, args, kwargs, _UNTRACKED)
        scan = ctx.marks.scan(args, kwargs)
        if scan.checkpointed:
            refuse_checkpointed(getattr(func, "__name__", str(func)), (args, kwargs))
        if PARTIAL in scan.kinds:
            if not reads_only_metadata(func) and self._spreads_partial(args, kwargs):
                # (``x - x.sum()``, ``x / x.sum()``)
                raise _not_linear_error(func)
            return self._on_partial(func, args, kwargs, scan)
        poolings = ctx.poolings
        kind: Kind | None = None
        entered = None
        name = getattr(func, "__name__", str(func))
        mixed = POOLED in scan.kinds and TILE in scan.kinds and not reads_only_metadata(func)
        if mixed:
            met = meet.into_tiles(ctx, func, args, kwargs, self.follower.points)
            if met is not None:
                args, kwargs = met
                kind = TILE
        else:
            entered = meet.spread_input(ctx, func, args, kwargs, scan)
        out = self._call(func, args, kwargs, scan)
        ctx.ahead.carry(func, args, kwargs, out)
        if entered is not None:  # pooled features spread: to the tile's extent?
            kind = POOLED
            if (spread := meet.spreads_to_tiles(ctx, out)) == TILE:
                out, kind = self._call(func, *entered, scan), TILE
            elif spread == POOLED:  # (or a fixed grid: a tile only where it meets one)
                ctx.marks.keep_as_tiles(out, self._call(func, *entered, scan))
        if (scan.kinds == {POOLED} or (mixed and kind is None)) and entered is None \
                and ctx.poolings == poolings:
            self._as_tiles_too(func, args, kwargs, scan, out)
        if scan.params and any(t.requires_grad for t in tensors_in(out)):
            ctx.used(scan.params)  # (not a read of a parameter's dtype or shape)
        if ctx.poolings > poolings:
            kind = POOLED
        elif kind is None and mixed:
            device = next(tensors_in((args, kwargs))).device
            refuse_spread(name, out, scan, lambda flag: agree.on_any_rank(ctx, flag, device))
            kind = PARTIAL
        elif kind is None:
            kind = output_kind(func, args, scan, ctx.marks, ctx.reduced)
            if kind == TILE and self._sums_the_tile(func, args, kwargs):
                kind = PARTIAL  # a loss of the tile's part
        ctx.marks.mark(out, kind)
        if args and kind is not None and _in_place(func):  # ``b[:] = t``, ``b.copy_(t)``
            ctx.marks.mark(args[0], kind)
        if kind == TILE:
            self.follower.follow_call(func, args, kwargs, out)
        return out

    def _on_partial(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], scan: Scan
                    ) -> Any:
        """A call on a loss of the tile's part, alone or with pooled parts (`marks.PARTIAL`).

        Each rank's loss is a partial one, summed over the ranks by the backward: a sum may
        add pooled terms (whole on every rank, as they are) and terms computed from
        parameters alone, which give a share; anything else combined with what needs a
        gradient and is not the tile's would count it once per tile, and raises; so does a
        function of it that is not linear (`not_linear`: ``sqrt(loss)``, ``loss ** 2``).
        """
        ctx = self.ctx
        name = getattr(func, "__name__", func)
        if not_linear(func, args, lambda v: isinstance(v, torch.Tensor)
                      and ctx.marks.kind_of(v) == PARTIAL):
            raise _not_linear_error(func)

        def replicated(t: torch.Tensor) -> bool:
            return t.requires_grad and ctx.marks.kind_of(t) not in (TILE, PARTIAL)
        if any(replicated(t) for t in tensors_in((args, kwargs))):
            if func not in _SUMS:
                raise ValueError(
                    f"{name} (domain-parallel) of a loss made of a tile's part and pooled "
                    f"parts with pooled features or parameters: each rank's loss is summed "
                    f"over the ranks, so only sums may add to it (weight each part before "
                    f"adding it)")
            args, kwargs = share_gradients(args, kwargs, ctx.domain_size,
                                           lambda t: _replicated_grad(ctx, t))
        out = func(*args, **kwargs)
        ctx.marks.mark(out, PARTIAL)
        return out

    def _spreads_partial(self, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Whether a call broadcasts a loss of parts (`PARTIAL`) over a tensor of another shape.

        Read from shapes every rank has alike: a kept-dims sum ``(1, 1, 1, 1)`` against an
        empty tile ``(1, C, 0, W)`` is a spread there too.
        """
        marks = self.ctx.marks
        tensors = list(tensors_in((args, kwargs)))
        parts = [t for t in tensors if marks.kind_of(t) == PARTIAL]
        widest = max(parts, key=lambda t: t.dim())
        return any(t.dim() > widest.dim() or (t.dim() == widest.dim() and t.shape != widest.shape)
                   for t in tensors if marks.kind_of(t) != PARTIAL and marks.kind_of(t) == TILE)

    def _as_tiles_too(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any],
                      scan: Scan, out: Any) -> None:
        """A call on a spread that may be a tile (`meet`): also on its tile version."""
        marks = self.ctx.marks
        if not isinstance(out, torch.Tensor) or not any(
                marks.as_tiles(t) is not None for t in tensors_in((args, kwargs))):
            return

        def tiles(v: Any) -> Any:
            return marks.as_tiles(v) if isinstance(v, torch.Tensor) \
                and marks.as_tiles(v) is not None else v
        args, kwargs = tree_map(tiles, args), tree_map(tiles, kwargs)
        try:  # the other pooled operands go into its tiles, where they can
            met = meet.into_tiles(self.ctx, func, args, kwargs, self.follower.points)
        except RuntimeError:
            return  # (they cannot: it stays pooled features alone)
        if met is not None:
            args, kwargs = met
        pending = [u for t in tensors_in((args, kwargs)) for u in marks.pending(t)]
        poolings = self.ctx.poolings
        tiles_out = self._call(func, args, kwargs, Scan({TILE}, 0, scan.params, False))
        if self.ctx.poolings > poolings:
            raise meet.ambiguous_spread("a global pooling")
        if isinstance(tiles_out, torch.Tensor):
            marks.mark(tiles_out, TILE)
            marks.keep_as_tiles(out, tiles_out, pending)

    def _call(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], scan: Scan
              ) -> Any:
        ctx = self.ctx
        if func in _ROLLS and TILE in scan.kinds and ctx.active and not ctx.internal \
                and ctx.domain_size > 1 and (rolled := self._roll(args, kwargs)) is not None:
            return rolled
        if TILE in scan.kinds and ctx.domain_size > 1:
            if not per_point(func, args, kwargs, self.follower.points):
                refuse_functional(func)
            if loss_reduction(func, kwargs) == "mean" and self.follower.points(
                    args[0] if args else kwargs.get("input")):
                raise refuse_mean_loss(getattr(func, "__name__", str(func)))
            if any(self.follower.unread(t) for t in args[:2]) and \
                    self._needs_points(func, args, kwargs):
                raise ValueError(
                    f"{getattr(func, '__name__', func)} (domain-parallel) of a tile reshaped in a "
                    f"way that is not followed (which of its dims hold the split dims' points "
                    f"is not known, see the docs' reductions along a split dim): it could see the "
                    f"tile's points alone. Reshape it back to the image's layout first, or "
                    f"reduce before the reshape")
            if (cut := self._cut_dim(func, args, kwargs)) is not None:
                raise ValueError(
                    f"{getattr(func, '__name__', func)} (domain-parallel) along dim {cut} of a "
                    f"tile, which holds the split dims' points, would cut, move or join the "
                    f"tile's rows as if they were the domain's (a slice, roll, flip, chunk or "
                    f"cat along a split dim is not converted); do it before the split, or on "
                    f"the gathered tensor")
            if (summed := contract_points(ctx, self.follower, func, args, kwargs)) is not None:
                return summed
            points = self.follower.points
            if ((func in _PRODUCTS and pairs_points(args, [points(a) for a in args[:2]]))
                    or (func is torch.einsum and einsum_points(args, points)[1])
                    or (func is torch.tensordot and tensordot_points(args, kwargs, points))
                    or (func is torch.kron and any(points(a) for a in args[:2]))):
                raise ValueError(
                    f"{getattr(func, '__name__', func)} (domain-parallel) pairs two tiles' "
                    f"points, sums a tile over its points or interleaves them with another "
                    f"tensor's (attention written by hand?): it would see the tile's points "
                    f"alone. Attention over the domain is converted in diffusers' and MONAI's "
                    f"attention blocks (tensorpar.nn.ring_attention for your own)")
            if func not in _PRODUCTS and func not in _PRODUCT_CALLS and \
                    (orders := self._tile_orders(args)) is not None:
                raise ValueError(
                    f"{getattr(func, '__name__', func)} (domain-parallel) combines tiles "
                    f"whose split points lie in different dims ({orders}: a tile and its "
                    f"transpose?): each rank holds other parts of the domain in them, so it "
                    f"would pair points that dense does not. Combine them before the split, "
                    f"or on the gathered tensor")
        kind = scan.road
        on_tiles = ctx.active and not ctx.internal and func in CONVERTED \
            and not meet.runs_dense(ctx, kind, args[0] if args else kwargs.get("input"))
        tiled = TILE in scan.kinds or kind == EARLY  # (not a constant made after the pooling)
        if on_tiles and (converted := convert(ctx, func, args, kwargs, tiled)) \
                is not NOT_CONVERTED:
            return converted
        if TILE in scan.kinds and ctx.active and not ctx.internal and ctx.domain_size > 1 \
                and (reduced := self._reduce(func, args, kwargs)) is not None:
            return reduced
        if func is F.interpolate and (empty := meet.interpolate_to_empty(args, kwargs)) \
                is not None:
            return empty
        # used on pooled features, a parameter's gradient is whole on every tile
        if ctx.domain_size == 1:
            pass
        elif ctx.internal:  # (a converted layer's own calls: its parameters)
            if ctx.on_pooled:
                args, kwargs = share_gradients(
                    args, kwargs, ctx.domain_size,
                    lambda t: _is_parameter(t)
                    or (id(t) in ctx.layer_weights and _replicated_grad(ctx, t)))
        elif scan.kinds == {POOLED}:
            args, kwargs = share_gradients(args, kwargs, ctx.domain_size,
                                           lambda t: _replicated_grad(ctx, t), _in_place(func))
        return func(*args, **kwargs)

    def _tile_orders(self, args: Sequence[Any]) -> list[tuple[int, ...]] | None:
        """The dims holding each split dim of the tiles a call combines, where they differ.

        Aligned to the last dim (broadcasting); tiles whose layout is not known are left
        out. ``None``: they agree (or fewer than two tiles are known).
        """
        marks = self.ctx.marks
        tiles = [t for t in tensors_in(args) if marks.kind_of(t) == TILE]
        if len(tiles) < 2:
            return None
        n = max(t.dim() for t in tiles)
        layouts = set()
        for t in tiles:
            if (order := self.follower.order(t)) is not None:
                layouts.add(tuple(d + n - t.dim() for d in order))
            elif merged := self.follower.merged(t):  # its split dims' order in the one dim
                (d,) = self.follower.points(t) or (-1,)
                layouts.add((d + n - t.dim(), *(-2 - i for _, i in merged if i >= 0)))
        return sorted(layouts) if len(layouts) > 1 else None

    def _roll(self, args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """A roll of a tile along dims holding points (`roll`; ``None``: not converted).

        Converted where those dims hold the points in the domain's order: the split dims
        of an image-shaped tile, or a strip's one dim whose points are its outermost part
        (its `Block` says so). Any other roll along the points is refused as a cut.
        """
        ctx = self.ctx
        given = dict(zip(("input", "shifts", "dims"), args, strict=False)) | kwargs
        x, dims = given.get("input"), given.get("dims")
        if not isinstance(x, torch.Tensor) or dims is None or "shifts" not in given:
            return None
        held = self.follower.points(x)
        image = ctx.marks.points(x) is None and x.dim() == ctx.ndim
        if image:
            split_at = {x.dim() + d: i for i, d in enumerate(ctx.dims)}
        elif held is not None and len(held) == 1 and len(ctx.dims) == 1 and \
                (block := self.follower.block(x, held)) is not None and block[0] == 1:
            split_at = {next(iter(held)): 0}
        else:
            return None
        if not any(d % x.dim() in split_at
                   for d in ((dims,) if isinstance(dims, int) else dims)):
            return None
        with ctx.own_calls():
            return roll(ctx, x, given["shifts"], dims, split_at, image)

    def _cut_dim(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> int | None:
        """`cut_dim`, agreed by the ranks for a bounded slice of a dim holding points.

        Whether it keeps every row reads the tile's size, which differs between ranks.
        """
        if getattr(func, "__name__", "") not in ("__getitem__", "__setitem__") or len(args) < 2:
            return cut_dim(func, args, kwargs, self.follower.points)
        x = args[0]
        held = self.follower.points(x)
        if not held or not isinstance(x, torch.Tensor):
            return None
        cut, sliced = indexed_dims(args[1], x.shape, held)
        if sliced is None:
            return cut
        on_any = agree.on_any_rank(self.ctx, cut is not None, x.device)  # (one all-reduce)
        return cut if cut is not None else sliced if on_any else None

    def _needs_points(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Whether ``func`` on a tile not followed would need to know where its points are.

        A reduction, softmax, scan or sort along any dim, a call that cuts, moves or joins
        rows along any dim (a roll, a flip, a cat; not indexing), or a product of two tiles;
        not a sum of the whole tile (its part of a loss, whatever its layout).
        """
        x = args[0] if args else kwargs.get("input")
        if cut_dim(func, args, kwargs, lambda t: frozenset(range(t.dim()))
                   if isinstance(t, torch.Tensor) else None) is not None:
            return True
        if func in _PRODUCTS or func is torch.einsum:
            return sum(self.ctx.marks.kind_of(t) == TILE for t in args[:3]
                       if isinstance(t, torch.Tensor)) > 1
        if not isinstance(x, torch.Tensor):
            return False
        dims = reduced_dims(func, args, kwargs, x.dim())
        whole_sum = getattr(func, "__name__", "") in ("sum", "nansum") and \
            dims == frozenset(range(x.dim()))
        return dims is not None and not whole_sum

    def _sums_the_tile(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Whether ``func`` sums a tile over every dim (its part of a loss)."""
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or not (self.follower.points(x)
                                                   or self.follower.unread(x)):
            return False
        if loss_reduction(func, kwargs) == "sum":
            return True
        return getattr(func, "__name__", "") in ("sum", "nansum") and \
            reduced_dims(func, args, kwargs, x.dim()) == frozenset(range(x.dim()))

    def _reduce(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
                ) -> torch.Tensor | None:
        """A reduction of a tile along its points: the domain's sum or mean (`reductions`).

        ``None`` where ``func`` is no reduction along the points (it runs as it is).
        """
        x = args[0] if args else kwargs.get("input")
        points = self.follower.points(x)
        if not points or not isinstance(x, torch.Tensor):
            return None
        dims = reduced_dims(func, args, kwargs, x.dim())
        if dims is None or not dims & points:
            return None
        image = self.ctx.marks.points(x) is None
        with self.ctx.own_calls():
            return reduce_tile(self.ctx, func, x, dims, points, image, args, kwargs)


_UNTRACKED = Scan(set(), 0, [], False)  # (never changed)
_PRODUCTS = MATMULS
"""Products of two tensors: two tiles' may pair every point with every other."""
_PRODUCT_CALLS = frozenset({torch.einsum, torch.tensordot, torch.kron})
"""Products read by their own rules (subscripts, contracted dims)."""
_ROLLS = frozenset({torch.roll, torch.Tensor.roll})

_SUMS = frozenset({torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__,
                   torch.sub, torch.Tensor.sub, torch.Tensor.__sub__, torch.Tensor.__rsub__,
                   torch.Tensor.__iadd__, torch.Tensor.add_, torch.Tensor.__isub__,
                   torch.Tensor.sub_, torch.sum, torch.Tensor.sum, torch.cat, torch.stack})
"""Calls that only add their tensors up (a loss's terms)."""


def _not_linear_error(func: Any) -> ValueError:
    name = getattr(func, "__name__", func)
    return ValueError(
        f"{name} (domain-parallel) of a loss made in the forward from a tile's part (x.sum() "
        f"of a tile): each rank's loss is its part, summed over the ranks by backward, and "
        f"{name} of a part is not its share of {name} of the whole. Sum over the split dims "
        f"first (x.sum((2, 3)) and x.mean() are the domain's), or apply {name} to the loss "
        f"outside the model")


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) and t.requires_grad


def _replicated_grad(ctx: DomainContext, t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter or computed from them alone, and needs a gradient."""
    return t.requires_grad and ctx.marks.kind_of(t) not in (TILE, POOLED, PARTIAL)


def _in_place(func: Any) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``copy_``, ``x[i] = y``)."""
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))


def enter_functional_mode(ctx: DomainContext) -> None:
    """Start converting functional calls (the model's entry)."""
    mode = _FunctionalCalls(ctx)
    mode.__enter__()  # type: ignore[no-untyped-call]
    ctx.modes.append(mode)


def exit_functional_mode(ctx: DomainContext) -> None:
    """Stop converting functional calls (the model's exit, also after an exception)."""
    if ctx.modes:
        ctx.modes.pop().__exit__(None, None, None)
    if not ctx.modes:
        ctx.active = False
