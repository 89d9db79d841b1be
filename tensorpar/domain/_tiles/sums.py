"""Sums, counts and extremes over the whole domain: every rank's tile taken together."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from tensorpar.domain._tiles.agree import all_reduced, over_groups
from tensorpar.domain._tiles.layout import DomainContext

__all__ = ["extreme_over_domain", "global_count", "over_domain", "sum_over_domain"]


def sum_over_domain(ctx: DomainContext, t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over every rank of the domain (backward: the gradients summed too)."""
    return over_groups(ctx, t, "sum", backward="sum")


def global_count(ctx: DomainContext, x: torch.Tensor, dims: Sequence[int], where: str) -> int:
    """The domain's number of points of ``x`` (the image's dims) over ``dims``."""
    count = 1
    split = {x.dim() + d: i for i, d in enumerate(ctx.dims)}
    for dim in dims:
        i = split.get(dim)
        count *= x.shape[dim] if i is None else sum(
            ctx.sizes_of(i, x.shape[dim], where, x.device))
    return count


def over_domain(ctx: DomainContext, x: torch.Tensor, dims: Sequence[int], name: str, *,
                mean: bool = True, image: bool = True, keepdim: bool = True,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """The sum (or mean) of the tiles over ``dims`` (every dim holding points among them).

    Replicated (every rank holds it whole); counts as a global pooling of the forward.
    ``image``: ``x`` has the image's dims, whose split sizes this forward recorded;
    otherwise the count is the ranks' counts added up (one small all-reduce).
    """
    dims = sorted({d % x.dim() for d in dims})
    total = over_groups(ctx, x.sum(dims, keepdim=keepdim, dtype=dtype))
    ctx.poolings += 1
    if not mean:
        return total
    if image:
        count = global_count(ctx, x, dims, f"{name} (domain-parallel)")
    else:  # (the ranks' counts added up)
        mine = math.prod(x.shape[d] for d in dims)
        count = int(all_reduced(ctx, [float(mine)], "sum", total.device)[0])
    return total / count


def extreme_over_domain(ctx: DomainContext, x: torch.Tensor, dims: Sequence[int], name: str,
                        *, largest: bool = True, keepdim: bool = True, first: bool = False
                        ) -> torch.Tensor:
    """The largest (or smallest) value of the tiles over ``dims``, every dim holding points.

    Replicated (every rank holds it whole); counts as a global pooling of the forward.
    The gradient: ``first=False``, shared evenly by every point of the domain equal to it
    (torch's ``amax``, ``max()``); ``first=True``, to the first such point in the domain's
    row-major order (a max pooling's), where ``dims`` are the last dims of the image ``x``.
    """
    dims = sorted({d % x.dim() for d in dims})
    order = None
    if first:
        if dims != list(range(x.dim() - len(dims), x.dim())):
            raise ValueError(f"{name} (domain-parallel): a pooling over the last dims, got "
                             f"{dims} of a {x.dim()}-D tile")
        order = _domain_order(ctx, x, dims, name)
    out: torch.Tensor = _Extreme.apply(  # type: ignore[no-untyped-call]
        x, tuple(dims), keepdim, largest, order, ctx)
    ctx.poolings += 1
    return out


def _domain_order(ctx: DomainContext, x: torch.Tensor, dims: Sequence[int], name: str
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each of ``dims``: this tile's first row in the domain, and the domain's length."""
    split = {x.dim() + d: i for i, d in enumerate(ctx.dims)}
    starts, lengths = [], []
    for d in dims:
        i = split.get(d)
        sizes = (x.shape[d],) if i is None else \
            ctx.sizes_of(i, x.shape[d], f"{name} (domain-parallel)", x.device)
        starts.append(0 if i is None else ctx.owned(i, sizes)[0])
        lengths.append(sum(sizes))
    return tuple(starts), tuple(lengths)


class _Extreme(torch.autograd.Function):
    """The domain's largest or smallest value over some dims (see `extreme_over_domain`).

    Forward: each tile's, then the ranks' (one small all-reduce; a NaN anywhere is the
    result); then either the count of points equal to it (summed over the ranks) or the
    domain index of the first one (the ranks' smallest). The backward needs no
    communication. Differentiable once (a second derivative raises).
    """

    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, dims: tuple[int, ...], keepdim: bool,
                largest: bool, order: tuple[tuple[int, ...], tuple[int, ...]] | None,
                ctx: DomainContext) -> torch.Tensor:
        kept = [1 if d in dims else n for d, n in enumerate(x.shape)]
        if x.numel():
            mine = (x.amax(dims, keepdim=True) if largest else x.amin(dims, keepdim=True))
            mine = mine.double()
        else:  # (an empty tile: nothing of its own, whatever the dtype)
            mine = torch.full(kept, -math.inf if largest else math.inf, dtype=torch.float64,
                              device=x.device)
        # a NaN anywhere is the result, as dense (the all-reduce's max keeps one only where
        # the first rank holds it): a flag beside the value, in the same all-reduce
        nan = x.isnan().any(dims, keepdim=True) if x.numel() and x.is_floating_point() \
            else torch.zeros(kept, dtype=torch.bool, device=x.device)
        sign = 1.0 if largest else -1.0  # (a min keeps -1 where any rank has a NaN)
        both = over_groups(ctx, torch.stack([mine, nan.double() * sign]),
                            "max" if largest else "min")
        best = torch.where(both[1] != 0, math.nan, both[0])
        fctx.dims, fctx.keepdim, fctx.shape, fctx.first = dims, keepdim, x.shape, order
        if order is not None:
            fctx.save_for_backward(*_first_point(x, len(dims), order, best, ctx))
        else:
            hit = x.double() == best
            count = over_groups(ctx, hit.sum(dims, keepdim=True, dtype=torch.float64), "sum")
            fctx.save_for_backward(hit, count)
        out = best.to(x.dtype)
        return out if keepdim else out.squeeze(dims)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError("the domain's largest or smallest value (domain-parallel) is "
                               "differentiable once")
        shape = fctx.shape
        if not fctx.keepdim:
            for d in fctx.dims:
                grad = grad.unsqueeze(d)
        if fctx.first is not None:
            index, held = fctx.saved_tensors
            k = len(fctx.dims)
            lead = grad.reshape(shape[:-k]) * held.to(grad.dtype)
            flat = grad.new_zeros(*shape[:-k], math.prod(shape[-k:]))
            if flat.numel():
                flat.scatter_(-1, index.unsqueeze(-1), lead.unsqueeze(-1))
            gx = flat.view(shape)
        else:
            hit, count = fctx.saved_tensors
            gx = hit.to(grad.dtype) * (grad / count.clamp(min=1).to(grad.dtype))
        return gx, None, None, None, None, None


def _first_point(x: torch.Tensor, k: int, order: tuple[tuple[int, ...], tuple[int, ...]],
                 best: torch.Tensor, ctx: DomainContext) -> tuple[torch.Tensor, torch.Tensor]:
    """This tile's first point equal to ``best`` over its last ``k`` dims: is it the domain's?

    Returns the point's flat index in the tile and the flag, per leading index; "first" is
    in row-major order over the domain, the smallest domain index any rank holds.
    """
    starts, lengths = order
    lead = x.shape[:-k]
    never = float(math.prod(lengths))  # (past every point of the domain)
    if x.numel():
        flat = x.flatten(-k).double()
        hit = flat == best.reshape(*lead, 1)
        index, found = hit.int().argmax(-1), hit.any(-1)  # (its first, or 0)
        where = torch.zeros(lead, dtype=torch.float64, device=x.device)
        rest = index.clone()
        for j in reversed(range(k)):  # (the local coordinates, each moved to the domain's)
            n = x.shape[x.dim() - k + j]
            coord = rest % n + starts[j]
            rest = rest // n
            where = where + coord.double() * math.prod(lengths[j + 1:])
        domain_index = torch.where(found, where, never)
    else:
        index = torch.zeros(lead, dtype=torch.int64, device=x.device)
        domain_index = torch.full(lead, never, dtype=torch.float64, device=x.device)
    first = over_groups(ctx, domain_index, "min")
    return index, (domain_index == first) & (domain_index < never)
