"""Normalisation over a split domain: statistics over every rank's points, like dense.

Mean and variance are two passes of float64 sums all-reduced over the domain (the mean
first, then the squared deviations from it: no cancellation; the tile itself stays in its
dtype), with the all-reduce's
backward summing the gradients, so each tile's gradient includes what its points do to the
statistics seen by every other tile. BatchNorm's running statistics are updated once per
forward, identically on every rank, as dense.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.domain._layers.fused_norm import RowsAhead, fused_norm
from tensorpar.domain._layers.window import window_plans
from tensorpar.domain._tiles.ahead import Request, Rows, Source
from tensorpar.domain._tiles.layout import DomainContext
from tensorpar.domain._tiles.marks import UNREAD
from tensorpar.domain._tiles.sums import global_count, sum_over_domain

__all__ = ["FUNCTIONAL", "batch_norm_forward", "functional_norm", "group_norm_forward",
           "instance_norm_forward", "layer_norm_forward"]


def moments(ctx: DomainContext, x: torch.Tensor, dims: list[int], where: str
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Centred ``x``, mean and biased variance over ``dims`` of the whole domain.

    The sums are float64 (``sum(dtype=)``: no float64 copy of the tile is kept for the
    backward); the centred tile stays in ``x``'s dtype. Mean and variance keep ``dims``.
    """
    count = global_count(ctx, x, dims, where)
    mean = sum_over_domain(ctx, x.sum(dims, keepdim=True, dtype=torch.float64)) / count
    centred = x - mean.to(x.dtype)
    var = sum_over_domain(ctx, (centred * centred).sum(dims, keepdim=True,
                                                       dtype=torch.float64)) / count
    return centred, mean, var, count


def _normalize(centred: torch.Tensor, var: torch.Tensor, eps: float) -> torch.Tensor:
    return centred * torch.rsqrt(var + eps).to(centred.dtype)


def _channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.view(1, -1, *([1] * (x.dim() - 2)))


def _split_dims_in(ctx: DomainContext, x: torch.Tensor, dims: list[int]) -> bool:
    return any(x.dim() + d in dims for d in ctx.dims)


def _reshaped(ctx: DomainContext, x: torch.Tensor, dims: list[int], where: str) -> bool:
    """Whether ``x`` is a reshaped tile whose points lie outside the statistics' ``dims``.

    Such a norm (a LayerNorm over the channels of tokens) is the dense one. ``False`` for
    a tile with the image's layout (converted as such).

    Raises:
        ValueError: the statistics would take in a reshaped tile's points (or where they
            lie is not known): not converted. The marks are the same on every rank, so
            every rank raises.
    """
    held = ctx.marks.points(x)
    if held is None:
        return False
    if held == UNREAD or held & set(dims):
        raise ValueError(
            f"{where}: its statistics over dims {dims} of a reshaped tile (of shape "
            f"{tuple(x.shape)}) would take in the split dims' points, which lie in "
            f"{'dims not known' if held == UNREAD else f'dims {sorted(held)}'}: not "
            f"converted. Normalise the image-shaped tile (before the reshape, or after "
            f"reshaping it back)")
    return True


def batch_norm_forward(module: Any, ctx: DomainContext, x: torch.Tensor) -> torch.Tensor:
    """``BatchNormNd``: batch statistics over the whole domain; running stats updated once."""
    batch_stats = module.training or module.running_mean is None
    if ctx.dense or not batch_stats:
        return type(module).forward(module, x)  # type: ignore[no-any-return]
    where = f"{type(module).__name__} (domain-parallel)"
    dims = [0, *range(2, x.dim())]
    if _reshaped(ctx, x, dims, where):
        return type(module).forward(module, x)  # type: ignore[no-any-return]
    if ctx.fast:  # one exchange each way, torch's kernel (see _fused_norm)
        count = global_count(ctx, x, dims, where)
        sending = _rows_ahead(ctx, module, x, where)
        y, mean, var, rows = fused_norm(ctx, x.reshape(x.shape[0], x.shape[1], -1),
                                        module.weight, module.bias, module.eps, count,
                                        ahead=sending[1])
        _update_running(module, mean, var, count)
        return _offer(ctx, x, y, rows, sending)
    centred, mean, var, count = moments(ctx, x, dims, where)
    _update_running(module, mean, var, count)
    y = _normalize(centred, var, module.eps)
    if module.affine:
        y = y * _channel(module.weight, x) + _channel(module.bias, x)
    return y


Sending = tuple[Source, RowsAhead | None, Request | None]
"""A norm call, the halo rows it sends with its statistics, and the request they answer."""


