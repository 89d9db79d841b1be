"""A stride-1 convolution on a strip whose interior is computed while its halo rows travel.

The output rows of a strip split three ways: those whose windows lie inside the tile (the
interior: a convolution of the tile itself with no padding along the split dim), and a
thin band at each end whose windows reach into the halo. Forward: post the halo exchange,
convolve the interior, wait, convolve the two bands (halo rows joined to the tile's first
or last ``ke`` rows) and join the three outputs. Backward, the mirror: the bands' input
gradients first; their halo part goes back to the owning ranks while the interior's
backward runs; what arrives is added to the rows it belongs to. Neither direction copies
the whole input tile (the general path joins the halo to it, and in the backward adds the
gradient back into a fresh tile).

Used by `conv_forward` for strips (one split dim), stride 1 along it, zero padding on the
other dims, and tiles longer than the kernel's extent on every rank; otherwise the general
path runs. Differentiable once: ``parallelize_domain(..., double_backward=True)`` keeps the
general path, which double backward goes through.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tensorpar.comm._group import Group
from tensorpar.domain._rows import RowPlan, row_index, start_exchange, validate_rows

__all__ = ["overlapped_conv", "overlap_applies"]


def overlap_applies(plan: RowPlan, ke: int, stride: int) -> bool:
    """Whether this rank's exchange fits the overlapped path.

    Ranks may decide differently: both paths send the same rows in the same exchange.
    """
    return stride == 1 and plan.n_in > ke and plan.run == (0, plan.n_in)


def overlapped_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    dim: int, plan: RowPlan, group: Group, ke: int,
                    conv: tuple[Any, ...]) -> torch.Tensor:
    """``conv(window)`` where the window is ``x`` with its halo rows along ``dim``.

    ``conv`` is ``(stride, padding, dilation, groups)`` for ``F.convNd`` with no padding
    along ``dim`` (a non-negative dim).
    """
    out: torch.Tensor = _HaloConv.apply(x, weight, bias, dim, plan, group, ke,  # type: ignore[no-untyped-call]
                                        conv)
    return out


def _conv_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, has_bias: bool,
                   conv: tuple[Any, ...], mask: list[bool]) -> tuple[Any, Any, Any]:
    stride, padding, dilation, groups = conv
    k = w.dim() - 2
    return torch.ops.aten.convolution_backward(  # type: ignore[no-any-return]
        g, x, w, [w.shape[0]] if has_bias else None, list(stride), list(padding),
        list(dilation), False, [0] * k, groups, mask)


def _bands(x: torch.Tensor, below: torch.Tensor | None, above: torch.Tensor | None, dim: int,
           ke: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The inputs of the two end bands: halo rows joined to the tile's first/last ke rows."""
    n = x.shape[dim]
    top = torch.cat([below, x.narrow(dim, 0, ke)], dim) if below is not None else None
    bottom = torch.cat([x.narrow(dim, n - ke, ke), above], dim) if above is not None else None
    return top, bottom


class _HaloConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dim: int,
                plan: RowPlan, group: Group, ke: int, conv: tuple[Any, ...]) -> torch.Tensor:
        validate_rows(x, dim, plan, group, backward=False)
        lo = len(plan.lower)
        work = None
        if plan.exchange:
            sent = x.index_select(dim, row_index(plan.send_idx, x))
            arrived, work = start_exchange(sent, dim, plan.send_counts, plan.recv_counts,
                                            group)
        fconv = getattr(F, f"conv{w.dim() - 2}d")
        y_mid = fconv(x, w, b, *conv)  # the interior, while the halo rows travel
        pieces = []
        if work is not None:
            work.wait()
            pieces.append(arrived.movedim(0, dim))
        if plan.self_idx:
            pieces.append(x.index_select(dim, row_index(plan.self_idx, x)))
        if plan.fill:
            shape = list(x.shape)
            shape[dim] = 1
            pieces.append(x.new_zeros(shape))
        pool = torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0] if pieces else x
        below = pool.index_select(dim, row_index(plan.lower, x)) if lo else None
        above = pool.index_select(dim, row_index(plan.upper, x)) if plan.upper else None
        top, bottom = _bands(x, below, above, dim, ke)
        y_top = [fconv(top, w, b, *conv)] if top is not None else []
        y_bottom = [fconv(bottom, w, b, *conv)] if bottom is not None else []
        y = torch.cat([*y_top, y_mid, *y_bottom], dim)
        ctx.save_for_backward(x, w, below, above)  # only the halo rows beside the tile
        ctx.args = (dim, plan, group, ke, conv, b is not None)
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: a second derivative will be asked for
            raise RuntimeError(
                "a domain-parallel convolution computed while its halo travelled is "
                "differentiable once; for double backward convert the model with "
                "parallelize_domain(..., double_backward=True)")
        return _backward(ctx, gy)


def _backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, w, below, above = ctx.saved_tensors
    dim, plan, group, ke, conv, has_bias = ctx.args
    top, bottom = _bands(x, below, above, dim, ke)
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    n, lo, hi = x.shape[dim], len(plan.lower), len(plan.upper)
    gy = gy.contiguous()
    g_top, g_mid, g_bottom = gy.split([lo, n - ke, hi], dim)
    mask = [need_x, need_w, need_b and has_bias]
    bands = [(g_top, top), (g_bottom, bottom)]
    band_grads: list[tuple[Any, Any, Any]] = [
        _conv_backward(g.contiguous(), t, w, has_bias, conv, mask) if t is not None
        else (None, None, None) for g, t in bands]
    work = None
    if need_x:
        validate_rows(gy, dim, plan, group, backward=True)
        n_recv, n_self = sum(plan.recv_counts), len(plan.self_idx)
        shape = list(x.shape)
        shape[dim] = n_recv + n_self + int(plan.fill)
        pool = x.new_zeros(shape)  # the halo rows' gradients, by where they came from
        g_top_in, g_bottom_in = band_grads[0][0], band_grads[1][0]
        if lo:
            pool.index_add_(dim, row_index(plan.lower, x), g_top_in.narrow(dim, 0, lo))
        if hi:
            pool.index_add_(dim, row_index(plan.upper, x), g_bottom_in.narrow(dim, ke, hi))
        if plan.exchange:
            back, work = start_exchange(pool.narrow(dim, 0, n_recv), dim,
                                         plan.recv_counts, plan.send_counts, group)
    gx, gw, gb = _conv_backward(g_mid.contiguous(), x, w, has_bias, conv, mask)
    for gw_band, gb_band in ((bg[1], bg[2]) for bg in band_grads):
        if gw_band is not None:
            gw = gw + gw_band
        if gb_band is not None:
            gb = gb + gb_band
    if need_x:
        if lo:
            gx.narrow(dim, 0, ke).add_(g_top_in.narrow(dim, lo, ke))
        if hi:
            gx.narrow(dim, n - ke, ke).add_(g_bottom_in.narrow(dim, 0, ke))
        if n_self:
            gx.index_add_(dim, row_index(plan.self_idx, x), pool.narrow(dim, n_recv, n_self))
        if work is not None:
            work.wait()
            gx.index_add_(dim, row_index(plan.send_idx, x), back.movedim(0, dim))
    return gx, gw, gb, None, None, None, None, None
