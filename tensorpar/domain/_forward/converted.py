"""Functional calls on tiles converted as their layers would be.

``F.pad``, ``F.interpolate``, the functional convolutions and poolings (with their halos,
as their layers), a global pooling written as ``F.adaptive_avg_pool2d(x, 1)``, the
functional group and instance norms (`norms.functional_norm`) and the pixel shuffles.
`calls` hands them here while a converted model runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tensorpar.domain._forward.following import refuse_unless_image
from tensorpar.domain._layers import norms, pad
from tensorpar.domain._layers.resample import interpolate, tile_sizes_to_domain
from tensorpar.domain._layers.shuffle import pixel_shuffle
from tensorpar.domain._layers.window import conv_forward, per_dim, pool_forward
from tensorpar.domain._tiles.layout import DomainContext
from tensorpar.domain._tiles.marks import TILE
from tensorpar.domain._tiles.sums import extreme_over_domain, over_domain

__all__ = ["CONVERTED", "NOT_CONVERTED", "convert"]

NOT_CONVERTED = object()
"""What `convert` returns for a call it leaves as it is."""


def convert(ctx: DomainContext, func: Any, args: Sequence[Any], kwargs: dict[str, Any],
            tiled: bool) -> Any:
    """``func`` (one of `CONVERTED`) on a tile, converted; `NOT_CONVERTED` if it runs as is.

    ``tiled``: the call's input is a tile or made before the global pooling (not a
    constant made after it): the stencils, norms and shuffles are converted only then; a
    pad, an interpolation and a global pooling whenever `calls` hands them here.
    """
    x = args[0] if args else kwargs.get("input")
    if isinstance(x, torch.Tensor) and ctx.marks.kind_of(x) == TILE and \
            func not in norms.FUNCTIONAL:  # (the norms read a reshaped tile's points)
        refuse_unless_image(ctx, x, getattr(func, "__name__", str(func)))
    if func is F.pad:
        pads = dict(zip(("pad", "mode", "value"), args[1:], strict=False))
        pads.update({n: kwargs[n] for n in ("pad", "mode", "value") if n in kwargs})
        return pad.pad(ctx, args[0] if args else kwargs["input"], **pads)
    if func in _ADAPTIVE:  # a global pooling written as a call
        size = args[1] if len(args) > 1 else kwargs["output_size"]
        k, largest = _ADAPTIVE[func]
        if any(s != 1 for s in (size if isinstance(size, (tuple, list)) else (size,) * k)):
            raise ValueError(f"{func.__name__} (domain-parallel): only output size 1 (the "
                             f"whole domain's) is converted, got {size!r}")
        if (args[2] if len(args) > 2 else kwargs.get("return_indices")) or \
                func in _WITH_INDICES:
            raise ValueError(f"{func.__name__} (domain-parallel): the indices would be "
                             f"the tile's; a pooling without indices is converted")
        x = args[0] if args else kwargs["input"]
        dims = range(x.dim() - k, x.dim())
        with ctx.own_calls():
            if largest:
                return extreme_over_domain(ctx, x, dims, func.__name__, first=True)
            return over_domain(ctx, x, dims, func.__name__)
    if func in _WITH_INDICES and tiled:
        raise ValueError(f"{func.__name__} (domain-parallel): the indices would be the "
                         f"tile's; max pooling without indices is converted")
    if (func in _CONVS or func in _POOLS) and tiled:
        layer = _as_layer(func, args, kwargs)  # a stencil: with its halo
        with ctx.own_calls():
            return (conv_forward if func in _CONVS else pool_forward)(layer, ctx, args[0])
    if func in norms.FUNCTIONAL and tiled:
        x = args[0] if args else kwargs["input"]
        with ctx.own_calls():
            return norms.functional_norm(ctx, func, x, args, kwargs)
    if func in _SHUFFLES and tiled:
        up = func is F.pixel_shuffle
        given = dict(zip(("input", "factor"), args, strict=False)) | kwargs
        factor = given["factor" if "factor" in given else
                       "upscale_factor" if up else "downscale_factor"]
        with ctx.own_calls():
            return pixel_shuffle(ctx, given["input"], int(factor), up=up)
    if func is F.interpolate:
        names = ("size", "scale_factor", "mode", "align_corners", "recompute_scale_factor")
        call = dict(zip(names, args[1:], strict=False))
        call.update({n: kwargs[n] for n in names if n in kwargs})
        if kwargs.get("antialias"):
            raise ValueError("interpolate (domain-parallel): antialias=True is not "
                             "supported over a split domain")
        x = args[0] if args else kwargs["input"]
        call["size"] = tile_sizes_to_domain(ctx, x, call.get("size"), "interpolate "
                                            "(domain-parallel)")
        return interpolate(ctx, x, **call)
    return NOT_CONVERTED


class _Functional:
    """A functional convolution's or pooling's arguments as its layer's attributes.

    Made by `_as_layer` with a class of the layer's name (the converted forwards read the
    dims and the kind from it).
    """

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.__dict__.update(attrs)


_LAYER_TYPES: dict[str, type[_Functional]] = {}


def _as_layer(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> _Functional:
    """``F.conv2d(x, w, ...)``, ``F.max_pool2d(x, 2)``... as the layer that would do it."""
    names = ("input", *_CONVS.get(func, _POOLS.get(func, ("", 0, ())))[2])
    given = dict(zip(names, args, strict=False)) | kwargs
    if func in _CONVS:
        k = _CONVS[func][1]
        weight = given["weight"]
        padding = given.get("padding", 0)
        attrs = {"weight": weight, "bias": given.get("bias"),
                 "stride": per_dim(given.get("stride", 1), k),
                 "padding": padding if isinstance(padding, str) else per_dim(padding, k),
                 "dilation": per_dim(given.get("dilation", 1), k),
                 "groups": given.get("groups", 1), "padding_mode": "zeros",
                 "kernel_size": tuple(weight.shape[2:]), "out_channels": weight.shape[0]}
        name = f"Conv{k}d"
    else:
        kind, k, _ = _POOLS[func]
        if given.get("return_indices"):
            raise ValueError(f"{func.__name__} (domain-parallel): return_indices=True (the "
                             f"indices would be the tile's)")
        attrs = {"kernel_size": given["kernel_size"], "stride": given.get("stride"),
                 "padding": given.get("padding", 0), "dilation": given.get("dilation", 1),
                 "ceil_mode": given.get("ceil_mode", False),
                 "count_include_pad": given.get("count_include_pad", True),
                 "divisor_override": given.get("divisor_override")}
        name = f"{kind}{k}d"
    layer_type = _LAYER_TYPES.setdefault(name, type(name, (_Functional,), {}))
    return layer_type(attrs)


_CONV_ARGS = ("weight", "bias", "stride", "padding", "dilation", "groups")
_MAX_ARGS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_AVG_ARGS = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
             "divisor_override")
_CONVS: dict[Any, tuple[str, int, tuple[str, ...]]] = {
    F.conv1d: ("Conv", 1, _CONV_ARGS), F.conv2d: ("Conv", 2, _CONV_ARGS),
    F.conv3d: ("Conv", 3, _CONV_ARGS)}
_POOLS: dict[Any, tuple[str, int, tuple[str, ...]]] = {
    F.max_pool1d: ("MaxPool", 1, _MAX_ARGS), F.max_pool2d: ("MaxPool", 2, _MAX_ARGS),
    F.max_pool3d: ("MaxPool", 3, _MAX_ARGS), F.avg_pool1d: ("AvgPool", 1, _AVG_ARGS),
    F.avg_pool2d: ("AvgPool", 2, _AVG_ARGS), F.avg_pool3d: ("AvgPool", 3, _AVG_ARGS)}
"""Functional convolutions and poolings, converted on tiles as their layers."""
_WITH_INDICES = frozenset({F.max_pool1d_with_indices, F.max_pool2d_with_indices,
                           F.max_pool3d_with_indices, F.adaptive_max_pool1d_with_indices,
                           F.adaptive_max_pool2d_with_indices,
                           F.adaptive_max_pool3d_with_indices})
_ADAPTIVE = {F.adaptive_avg_pool1d: (1, False), F.adaptive_avg_pool2d: (2, False),
             F.adaptive_avg_pool3d: (3, False), F.adaptive_max_pool1d: (1, True),
             F.adaptive_max_pool2d: (2, True), F.adaptive_max_pool3d: (3, True),
             F.adaptive_max_pool1d_with_indices: (1, True),
             F.adaptive_max_pool2d_with_indices: (2, True),
             F.adaptive_max_pool3d_with_indices: (3, True)}
"""Global poolings written as calls: their spatial dims, and whether they take the max."""
_SHUFFLES = frozenset({F.pixel_shuffle, F.pixel_unshuffle})
CONVERTED = frozenset({F.pad, F.interpolate, *norms.FUNCTIONAL, *_ADAPTIVE, *_WITH_INDICES,
                       *_CONVS, *_POOLS, *_SHUFFLES})
"""The calls converted on tiles (each a branch of `convert`)."""
