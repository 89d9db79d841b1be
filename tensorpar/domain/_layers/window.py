"""Sliding-window layers over a split domain: convolution, max and average pooling.

Each one fetches the input rows its output tiles need (a halo exchange: the neighbours'
rows, or rows from further away when a tile is narrower than the halo; outside the domain
the padding mode's rows), then runs the dense operation locally with no padding along the
split dims, which yields exactly the output rows this rank owns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tensorpar.comm._compiling import autocast_on
from tensorpar.comm._group import Group
from tensorpar.domain._tiles.ahead import Request
from tensorpar.domain._tiles.layout import DomainContext, anchor_sizes
from tensorpar.domain._tiles.overlap import ONCE, overlap_applies, overlapped_conv
from tensorpar.domain._tiles.rows import RowPlan, assemble, gather_rows, halo_pool, offsets

__all__ = ["EmptyOut", "conv_forward", "fetch_window", "per_dim", "pool_forward",
           "spatial_index", "window_len", "window_plans"]

Window = tuple[int, int, int, int, bool]
"""One spatial dim of a window: (extent - 1, stride, padding before, padding after, ceil)."""


def window_len(n: int, ke: int, s: int, pl: int, pr: int, ceil: bool, where: str) -> int:
    """Outputs of a window of extent ``ke + 1`` and stride ``s`` over ``n`` padded rows."""
    span = n + pl + pr - ke - 1
    if span < 0:
        raise ValueError(f"{where}: the window ({ke + 1} rows with dilation) is larger than "
                         f"the padded domain ({n} + {pl} + {pr} rows)")
    if not ceil:
        return span // s + 1
    m = -(-span // s) + 1
    return m - 1 if (m - 1) * s >= n + pl else m


def spatial_index(ctx: DomainContext, x: torch.Tensor, k: int, where: str) -> list[int]:
    """The spatial index (0..k-1) of each split dim in an input with ``k`` spatial dims."""
    out = []
    for d in ctx.dims:
        j = k + d
        if not 0 <= j < k or x.dim() + d < 1:
            raise ValueError(f"{where}: split dim {d} is not one of the layer's {k} spatial "
                             f"dims (input of shape {tuple(x.shape)})")
        out.append(j)
    return out


Fetch = tuple[int, RowPlan, Group]
"""One split dim's exchange: (the dim counted from the end, this rank's plan, its group)."""


def window_plans(ctx: DomainContext, x: torch.Tensor, k: int, windows: Sequence[Window],
                 mode: str, where: str) -> tuple[list[Fetch], list[int]]:
    """The exchanges that give this rank the input rows its output windows cover.

    Returns one `Fetch` per split dim (applied in order: later dims exchange the rows
    earlier ones added, which brings the corners) and this rank's output rows per split dim.
    """
    js = spatial_index(ctx, x, k, where)
    splits = [ctx.sizes_of(i, x.shape[d], where, x.device) for i, d in enumerate(ctx.dims)]
    fetches, rows = [], []
    for i, (d, j, sizes_in) in enumerate(zip(ctx.dims, js, splits, strict=False)):
        ke, s, pl, pr, ceil = windows[j]
        m = window_len(sum(sizes_in), ke, s, pl, pr, ceil, where)
        shift = pl - ke // 2  # anchor(o) = o * s - shift (the window's centre row)

        def natural(sizes_in: Sequence[int] = sizes_in, m: int = m, s: int = s,
                    shift: int = shift) -> tuple[int, ...]:
            return anchor_sizes(sizes_in, m, lambda b: -(-(b + shift) // s))
        sizes_out = ctx.out_sizes(i, m, natural)
        oo, oi = offsets(sizes_out), offsets(sizes_in)
        wants = [((oo[p] * s - pl, (oo[p + 1] - 1) * s - pl + ke + 1) if sizes_out[p]
                  else (oi[p], oi[p])) for p in range(len(sizes_in))]
        g = ctx.groups[i]
        fetches.append((d, ctx.plan(sizes_in, wants, g.rank, mode), g))
        rows.append(sizes_out[g.rank])
    return fetches, rows


def fetch_window(ctx: DomainContext, x: torch.Tensor, k: int, windows: Sequence[Window],
                 mode: str, fill: float, where: str) -> tuple[torch.Tensor, list[int]]:
    """Gather the rows of every split dim that this rank's output windows cover.

    Returns the extended tile and this rank's output rows along each split dim.
    """
    fetches, rows = window_plans(ctx, x, k, windows, mode, where)
    for d, plan, g in fetches:
        x = gather_rows(x, x.dim() + d, plan, g, fill)
    return x, rows


class EmptyOut(torch.autograd.Function):
    """An output with no rows that keeps its inputs in the graph (zero gradients).

    A rank that owns no output rows must still run the backward of the exchanges that fed
    the layer (its rows may be in another rank's halo), and its parameters get a zero
    gradient like every other rank's.
    """

    @staticmethod
    def forward(ctx: Any, shape: tuple[int, ...], *deps: torch.Tensor | None) -> torch.Tensor:
        """Zeros of ``shape``, joined to ``deps`` (the layer's input, then its parameters)."""
        ctx.specs = [None if t is None else (t.shape, t.dtype, t.device) for t in deps]
        ctx.save_for_backward(*deps)  # (as the dense layer saves them: a second backward
        # links to them)
        first = next(t for t in deps if t is not None)
        return first.new_zeros(shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Zero gradients for every input (the backward of the exchanges still runs).

        Under ``create_graph`` they are joined to ``g`` and to the layer's input and
        weight (times zero), as a peer's input gradient is through torch's double
        backward of the layer even where ``g`` is a constant (a loss linear in the output):
        a gradient penalty's second backward runs through this rank's exchanges, the
        input's halo included, as through its peers'.
        """
        link = None
        if torch.is_grad_enabled():
            # (g has no element: its sum is an exact zero; the others' sums are made zeros)
            # (not a bias: torch's double backward of the layer gives it no gradient)
            parts = [t.sum() * 0 for t in (g, *ctx.saved_tensors[:2])
                     if t is not None and t.requires_grad]
            link = sum(parts[1:], parts[0]) if parts else None
        return (None, *[None if s is None else _zeros(s, link) for s in ctx.specs])


def _zeros(spec: tuple[torch.Size, torch.dtype, torch.device], link: torch.Tensor | None
           ) -> torch.Tensor:
    zeros = torch.zeros(spec[0], dtype=spec[1], device=spec[2])
    return zeros if link is None else zeros + link.to(spec[1])


def _pads(module: Any, k: int) -> list[tuple[int, int]]:
    """Each spatial dim's (before, after) padding of a convolution."""
    ke = [d * (kk - 1) for d, kk in zip(module.dilation, module.kernel_size, strict=False)]
    if module.padding == "same":
        return [(e // 2, e - e // 2) for e in ke]
    if module.padding == "valid":
        return [(0, 0)] * k
    return [(p, p) for p in module.padding]


def conv_forward(module: Any, ctx: DomainContext, x: torch.Tensor) -> torch.Tensor:
    """A ``ConvNd`` on this rank's tile: halo rows in, this rank's output rows out."""
    if ctx.dense:
        return type(module).forward(module, x)  # type: ignore[no-any-return]
    k = len(module.kernel_size)
    where = f"{type(module).__name__} (domain-parallel)"
    pads = _pads(module, k)
    ke = [d * (kk - 1) for d, kk in zip(module.dilation, module.kernel_size, strict=False)]
    windows = [(ke[j], module.stride[j], *pads[j], False) for j in range(k)]
    mode = module.padding_mode
    js = spatial_index(ctx, x, k, where)
    split = set(js)
    rest = [(0, 0) if j in split else pads[j] for j in range(k)]
    fetches, rows = window_plans(ctx, x, k, windows, mode, where)
    arrived = _sent_ahead(ctx, x, (k, tuple(windows), mode), fetches, where)
    # (autocast: the overlapped backward would mix the input's dtype with the output's)
    if ctx.fast and len(fetches) == 1 and rows[0] and all(a == b for a, b in rest) and \
            (mode == "zeros" or not any(a for a, _ in rest)) and \
            not autocast_on(x.device.type):
        d, plan, g = fetches[0]
        if overlap_applies(plan, ke[js[0]], module.stride[js[0]]):
            return overlapped_conv(x, module.weight, module.bias, x.dim() + d, plan, g,
                                   ke[js[0]], (module.stride, tuple(a for a, _ in rest),
                                               module.dilation, module.groups), arrived)
    if arrived is not None:
        d, plan, _ = fetches[0]
        x = assemble(x, x.dim() + d, plan, halo_pool(x, x.dim() + d, plan, arrived, 0.0))
        fetches = []
    for d, plan, g in fetches:
        x = gather_rows(x, x.dim() + d, plan, g, 0.0)
    if 0 in rows:
        shape = list(x.shape[:-k])
        shape[-1] = module.out_channels
        for j in range(k):
            n = x.shape[x.dim() - k + j]
            shape.append(rows[js.index(j)] if j in split else
                         window_len(n, ke[j], module.stride[j], *pads[j], False, where))
        out: torch.Tensor = EmptyOut.apply(  # type: ignore[no-untyped-call]
            tuple(shape), x, module.weight, module.bias)
        return _first_order(ctx, out)
    conv = getattr(F, f"conv{k}d")
    if mode == "zeros" and all(a == b for a, b in rest):
        y: torch.Tensor = conv(x, module.weight, module.bias, module.stride,
                               tuple(a for a, _ in rest), module.dilation, module.groups)
        return _first_order(ctx, y)
    spec = [v for a, b in reversed(rest) for v in (a, b)]
    if any(spec):
        x = F.pad(x, spec, mode="constant" if mode == "zeros" else mode)
    y = conv(x, module.weight, module.bias, module.stride, 0, module.dilation, module.groups)
    return _first_order(ctx, y)


def _first_order(ctx: DomainContext, y: torch.Tensor) -> torch.Tensor:
    """``y``, refusing a second derivative as the overlapped path does (fast mode only).

    Which path a rank takes depends on its tile (an empty or a narrow one takes this one):
    a rank that went on into its exchanges would wait there for peers that had refused.
    A hook, not a Function: ``y`` stays a tensor of its own, which an in-place layer
    after it (``ReLU(inplace=True)``) may change.
    """
    if ctx.fast and y.requires_grad:
        y.register_hook(_refuse_create_graph)
    return y


def _refuse_create_graph(g: torch.Tensor) -> None:
    if torch.is_grad_enabled():  # create_graph=True: a second derivative will be asked for
        raise RuntimeError(ONCE)


def _sent_ahead(ctx: DomainContext, x: torch.Tensor, request: Request, fetches: list[Fetch],
                where: str) -> torch.Tensor | None:
    """The halo rows of ``x`` a norm sent ahead for this convolution (`ahead`), if any."""
    if len(fetches) != 1:
        return None
    d, plan, _ = fetches[0]
    arrived = ctx.ahead.take(x, request, plan.exchange)
    if arrived is not None and arrived.shape[x.dim() + d] != sum(plan.recv_counts):
        raise RuntimeError(f"{where}: {arrived.shape[x.dim() + d]} halo rows were sent ahead "
                           f"where {sum(plan.recv_counts)} were expected")
    return arrived


def per_dim(v: Any, k: int) -> tuple[int, ...]:
    """``v`` for each of ``k`` dims (an int repeated, or a tuple/list as it is)."""
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * k


def pool_forward(module: Any, ctx: DomainContext, x: torch.Tensor) -> torch.Tensor:
    """``MaxPoolNd`` / ``AvgPoolNd`` on this rank's tile (same scheme as `conv_forward`)."""
    if ctx.dense:
        return type(module).forward(module, x)  # type: ignore[no-any-return]
    name = type(module).__name__
    k = int(name[-2])
    where = f"{name} (domain-parallel)"
    is_max = name.startswith("Max")
    ksz = per_dim(module.kernel_size, k)
    stride = per_dim(module.stride or module.kernel_size, k)
    pad = per_dim(module.padding, k)
    dil = per_dim(getattr(module, "dilation", 1), k)
    ceil = bool(module.ceil_mode)
    ke = [dl * (kk - 1) for dl, kk in zip(dil, ksz, strict=False)]
    windows = [(ke[j], stride[j], pad[j], pad[j], ceil) for j in range(k)]
    js = spatial_index(ctx, x, k, where)
    splits = [ctx.sizes_of(i, x.shape[d], where, x.device) for i, d in enumerate(ctx.dims)]
    x, rows = fetch_window(ctx, x, k, windows, "zeros", float("-inf") if is_max else 0.0, where)
    local_pad = tuple(0 if j in js else pad[j] for j in range(k))
    if 0 in rows:
        shape = list(x.shape[:-k])
        for j in range(k):
            shape.append(rows[js.index(j)] if j in js else window_len(
                x.shape[x.dim() - k + j], ke[j], stride[j], pad[j], pad[j], ceil, where))
        empty: torch.Tensor = EmptyOut.apply(tuple(shape), x)  # type: ignore[no-untyped-call]
        return empty
    if is_max:
        pooled: torch.Tensor = getattr(F, f"max_pool{k}d")(x, ksz, stride, local_pad, dil,
                                                           ceil_mode=ceil)
        return pooled
    avg = getattr(F, f"avg_pool{k}d")
    extra = {} if k == 1 else {"divisor_override": module.divisor_override}
    y: torch.Tensor = avg(x, ksz, stride, local_pad, ceil, module.count_include_pad, **extra)
    if k > 1 and module.divisor_override:
        return y
    # the local windows all have k rows along a split dim; torch divides by the padded
    # (count_include_pad) or the in-domain rows of each window
    for i, (d, j) in enumerate(zip(ctx.dims, js, strict=False)):
        n = sum(splits[i])
        start = ctx.owned(i, _out(ctx, i, n, windows[j], where))[0]
        o = torch.arange(start, start + rows[i], dtype=torch.float64)
        lo = o * stride[j] - pad[j]
        hi = torch.clamp(lo + ksz[j], max=n + pad[j])
        div = hi - lo if module.count_include_pad else \
            torch.clamp(hi, max=n) - torch.clamp(lo, min=0)
        scale = (ksz[j] / div).to(y.dtype).to(y.device)
        shape = [1] * y.dim()
        shape[y.dim() + d] = rows[i]
        y = y * scale.view(shape)
    return y


def _out(ctx: DomainContext, i: int, n: int, w: Window, where: str) -> tuple[int, ...]:
    m = window_len(n, w[0], w[1], w[2], w[3], w[4], where)
    return ctx.layouts[i][m]
