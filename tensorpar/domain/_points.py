"""Which dims of a reshaped tile hold the split dims' points.

A tile with the image's dims holds the split dims where the image does. A model may
reshape it (``x.flatten(2).transpose(1, 2)``: tokens of ``(B, h * w, C)``), and then a
reduction or an attention along the tokens would see the tile's points alone. So the
functional-call conversion follows the dims through the reshapes it can read (`follow`:
flatten, view and reshape, transpose, permute, movedim, unsqueeze, squeeze, and calls that
keep the dims, such as a linear layer over the channels) and refuses, on a reshaped tile:

- a reduction, softmax, sort or scan along a dim holding points (`split_dims_reduced`),
- a product of two tiles that pairs every point with every other point
  (``q @ k.transpose(-2, -1)``: attention scores over the tile alone) or sums over their
  points (`pairs_points`).

Reductions along other dims (``x.mean(-1)`` over an unsplit W) are followed too, so that
one done in steps (``x.mean(-1).mean(-1)``) is still seen along the points, and so is
``einsum`` (`einsum_points`: its subscripts name the dims).

What it cannot read (a reshape that splits a dim holding points into several, a call
that changes the number of dims otherwise) leaves the dims unknown: nothing is refused
on that tensor, and the docs say so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Points", "after_reduction", "einsum_points", "follow", "pairs_points",
           "reduced_dims", "regroups"]

Points = frozenset[int]

_DIM_AT: dict[str, tuple[int, int | tuple[int, ...] | None]] = {
    **{name: (1, None) for name in (
        "sum", "nansum", "mean", "nanmean", "prod", "amax", "amin", "aminmax", "max", "min",
        "std", "var", "var_mean", "std_mean", "logsumexp", "median", "nanmedian", "argmax",
        "argmin", "softmax", "log_softmax", "cumsum", "cumprod", "cummax", "cummin",
        "logcumsumexp", "count_nonzero", "all", "any")},
    **{name: (1, -1) for name in ("mode", "sort", "argsort")},
    **{name: (2, None) for name in ("norm", "linalg_vector_norm", "linalg_norm", "quantile",
                                    "nanquantile")},
    **{name: (2, -1) for name in ("kthvalue", "topk", "diff")},
    "normalize": (2, 1), "linalg_matrix_norm": (2, (-2, -1))}
"""Calls along dims: the position of ``dim`` among the arguments, and its default."""
_WHOLE = frozenset({
    "sum", "nansum", "mean", "nanmean", "prod", "amax", "amin", "aminmax", "max", "min",
    "std", "var", "var_mean", "std_mean", "median", "nanmedian", "argmax", "argmin", "norm",
    "linalg_vector_norm", "linalg_norm", "quantile", "nanquantile", "count_nonzero", "all",
    "any"})
"""Those that reduce the whole tensor where no dim is given."""


def follow(func: Any, args: Sequence[Any], kwargs: dict[str, Any], src: Points,
           in_shape: Sequence[int], out: torch.Tensor) -> Points | None:
    """The dims of ``out`` holding points, for ``func`` applied to a tile (``None``: unknown).

    ``src``: the dims of the call's first argument, of shape ``in_shape``, holding points.
    """
    name = getattr(func, "__name__", "")
    n_in, n_out = len(in_shape), out.dim()
    rest = args[1:]
    if name == "flatten":
        start = _arg(rest, kwargs, 0, "start_dim", 0) % max(n_in, 1)
        end = _arg(rest, kwargs, 1, "end_dim", -1) % max(n_in, 1)
        return _moved(src, lambda d: d if d < start else start if d <= end
                      else d - (end - start))
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = (_arg(rest, kwargs, i, k, None) for i, k in ((0, "dim0"), (1, "dim1")))
        if a is None or b is None:
            return None
        a, b = a % n_in, b % n_in
        return _moved(src, lambda d: b if d == a else a if d == b else d)
    if name == "permute":
        order = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        order = [o % n_in for o in (order or kwargs.get("dims", ()))]
        return frozenset(order.index(d) for d in src) if len(order) == n_in else None
    if regroups(func, n_in, n_out):
        return _regrouped(src, in_shape, out.shape)
    if name == "unsqueeze":
        at = _arg(rest, kwargs, 0, "dim", 0) % (n_in + 1)
        return _moved(src, lambda d: d if d < at else d + 1)
    if name == "squeeze" and n_out < n_in:
        gone = [d for d in range(n_in) if in_shape[d] == 1 and d not in src]
        kept = [d for d in range(n_in) if d not in gone]
        return frozenset(kept.index(d) for d in src) if len(kept) == n_out else None
    if name in ("movedim", "moveaxis"):
        order = list(range(n_in))
        a, b = _arg(rest, kwargs, 0, "source", None), _arg(rest, kwargs, 1, "destination", None)
        if not isinstance(a, int) or not isinstance(b, int):
            return None
        order.insert(b % n_in, order.pop(a % n_in))
        return frozenset(order.index(d) for d in src)
    if (dims := reduced_dims(func, args, kwargs, n_in)) is not None:
        return after_reduction(src, dims, n_in, n_out)
    if n_out == n_in and not _reshapes(name):
        return src  # the dims kept in place (pointwise, a linear layer over channels)
    return None


def reduced_dims(func: Any, args: Sequence[Any], kwargs: dict[str, Any], ndim: int
                 ) -> frozenset[int] | None:
    """The dims a call along dims works on (every dim: the whole tensor; ``None``: not one).

    ``torch.max(x, y)`` (a tensor where the dim goes) is elementwise: ``None``.
    """
    name = getattr(func, "__name__", "")
    if name not in _DIM_AT:
        return None
    at, default = _DIM_AT[name]
    dim = args[at] if len(args) > at else kwargs.get("dim", default)
    if dim is None or isinstance(dim, bool):  # (``x.var(False)``: unbiased, the whole)
        return frozenset(range(ndim)) if name in _WHOLE else None
    if isinstance(dim, int) and not isinstance(dim, bool):
        dim = (dim,)
    if not isinstance(dim, (tuple, list)) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in dim):
        return None
    if not dim:  # ``x.sum(())``, ``x.mean([])``: the whole tensor
        return frozenset(range(ndim)) if name in _WHOLE else None
    return frozenset(d % max(ndim, 1) for d in dim)


def after_reduction(src: Points, dims: frozenset[int], n_in: int, n_out: int
                    ) -> Points | None:
    """The dims holding points after a reduction along ``dims`` (none of them)."""
    if dims & src:
        return None  # (along the points: converted or refused before it runs)
    if n_out == n_in:  # ``keepdim``, or a softmax or a scan
        return src
    if n_out == n_in - len(dims):
        return _moved(src, lambda d: d - sum(1 for r in dims if r < d))
    return None


def einsum_points(args: Sequence[Any], points: Callable[[Any], Points | None]
                  ) -> tuple[Points | None, bool]:
    """``einsum``'s output dims holding points, and whether it pairs or sums over them.

    ``points(t)``: the dims of the tile ``t`` holding points (``None``: not a tile, or not
    known). A subscript at a dim holding points names the points; an output that lacks
    one sums over them, and two tiles whose points have different subscripts pair every
    point with every other (``"bchw,bdgw->bcdhg"``). ``(None, False)`` where the
    subscripts are not read (an ellipsis, operands as a list).
    """
    if len(args) < 2 or not isinstance(args[0], str) or "..." in args[0] \
            or "->" not in args[0]:
        return None, False
    inputs, output = args[0].replace(" ", "").split("->")
    subscripts = inputs.split(",")
    if len(subscripts) != len(args) - 1:
        return None, False
    named: list[set[str]] = []
    for sub, t in zip(subscripts, args[1:], strict=True):
        held = points(t)
        if held is not None and isinstance(t, torch.Tensor) and len(sub) == t.dim():
            named.append({sub[d] for d in held})
    if not named:
        return None, False
    every = set().union(*named)
    refused = any(n != named[0] for n in named) or not every <= set(output)
    return frozenset(output.index(s) for s in every if s in output), refused


def regroups(func: Any, n_in: int, n_out: int) -> bool:
    """Whether `follow` reads ``func``'s dims from the sizes.

    The sizes differ between ranks: the caller agrees on the result.
    """
    name = getattr(func, "__name__", "")
    return (name in ("view", "reshape") and n_out != n_in) or name == "unflatten"


def pairs_points(args: Sequence[Any], points: Sequence[Points | None]) -> bool:
    """Whether a product of two tiles pairs their points, or sums over them.

    ``points``: the dims holding points of ``args[0]`` and ``args[1]`` (``None``: unknown).
    ``a @ b`` keeps ``a``'s rows and ``b``'s columns (attention scores where both hold
    points) and sums over ``a``'s columns and ``b``'s rows (a partial sum over the tile's
    points where both hold them, such as linear attention's ``k.transpose(-2, -1) @ v``).
    """
    if len(points) < 2 or points[0] is None or points[1] is None:
        return False
    a, b = args[0], args[1]
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) \
            or a.dim() < 2 or b.dim() < 2:
        return False
    return (a.dim() - 2 in points[0] and b.dim() - 1 in points[1]) or \
        (a.dim() - 1 in points[0] and b.dim() - 2 in points[1])


def _arg(rest: Sequence[Any], kwargs: dict[str, Any], i: int, key: str, default: Any) -> Any:
    return rest[i] if len(rest) > i else kwargs.get(key, default)


def _moved(src: Points, where: Any) -> Points:
    return frozenset(where(d) for d in src)


def _reshapes(name: str) -> bool:
    return name in ("view", "reshape", "view_as", "reshape_as", "unflatten")


def _regrouped(src: Points, in_shape: Sequence[int], out_shape: Sequence[int]
               ) -> Points | None:
    """Points after a reshape: an output dim made of input dims holding points holds them.

    Unknown where a dim holding points is split into several (which part holds them?).
    """
    out: set[int] = set()
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        gi, gj = [i], [j]
        pi, pj = in_shape[i], out_shape[j]
        while pi != pj:
            if pi < pj:
                i += 1
                if i >= len(in_shape):
                    return None
                gi.append(i)
                pi *= in_shape[i]
            else:
                j += 1
                if j >= len(out_shape):
                    return None
                gj.append(j)
                pj *= out_shape[j]
        held = [d for d in gi if d in src and in_shape[d] != 1]
        if held:
            if len([d for d in gj if out_shape[d] != 1]) > 1:
                return None
            out.update(d for d in gj if out_shape[d] != 1)
        i, j = i + 1, j + 1
    return frozenset(out)