def _rows_ahead(ctx: DomainContext, module: Any, x: torch.Tensor, where: str) -> Sending:
    """This norm call, and the halo rows of ``x`` it sends with its statistics (see `ahead`).

    Those of the window a convolution fed by this call's output asked for in an earlier
    forward, over strips split along the first spatial dim. Every rank decides alike.
    """
    source = ctx.ahead.source(module)
    window = ctx.ahead.request(source)
    if window is None or not ctx.strips or x.dim() + ctx.dims[0] != 2 or \
            x.dim() - 2 != window[0]:
        return source, None, None
    length = math.prod(x.shape[3:])
    (_, plan, _), = window_plans(ctx, x, window[0], window[1], window[2], where)[0]
    if not plan.exchange or not length:
        return source, None, None
    return source, RowsAhead(plan, length), window


def _offer(ctx: DomainContext, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
           sending: Sending) -> torch.Tensor:
    """``y`` in ``x``'s shape, recorded as a norm call's output (with its rows, if sent)."""
    out = y.view(x.shape)
    source, ahead, window = sending
    if ctx.strips:
        arrived = None if ahead is None else rows.view(
            *x.shape[:2], rows.shape[-1] // ahead.length, *x.shape[3:])
        ctx.ahead.offer(out, Rows(arrived, window, source, out._version))
    return out


def _update_running(module: Any, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
    """BatchNorm's running statistics, once per forward, as dense."""
    if module.training and module.track_running_stats:
        with torch.no_grad():
            module.num_batches_tracked.add_(1)
            f = 1.0 / float(module.num_batches_tracked) if module.momentum is None \
                else module.momentum
            unbiased = var * (count / max(count - 1, 1))
            module.running_mean.mul_(1 - f).add_(mean.flatten().to(module.running_mean), alpha=f)
            module.running_var.mul_(1 - f).add_(unbiased.flatten().to(module.running_var),
                                                alpha=f)


def group_norm_forward(module: Any, ctx: DomainContext, x: torch.Tensor) -> torch.Tensor:
    """``GroupNorm``: each (sample, group)'s statistics over the whole domain."""
    where = "GroupNorm (domain-parallel)"
    if ctx.dense or _reshaped(ctx, x, list(range(1, x.dim())), where) or \
            not _split_dims_in(ctx, x, list(range(2, x.dim()))):
        return type(module).forward(module, x)  # type: ignore[no-any-return]
    n, c = x.shape[0], x.shape[1]
    g = module.num_groups
    xg = x.reshape(n, g, c // g, *x.shape[2:])
    if ctx.fast:
        count = global_count(ctx, xg, list(range(2, xg.dim())), where)
        w, b = (module.weight.repeat(n), module.bias.repeat(n)) if module.affine \
            else (None, None)
        sending = _rows_ahead(ctx, module, x, where)
        y, _, _, rows = fused_norm(ctx, x.reshape(1, n * c, -1), w, b, module.eps, count,
                                   c // g, sending[1])
        return _offer(ctx, x, y, rows, sending)
    # split dims keep their (negative) position in the grouped view
    centred, _, var, _ = moments(ctx, xg, list(range(2, xg.dim())), where)
    y = _normalize(centred, var, module.eps).reshape(x.shape)
    if module.affine:
        y = y * _channel(module.weight, x) + _channel(module.bias, x)
    return y


def instance_norm_forward(module: Any, ctx: DomainContext, x: torch.Tensor) -> torch.Tensor:
    """``InstanceNormNd`` (no running statistics): each (sample, channel) over the domain."""
    where = f"{type(module).__name__} (domain-parallel)"
    if not ctx.dense and x.dim() == _spatial_dims(module) + 1:  # no batch dim: (C, *points)
        return instance_norm_forward(module, ctx, x.unsqueeze(0)).squeeze(0)
    if ctx.dense or _reshaped(ctx, x, list(range(2, x.dim())), where):
        return type(module).forward(module, x)  # type: ignore[no-any-return]
    if ctx.fast:
        count = global_count(ctx, x, list(range(2, x.dim())), where)
        n = x.shape[0]
        w, b = (module.weight.repeat(n), module.bias.repeat(n)) if module.affine \
            else (None, None)
        sending = _rows_ahead(ctx, module, x, where)
        y, _, _, rows = fused_norm(ctx, x.reshape(1, n * x.shape[1], -1), w, b, module.eps,
                                   count, ahead=sending[1])
        return _offer(ctx, x, y, rows, sending)
    centred, _, var, _ = moments(ctx, x, list(range(2, x.dim())), where)
    y = _normalize(centred, var, module.eps)
    if module.affine:
        y = y * _channel(module.weight, x) + _channel(module.bias, x)
    return y


def _spatial_dims(module: Any) -> int:
    """The spatial dims an ``InstanceNormNd`` takes (its N)."""
    for k, kind in ((1, nn.InstanceNorm1d), (2, nn.InstanceNorm2d), (3, nn.InstanceNorm3d)):
        if isinstance(module, kind):
            return k
    return -2  # (another kind: never taken for an unbatched input)


def layer_norm_forward(module: Any, ctx: DomainContext, x: torch.Tensor) -> torch.Tensor:
    """``LayerNorm``: over its normalised dims; a split one among them sums over the domain.

    The weight and bias cover the whole domain: a rank uses its rows of them (and gets
    their gradient; the other rows' gradient is zero there and summed in from their owner).
    """
    k = len(module.normalized_shape)
    dims = list(range(x.dim() - k, x.dim()))
    where = "LayerNorm (domain-parallel)"
    if ctx.dense or _reshaped(ctx, x, dims, where) or not _split_dims_in(ctx, x, dims):
        return type(module).forward(module, x)  # type: ignore[no-any-return]
    centred, _, var, _ = moments(ctx, x, dims, where)
    y = _normalize(centred, var, module.eps)
    w, b = module.weight, getattr(module, "bias", None)
    for i, d in enumerate(ctx.dims):
        if x.dim() + d in dims:
            start, end = ctx.owned(i, ctx.sizes_of(i, x.shape[d], where, x.device))
            w = None if w is None else w.narrow(k + d, start, end - start)
            b = None if b is None else b.narrow(k + d, start, end - start)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


FUNCTIONAL = {
    F.group_norm: ("input", "num_groups", "weight", "bias", "eps"),
    F.instance_norm: ("input", "running_mean", "running_var", "weight", "bias",
                      "use_input_stats", "momentum", "eps"),
    F.batch_norm: ("input", "running_mean", "running_var", "weight", "bias", "training",
                   "momentum", "eps"),
    F.layer_norm: ("input", "normalized_shape", "weight", "bias", "eps")}
"""Functional norms: their arguments' names."""


class _FunctionalNorm:
    """A functional norm's arguments as its layer's attributes; ``forward`` calls it."""

    def __init__(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any],
                 attrs: dict[str, Any]) -> None:
        self.call, self.args, self.kwargs = func, args, kwargs
        self.num_groups: int = 0  # (F.group_norm's)
        self.__dict__.update(attrs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The call as written (where nothing is split along its statistics' dims)."""
        out: torch.Tensor = self.call(x, *self.args[1:], **self.kwargs)
        return out


def functional_norm(ctx: DomainContext, func: Any, x: torch.Tensor, args: Sequence[Any],
                     kwargs: dict[str, Any]) -> torch.Tensor:
    """A functional norm of a tile: its tile of the dense result, or an error.

    ``F.group_norm`` and ``F.instance_norm``: statistics over the domain, as their layers'
    (the forwards above). ``F.batch_norm`` in training and ``F.layer_norm`` over a dim that
    may hold the split points raise (their layers convert); with fixed statistics, or over
    other dims, they run as they are.
    """
    given = dict(zip(FUNCTIONAL[func], args, strict=False)) | kwargs
    name = func.__name__
    weight, bias = given.get("weight"), given.get("bias")
    channels = x.shape[1] if x.dim() > 1 else 0
    if weight is not None or bias is not None:  # (one alone: the other is the identity's)
        weight = weight if weight is not None else x.new_ones(channels)
        bias = bias if bias is not None else x.new_zeros(channels)
    attrs = {"weight": weight, "bias": bias, "affine": weight is not None,
             "eps": given.get("eps", 1e-5)}
    layer = _FunctionalNorm(func, args, kwargs, attrs)
    if func is F.group_norm:
        layer.num_groups = given["num_groups"]
        return group_norm_forward(layer, ctx, x)
    if func is F.instance_norm:
        if not given.get("use_input_stats", True):
            return layer.forward(x)  # (fixed statistics: point by point)
        if given.get("running_mean") is not None:
            raise ValueError(f"{name} (domain-parallel): running statistics updated from a "
                             f"tile are not converted; use nn.InstanceNorm without "
                             f"track_running_stats, or running_mean=None")
        return instance_norm_forward(layer, ctx, x)
    if func is F.batch_norm and not given.get("training", False):
        return layer.forward(x)  # (running statistics: point by point)
    held = ctx.marks.points(x)  # (not known: any dim may hold the points)
    points = {x.dim() + d for d in ctx.dims} if held is None and x.dim() == ctx.ndim \
        else set(range(x.dim())) if held is None or held == UNREAD else set(held)
    shape = given.get("normalized_shape", ())
    over = set(range(x.dim() - len(shape), x.dim())) if func is F.layer_norm \
        else {0, *range(2, x.dim())}
    if func is F.layer_norm and not over & points:
        return layer.forward(x)  # (over the channels of tokens)
    layer_name = "nn.LayerNorm" if func is F.layer_norm else "nn.BatchNorm"
    raise ValueError(f"{name} (domain-parallel) of a tile: its statistics would be the "
                     f"tile's alone; use its layer ({layer_name}), which is converted, or "
                     f"normalise dims without the split points")
