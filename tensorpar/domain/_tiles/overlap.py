"""A convolution on a strip computed while its halo rows travel, with no copy.

Forward: post the halo exchange, convolve the tile itself with zero padding along the split
dim (as many rows as the lower halo on each side), wait, and add the halo rows' share to the
first and last output rows. A convolution is linear in its input, so that share is the
convolution, without bias, of the halo rows beside zeros standing for the tile (a band as
thin as the halo; `Bands` says where). Backward, the mirror: the bands' gradients first
(the halo rows' gradient, sent back to their owners while the tile's backward runs, and the
weight's share); what arrives is added to the rows it belongs to. Neither direction copies
a tile or an output: the general path joins the halo to the tile.

Used by `conv_forward` for strips (one split dim), zero padding on the other dims, tiles
longer than the kernel's extent, and any stride where the padded tile yields exactly this
rank's output rows (`overlap_applies`: padding ``"same"`` of an odd kernel, or a strided
down-sampling); otherwise the general path runs. Differentiable once:
``parallelize_domain(..., double_backward=True)`` keeps the general path, which double
backward goes through.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from tensorpar.comm._group import Group
from tensorpar.domain._tiles.rows import (
    RowPlan,
    halo_pool,
    row_index,
    start_exchange,
    validate_exchange,
    validate_rows,
)

__all__ = ["ONCE", "overlapped_conv", "overlap_applies"]

# the default mode's convolutions refuse a second derivative, whichever path they took
ONCE = ("a domain-parallel convolution is differentiable once by default (it computes while "
        "its halo travels); for double backward convert the model with "
        "parallelize_domain(..., double_backward=True)")


class Bands(NamedTuple):
    """Where the halo rows reach in the output of the tile's own convolution.

    The tile is convolved with ``lo`` rows of zero padding on each side (``hi <= lo`` halo
    rows above it; padding past them is never read). Output rows ``[0, top)`` read the
    lower halo: their band is the ``lo`` halo rows, then ``top_zeros`` zero rows. Output
    rows ``[bottom, rows)`` read the upper halo: ``bottom_zeros`` zero rows, then the ``hi``
    halo rows.
    """

    lo: int
    hi: int
    rows: int
    top: int
    top_zeros: int
    bottom: int
    bottom_zeros: int


def bands(plan: RowPlan, ke: int, stride: int) -> Bands | None:
    """The bands of this rank's convolution (``None``: the overlapped path does not fit)."""
    n, lo, hi = plan.n_in, len(plan.lower), len(plan.upper)
    if plan.run != (0, n) or n <= ke or hi > lo:
        return None
    rows = (n + lo + hi - ke - 1) // stride + 1
    if (n + 2 * lo - ke - 1) // stride + 1 != rows:  # the padding past the halo adds rows
        return None
    top = -(-lo // stride)
    bottom = max(0, -(-(lo + n - ke) // stride)) if hi else rows
    b = Bands(lo, hi, rows, top, (top - 1) * stride + ke + 1 - lo if top else 0,
              bottom, lo + n - bottom * stride if hi else 0)
    return b if b.top_zeros >= 0 and b.bottom_zeros >= 0 else None


def overlap_applies(plan: RowPlan, ke: int, stride: int) -> bool:
    """Whether this rank's exchange fits the overlapped path.

    Ranks may decide differently: both paths send the same rows in the same exchange.
    """
    return bands(plan, ke, stride) is not None


def overlapped_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    dim: int, plan: RowPlan, group: Group, ke: int,
                    conv: tuple[Any, ...], arrived: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """``conv(window)`` where the window is ``x`` with its halo rows along ``dim``.

    ``conv`` is ``(stride, padding, dilation, groups)`` for ``F.convNd`` with no padding
    along ``dim`` (a non-negative dim); `overlap_applies` holds. ``arrived``: the rows the
    exchange would bring, already here (sent ahead, `tensorpar.domain._tiles.ahead`): no
    exchange either way, their gradient is theirs.
    """
    if x.dim() == weight.dim() - 1:  # unbatched: torch's convolution backward wants a batch
        return overlapped_conv(x.unsqueeze(0), weight, bias, dim + 1, plan, group, ke, conv,
                               None if arrived is None else arrived.unsqueeze(0)).squeeze(0)
    out: torch.Tensor = _HaloConv.apply(x, weight, bias, dim, plan, group, ke,  # type: ignore[no-untyped-call]
                                        conv, arrived)
    return out


def _axis(x: torch.Tensor, w: torch.Tensor, dim: int) -> int:
    """The spatial axis (0 for the first spatial dim) of tensor dim ``dim``, batched or not."""
    return dim - (x.dim() - (w.dim() - 2))


def _padded(conv: tuple[Any, ...], axis: int, rows: int) -> tuple[Any, ...]:
    """``conv`` with ``rows`` of zero padding on each side of spatial axis ``axis``."""
    stride, padding, dilation, groups = conv
    padding = list(padding)
    padding[axis] = rows
    return stride, tuple(padding), dilation, groups


def _conv_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, has_bias: bool,
                   conv: tuple[Any, ...], mask: list[bool]) -> tuple[Any, Any, Any]:
    stride, padding, dilation, groups = conv
    k = w.dim() - 2
    return torch.ops.aten.convolution_backward(  # type: ignore[no-any-return]
        g, x, w, [w.shape[0]] if has_bias else None, list(stride), list(padding),
        list(dilation), False, [0] * k, groups, mask)


def _band_inputs(x: torch.Tensor, below: torch.Tensor | None, above: torch.Tensor | None,
                 dim: int, b: Bands) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The halo rows beside rows of zeros standing for the tile (``None``: no halo)."""
    def beside(halo: torch.Tensor | None, zeros: int, first: bool) -> torch.Tensor | None:
        if halo is None:
            return None
        shape = list(x.shape)
        shape[dim] = zeros
        pad = x.new_zeros(shape)
        return torch.cat([halo, pad] if first else [pad, halo], dim)
    return beside(below, b.top_zeros, True), beside(above, b.bottom_zeros, False)


def _band_grads(gy: torch.Tensor, band: torch.Tensor | None, start: int, rows: int, dim: int,
                w: torch.Tensor, conv: tuple[Any, ...], mask: list[bool]
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A band's input and weight gradients from output rows ``[start, start + rows)``."""
    if band is None:
        return None, None
    g_in, g_w, _ = _conv_backward(gy.narrow(dim, start, rows).contiguous(), band, w, False,
                                  conv, mask)
    return g_in, g_w


def _real(rows: tuple[int, ...], plan: RowPlan) -> bool:
    """Whether any of these halo rows is data (not only the zero fill row)."""
    fill = sum(plan.recv_counts) + len(plan.self_idx) if plan.fill else -1
    return any(i != fill for i in rows)


class _HaloConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dim: int,
                plan: RowPlan, group: Group, ke: int, conv: tuple[Any, ...],
                given: torch.Tensor | None) -> torch.Tensor:
        validate_rows(x, dim, plan, group, backward=False)
        axis = _axis(x, w, dim)
        geo = bands(plan, ke, conv[0][axis])
        assert geo is not None, "overlapped_conv called where overlap_applies does not hold"
        work = None
        ctx.sent_ahead = given is not None and plan.exchange
        if plan.exchange and given is None:
            sent = x.index_select(dim, row_index(plan.send_idx, x))
            arrived, work = start_exchange(sent, dim, plan.send_counts, plan.recv_counts,
                                            group)
        fconv = getattr(F, f"conv{w.dim() - 2}d")
        # the tile with zeros for its halo, while the halo travels
        y: torch.Tensor = fconv(x, w, b, *_padded(conv, axis, geo.lo))
        if work is not None:
            work.wait()
            given = arrived.movedim(0, dim)
        pool = halo_pool(x, dim, plan, given, 0.0)
        below = pool.index_select(dim, row_index(plan.lower, x)) \
            if pool is not None and _real(plan.lower, plan) else None
        above = pool.index_select(dim, row_index(plan.upper, x)) \
            if pool is not None and _real(plan.upper, plan) else None
        top, bottom = _band_inputs(x, below, above, dim, geo)
        if top is not None:  # the halo rows' share of the first and last output rows
            y.narrow(dim, 0, geo.top).add_(fconv(top, w, None, *conv))
        if bottom is not None:
            y.narrow(dim, geo.bottom, geo.rows - geo.bottom).add_(
                fconv(bottom, w, None, *conv))
        ctx.save_for_backward(x, w, below, above)  # only the halo rows beside the tile
        ctx.args = (dim, axis, plan, group, geo, conv, b is not None)
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: a second derivative will be asked for
            raise RuntimeError(ONCE)
        return _backward(ctx, gy)


def _backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, w, below, above = ctx.saved_tensors
    dim, axis, plan, group, geo, conv, has_bias = ctx.args
    top, bottom = _band_inputs(x, below, above, dim, geo)
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_given = ctx.sent_ahead and ctx.needs_input_grad[8]
    gy = gy.contiguous()
    # the bands first: their halo rows' gradient travels while the tile's backward runs
    band_mask = [need_x or need_given, need_w, False]
    top_in, top_w = _band_grads(gy, top, 0, geo.top, dim, w, conv, band_mask)
    bottom_in, bottom_w = _band_grads(gy, bottom, geo.bottom, geo.rows - geo.bottom, dim, w,
                                      conv, band_mask)
    work = None
    if need_x or need_given:
        window = list(x.shape)  # what the general path's backward fingerprints
        window[dim] = plan.n_out
        validate_exchange(torch.Size(window), x.dtype, dim, plan, group, backward=True)
        n_recv, n_self = sum(plan.recv_counts), len(plan.self_idx)
        shape = list(x.shape)
        shape[dim] = n_recv + n_self + int(plan.fill)
        pool = x.new_zeros(shape)  # the halo rows' gradients, by where they came from
        if top_in is not None:
            pool.index_add_(dim, row_index(plan.lower, x), top_in.narrow(dim, 0, geo.lo))
        if bottom_in is not None:
            pool.index_add_(dim, row_index(plan.upper, x),
                            bottom_in.narrow(dim, geo.bottom_zeros, geo.hi))
        if plan.exchange and not ctx.sent_ahead:
            back, work = start_exchange(pool.narrow(dim, 0, n_recv), dim,
                                         plan.recv_counts, plan.send_counts, group)
    gx, gw, gb = _conv_backward(gy, x, w, has_bias, _padded(conv, axis, geo.lo),
                                [need_x, need_w, need_b and has_bias])
    for band_w in (top_w, bottom_w):
        if band_w is not None:
            gw = gw + band_w
    if need_x and gx is not None:
        if n_self:
            gx.index_add_(dim, row_index(plan.self_idx, x), pool.narrow(dim, n_recv, n_self))
        if work is not None:
            work.wait()
            gx.index_add_(dim, row_index(plan.send_idx, x), back.movedim(0, dim))
    # rows sent ahead: their gradient goes home with them (the sender's exchange)
    g_given = pool.narrow(dim, 0, n_recv) if need_given else None
    return gx, gw, gb, None, None, None, None, None, g_given
