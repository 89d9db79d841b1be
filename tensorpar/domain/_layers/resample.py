"""Resolution-changing layers over a split domain, and ``F.interpolate`` calls converted.

The layers: up-sampling, transposed convolution, global average pooling.

Up-sampling finds, for each output row, its source rows and weights by running torch's own
1-D interpolation on the row numbers (so scale factors, ``align_corners`` and rounding are
torch's), fetches the source rows of the output rows this rank owns, and interpolates one
dim after the other (separable, as torch's kernels are).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tensorpar.comm._comm import exchange_ints
from tensorpar.domain._layers.window import EmptyOut, spatial_index
from tensorpar.domain._tiles.layout import DomainContext, anchor_sizes
from tensorpar.domain._tiles.rows import gather_rows, offsets
from tensorpar.domain._tiles.sums import extreme_over_domain, over_domain

__all__ = ["MODES", "conv_transpose_forward", "global_pool_forward", "interpolate",
           "tile_sizes_to_domain", "upsample_forward"]

MODES = ("nearest", "nearest-exact", "linear", "bilinear", "trilinear")


def _per_dim(v: Any, k: int) -> list[Any]:
    if v is None:
        return [None] * k
    return list(v) if isinstance(v, (tuple, list)) else [v] * k


def _sources(ctx: DomainContext, n: int, size: int | None, scale: float | None, mode: str,
             align_corners: bool | None, recompute: bool | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each output row's source rows ``i0``, ``i1`` and weight of ``i1`` (None: nearest)."""
    rows = torch.arange(n, dtype=torch.float64).view(1, 1, n)
    nearest = mode.startswith("nearest")
    kw: dict[str, Any] = {"size": size} if size is not None else \
        {"scale_factor": scale, "recompute_scale_factor": recompute}
    if not nearest:
        kw["align_corners"] = align_corners
    with ctx.own_calls():
        pos = F.interpolate(rows, mode=mode if nearest else "linear", **kw)[0, 0]
    if nearest:
        i0 = pos.round().long()
        return i0, i0, None
    i0 = pos.floor().clamp(0, max(n - 1, 0)).long()
    lam = pos - i0
    return i0, (i0 + 1).clamp(max=max(n - 1, 0)), lam


def _power_of_two_ratio(out: int, n: int) -> int:
    """``out / n`` where it is a power of two (1, 2, 4, ...), else 0."""
    if n <= 0 or out % n:
        return 0
    r = out // n
    return r if r & (r - 1) == 0 else 0


def tile_sizes_to_domain(ctx: DomainContext, x: torch.Tensor, size: Any, where: str) -> Any:
    """``F.interpolate``'s ``size`` in a forward, as the domain's sizes.

    A size a forward reads from a tensor (``size=x.shape[-2:]``) is its tile's. Along each
    split dim every rank's requested size is gathered (one small all-gather): sizes that
    differ between ranks are tiles, and so is a size every rank asks for that is every
    tile's size in a split of this forward (an even split); either way the output is split
    as asked. Otherwise it is the whole domain's size (a constant).
    """
    if size is None or x.dim() < 3:
        return size
    k = x.dim() - 2
    sizes = _per_dim(size, k)
    js = spatial_index(ctx, x, k, where)
    for i, (j, g) in enumerate(zip(js, ctx.groups, strict=True)):
        if g.is_single or sizes[j] is None:
            continue
        every = tuple(r[0] for r in exchange_ints(g, [int(sizes[j])], x.device))
        table = ctx.layouts[i]
        if len(set(every)) == 1 and table.get(len(every) * every[0]) != every:
            continue  # the same size on every rank, no tile's: the domain's
        total = sum(every)
        if table.setdefault(total, every) != every:
            raise RuntimeError(f"{where}: the tiles ask for {list(every)} rows along dim "
                               f"{ctx.dims[i]}, which is not this forward's split of {total} "
                               f"rows, {list(table[total])}")
        sizes[j] = total
    return sizes if isinstance(size, (tuple, list, torch.Size)) else sizes[0]


def interpolate(ctx: DomainContext, x: torch.Tensor, size: Any = None, scale_factor: Any = None,
                mode: str = "nearest", align_corners: bool | None = None,
                recompute_scale_factor: bool | None = None) -> torch.Tensor:
    """``F.interpolate`` of this rank's tile: this rank's rows of the dense result."""
    where = f"interpolate(mode={mode!r}) (domain-parallel)"
    if mode not in MODES:
        raise ValueError(f"{where}: mode {mode!r} is not supported over a split domain "
                         f"(supported: {', '.join(MODES)})")
    k = x.dim() - 2
    js = spatial_index(ctx, x, k, where)
    sizes, scales = _per_dim(size, k), _per_dim(scale_factor, k)
    splits = [ctx.sizes_of(i, x.shape[d], where, x.device) for i, d in enumerate(ctx.dims)]
    picks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    for j in range(k):
        n = sum(splits[js.index(j)]) if j in js else x.shape[2 + j]
        picks.append(_sources(ctx, n, sizes[j], scales[j], mode, align_corners,
                              recompute_scale_factor))
    ratios = [_power_of_two_ratio(picks[j][0].numel(), sum(splits[js.index(j)]) if j in js
                                  else x.shape[2 + j]) for j in range(k)]
    whole = mode != "nearest-exact" and not align_corners and all(ratios)
    crops = []
    for i, (d, j) in enumerate(zip(ctx.dims, js, strict=False)):
        i0, i1, lam = picks[j]
        sizes_in = splits[i]
        m = i0.numel()

        def natural(sizes_in: Sequence[int] = sizes_in, m: int = m, i0: torch.Tensor = i0
                    ) -> tuple[int, ...]:
            return anchor_sizes(sizes_in, m,
                                lambda row: int(torch.searchsorted(i0, row, side="left")))
        sizes_out = ctx.out_sizes(i, m, natural)
        oo, oi = offsets(sizes_out), offsets(sizes_in)
        wants = [(int(i0[oo[p]]), int(i1[oo[p + 1] - 1]) + 1) if sizes_out[p]
                 else (oi[p], oi[p]) for p in range(len(sizes_in))]
        g = ctx.groups[i]
        x = gather_rows(x, x.dim() + d, ctx.plan(sizes_in, wants, g.rank, "zeros"), g)
        a, b = oo[g.rank], oo[g.rank + 1]
        first = wants[g.rank][0]
        picks[j] = (i0[a:b] - first, i1[a:b] - first, None if lam is None else lam[a:b])
        crops.append((x.dim() + d, a - ratios[j] * first, b - a))
    if whole and all(x.shape[dim] for dim, _, _ in crops):
        # A power-of-two scale maps the window's rows exactly as the domain's (the source
        # position of output o is (o + 0.5) / s - 0.5 in both, shifted by the window's first
        # row, and the window holds every source row the kept outputs read): torch's own
        # kernel on the window, then the rows this rank owns.
        with ctx.own_calls():
            y = F.interpolate(x, scale_factor=[float(r) for r in ratios], mode=mode,
                              align_corners=align_corners)
        for dim, start, rows in crops:
            y = y.narrow(dim, start, rows)
        return y
    for j, (i0, i1, lam) in enumerate(picks):
        dim = 2 + j
        lo = x.index_select(dim, i0.to(x.device))
        if lam is None:
            x = lo
            continue
        shape = [1] * x.dim()
        shape[dim] = lam.numel()
        w = lam.to(x.dtype).to(x.device).view(shape)
        x = lo * (1 - w) + x.index_select(dim, i1.to(x.device)) * w
    return x


def upsample_forward(module: Any, ctx: DomainContext, x: torch.Tensor) -> torch.Tensor:
    """``nn.Upsample`` on this rank's tile."""
    if ctx.dense:
        return type(module).forward(module, x)  # type: ignore[no-any-return]
    return interpolate(ctx, x, module.size, module.scale_factor, module.mode,
                       module.align_corners, module.recompute_scale_factor)


def conv_transpose_forward(module: Any, ctx: DomainContext, x: torch.Tensor) -> torch.Tensor:
    """``ConvTransposeNd`` on this rank's tile.

    The input rows whose outputs land on this rank's output rows, a local transposed
    convolution, then a crop (and the bias).
    """
    if ctx.dense:
        return type(module).forward(module, x)  # type: ignore[no-any-return]
    name = type(module).__name__
    where = f"{name} (domain-parallel)"
    k = len(module.kernel_size)
    js = spatial_index(ctx, x, k, where)
    splits = [ctx.sizes_of(i, x.shape[d], where, x.device) for i, d in enumerate(ctx.dims)]
    crops = []
    for i, (d, j) in enumerate(zip(ctx.dims, js, strict=False)):
        s, p = module.stride[j], module.padding[j]
        ke = module.dilation[j] * (module.kernel_size[j] - 1)
        sizes_in = splits[i]
        m = (sum(sizes_in) - 1) * s - 2 * p + ke + module.output_padding[j] + 1
        shift = p - ke // 2  # anchor(o) = (o + shift) // s

        def natural(sizes_in: Sequence[int] = sizes_in, m: int = m, s: int = s,
                    shift: int = shift) -> tuple[int, ...]:
            return anchor_sizes(sizes_in, m, lambda b: b * s - shift)
        sizes_out = ctx.out_sizes(i, m, natural)
        oo, oi = offsets(sizes_out), offsets(sizes_in)
        wants = []
        for q in range(len(sizes_in)):
            if not sizes_out[q]:
                wants.append((oi[q], oi[q]))
                continue
            g0 = -((ke - oo[q] - p) // s)  # ceil((o0 + p - ke) / s)
            wants.append((g0, max((oo[q + 1] - 1 + p) // s + 1, g0 + 1)))
        g = ctx.groups[i]
        x = gather_rows(x, x.dim() + d, ctx.plan(sizes_in, wants, g.rank, "zeros"), g)
        crops.append((wants[g.rank][0] * s - p, oo[g.rank], sizes_out[g.rank]))
    if any(c[2] == 0 for c in crops):
        shape = [*x.shape[:-k - 1], module.out_channels]
        for j in range(k):
            if j in js:
                shape.append(crops[js.index(j)][2])
            else:
                n = x.shape[x.dim() - k + j]
                shape.append((n - 1) * module.stride[j] - 2 * module.padding[j]
                             + module.dilation[j] * (module.kernel_size[j] - 1)
                             + module.output_padding[j] + 1)
        out: torch.Tensor = EmptyOut.apply(  # type: ignore[no-untyped-call]
            tuple(shape), x, module.weight, module.bias)
        return out
    pad = tuple(0 if j in js else module.padding[j] for j in range(k))
    opad = tuple(0 if j in js else module.output_padding[j] for j in range(k))
    transpose = getattr(F, f"conv_transpose{k}d")
    y: torch.Tensor = transpose(x, module.weight, None, module.stride, pad, opad, module.groups,
                                module.dilation)
    for (start, o0, rows), d in zip(crops, ctx.dims, strict=True):
        dim = y.dim() + d
        before, after = start - o0, o0 + rows - (start + y.shape[dim])
        if before > 0 or after > 0:  # output rows no input reaches (a stride above the kernel)
            spec = [0, 0] * (y.dim() - dim - 1) + [max(before, 0), max(after, 0)]
            y = F.pad(y, spec)
            start -= max(before, 0)
        y = y.narrow(dim, o0 - start, rows)
    if module.bias is not None:
        y = y + module.bias.view(1, -1, *([1] * k))
    return y


def global_pool_forward(module: Any, ctx: DomainContext, x: torch.Tensor) -> torch.Tensor:
    """``AdaptiveAvgPoolNd`` / ``AdaptiveMaxPoolNd`` to size 1, over the whole domain.

    The mean, or the largest value (its gradient to the first point holding it, in the
    domain's row-major order, as dense), on every rank. The result is replicated (every
    rank holds it whole) and what follows runs dense. Its gradient passes straight back to
    the tiles (a replicated loss counts once).
    """
    if ctx.dense:
        return type(module).forward(module, x)  # type: ignore[no-any-return]
    name = type(module).__name__
    k = int(name[-2])
    dims = range(x.dim() - k, x.dim())
    if name.startswith("AdaptiveMax"):
        return extreme_over_domain(ctx, x, dims, name, first=True)
    return over_domain(ctx, x, dims, name)
