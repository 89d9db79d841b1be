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

A reshape that splits a dim holding points into several (tokens back to an image, an
image cut into windows) is read from the dim's `Block`: where the split rows lie in it.
What it cannot read (a split that cuts the split rows themselves, a dim whose block is not
known, a call that changes the number of dims otherwise) leaves the dims unknown; the
caller marks what a reshape the ranks cannot read gives as not followed, and refuses what
would need its points.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["MATMULS", "Block", "Points", "after_reduction", "call_name", "cut_dim", "einsum_args",
           "einsum_points", "einsum_subscripts", "follow", "follow_block", "indexed_dims",
           "pairs_points", "reading_block", "readings", "reduced_dims", "regroups",
           "reshape_groups", "tensordot_free", "tensordot_points"]

Points = frozenset[int]

MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm,
                     torch.Tensor.bmm})
"""Products of two tensors' last two dims (and broadcast batch dims)."""
Block = tuple[int, int]
"""Where the split rows lie in the one dim of a tile that holds them: ``(outer, inner)``,
that dim being ``outer x rows x inner`` in row-major order, with ``outer`` and ``inner``
the same on every rank (unsplit dims merged with it). An image's split dim is ``(1, 1)``;
the tokens ``x.flatten(2)`` of an NCHW tile split along H are ``(1, W)``, along W
``(H, 1)``."""

_KEYWORD = 99  # (a position no call reaches: ``dim`` is a keyword)
_DIM_AT: dict[str, tuple[int, int | tuple[int, ...] | None]] = {
    **{name: (1, None) for name in (
        "sum", "nansum", "mean", "nanmean", "prod", "amax", "amin", "aminmax", "max", "min",
        "std", "var", "var_mean", "std_mean", "logsumexp", "median", "nanmedian", "argmax",
        "argmin", "softmax", "log_softmax", "cumsum", "cumprod", "cummax", "cummin",
        "logcumsumexp", "count_nonzero", "all", "any", "softmin", "special_softmax",
        "special_log_softmax", "special_logsumexp")},
    **{name: (1, -1) for name in ("mode", "sort", "argsort")},
    **{name: (2, None) for name in ("norm", "linalg_vector_norm", "linalg_norm", "quantile",
                                    "nanquantile")},
    **{name: (2, -1) for name in ("kthvalue", "topk", "diff")},
    "normalize": (2, 1), "linalg_matrix_norm": (2, (-2, -1)),
    # along dims and needing all of each: finite differences, integrals, similarities,
    # FFTs, the triangle of the last two dims (``dim`` keyword-only where the position
    # is past any argument)
    "gradient": (_KEYWORD, None), "trapezoid": (_KEYWORD, -1), "trapz": (_KEYWORD, -1),
    "cumulative_trapezoid": (_KEYWORD, -1), "cosine_similarity": (2, 1),
    "pairwise_distance": (_KEYWORD, -1), "tril": (_KEYWORD, (-2, -1)),
    "triu": (_KEYWORD, (-2, -1)),
    # a sort along dim 0, a norm of the whole difference, products summed along a dim,
    # distances between the rows of the last two dims
    "msort": (_KEYWORD, 0), "dist": (_KEYWORD, None), "linalg_vecdot": (_KEYWORD, -1),
    "inner": (_KEYWORD, -1), "cdist": (_KEYWORD, (-2, -1)),
    # a matrix's diagonal summed; covariances between rows over the columns
    "trace": (_KEYWORD, (-2, -1)), "cov": (_KEYWORD, None), "corrcoef": (_KEYWORD, None),
    **{f"fft_{kind}fft": (2, -1) for kind in ("", "i", "r", "ir", "h", "ih")},
    **{f"fft_{kind}fft2": (2, (-2, -1)) for kind in ("", "i", "r", "ir", "h", "ih")},
    **{f"fft_{kind}fftn": (2, None) for kind in ("", "i", "r", "ir", "h", "ih")},
    "fft_fftshift": (1, None), "fft_ifftshift": (1, None)}
"""Calls along dims: the position of ``dim`` among the arguments, and its default."""
_LP_POOLS: dict[Any, int] = {torch.nn.functional.lp_pool1d: 1, torch.nn.functional.lp_pool2d: 2,
                             torch.nn.functional.lp_pool3d: 3}
"""Power-average poolings (not converted): their windows' dims, counted from the last."""
_WHOLE = frozenset({
    "sum", "nansum", "mean", "nanmean", "prod", "amax", "amin", "aminmax", "max", "min",
    "std", "var", "var_mean", "std_mean", "median", "nanmedian", "argmax", "argmin", "norm",
    "linalg_vector_norm", "linalg_norm", "quantile", "nanquantile", "count_nonzero", "all",
    "any", "gradient", "fft_fftshift", "fft_ifftshift", "dist", "cov", "corrcoef",
    *(f"fft_{kind}fftn" for kind in ("", "i", "r", "ir", "h", "ih"))})
"""Those that reduce the whole tensor where no dim is given."""


def call_name(func: Any) -> str:
    """A call's name; for a property's getter (``x.mT``, ``x.T``), the property's."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # (a torch function mode sees ``getset_descriptor.__get__``)
        return str(getattr(getattr(func, "__self__", None), "__name__", name))
    return name


def follow(func: Any, args: Sequence[Any], kwargs: dict[str, Any], src: Points,
           in_shape: Sequence[int], out: torch.Tensor, block: Block | None = None
           ) -> Points | None:
    """The dims of ``out`` holding points, for ``func`` applied to a tile (``None``: unknown).

    ``src``: the dims of the call's first argument, of shape ``in_shape``, holding points;
    ``block``: its `Block` where one dim holds them (a reshape that splits that dim reads it).
    """
    name = call_name(func)
    n_in, n_out = len(in_shape), out.dim()
    rest = args[1:]
    if name in ("mT", "mH", "adjoint") or (name == "t" and n_in == 2):  # the last two swapped
        last = {n_in - 2: n_in - 1, n_in - 1: n_in - 2}
        return _moved(src, lambda d: last.get(d, d))
    if name in ("T", "H"):  # every dim reversed
        return _moved(src, lambda d: n_in - 1 - d)
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
        found = _regrouped(src, in_shape, out.shape, block)
        return None if found is None else found[0]
    if name == "__getitem__" and len(args) > 1:
        return _indexed_points(args[1], n_in, src)
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
    if func is torch.nn.functional.grid_sample:  # samples anywhere in the spatial dims
        return frozenset(range(2, ndim))
    if func in _LP_POOLS:  # windows over the last 1, 2 or 3 dims
        return frozenset(range(max(ndim - _LP_POOLS[func], 0), ndim))
    if name == "renorm":  # ``torch.renorm(x, p, dim, maxnorm)``: a norm over every other dim
        kept = args[2] if len(args) > 2 else kwargs.get("dim")
        if not isinstance(kept, int) or isinstance(kept, bool):
            return None
        return frozenset(d for d in range(ndim) if d != kept % max(ndim, 1))
    if name == "diagonal":  # ``torch.diagonal(x, offset, dim1, dim2)``
        return frozenset(d % max(ndim, 1) for d in (
            args[2] if len(args) > 2 else kwargs.get("dim1", 0),
            args[3] if len(args) > 3 else kwargs.get("dim2", 1)))
    if name not in _DIM_AT or "other" in kwargs:  # (``torch.max(x, other=y)``: elementwise)
        return None
    at, default = _DIM_AT[name]
    dim = args[at] if len(args) > at else kwargs.get("dim", kwargs.get("axis", default))
    if dim is None or isinstance(dim, bool):  # (``x.var(False)``: unbiased, the whole)
        return frozenset(range(ndim)) if name in _WHOLE else None
    if isinstance(dim, int):
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


_CUTS: dict[str, tuple[int, str, int | tuple[int, ...] | None]] = {
    **{name: (1, "dim", None) for name in (
        "narrow", "narrow_copy", "select", "index_select", "gather", "index_add", "index_copy",
        "index_fill", "scatter", "scatter_add", "scatter_reduce")},
    **{name: (1, "dim", 0) for name in ("unbind",)},
    **{name: (2, "dim", 0) for name in ("chunk", "split", "tensor_split")},
    "take_along_dim": (2, "dim", None), "repeat_interleave": (2, "dim", None),
    "roll": (2, "dims", None), "flip": (1, "dims", None), "rot90": (2, "dims", (0, 1)),
    "flipud": (_KEYWORD, "dims", 0), "fliplr": (_KEYWORD, "dims", 1)}
"""Calls that cut, move or pick rows along a dim: where the dim is, and its default
(``None``: the flattened tensor, every dim)."""
_JOINS = frozenset({"cat", "concat", "concatenate"})


def cut_dim(func: Any, args: Sequence[Any], kwargs: dict[str, Any],
            points: Callable[[Any], Points | None]) -> int | None:
    """The dim holding points along which ``func`` cuts, moves or joins a tile's rows.

    ``None`` where it does not (or where that is not read). ``points(t)``: the dims of the
    tile ``t`` holding points. Indexing (``x[i]``, ``x[i] = v``): `indexed_dims`.
    """
    name = getattr(func, "__name__", "")
    if name in _JOINS:  # ``torch.cat(tensors, dim)``
        tensors = args[0] if args else kwargs.get("tensors", ())
        dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
        for t in tensors if isinstance(tensors, (tuple, list)) else ():
            held = points(t)
            if held and isinstance(dim, int) and dim % t.dim() in held:
                return int(dim % t.dim())
        return None
    x = args[0] if args else kwargs.get("input")
    held = points(x)
    if not held or not isinstance(x, torch.Tensor):
        return None
    if func is torch.nn.functional.unfold:  # im2col over the last two dims
        return next((d for d in (x.dim() - 2, x.dim() - 1) if d in held), None)
    if name in ("repeat", "tile"):  # counts per dim, aligned to the last dim
        given = args[1:] if len(args) > 1 else (kwargs.get("repeats", kwargs.get("dims", ())),)
        counts = given[0] if len(given) == 1 and isinstance(given[0], (tuple, list,
                                                                         torch.Size)) else given
        lead = len(counts) - x.dim()
        return next((d for d in sorted(held) if 0 <= d + lead < len(counts)
                     and counts[d + lead] != 1), None)
    if func is torch.Tensor.unfold:  # windows along ``dimension``
        name = "narrow"
    if name not in _CUTS:
        return None
    at, key, default = _CUTS[name]
    dim = args[at] if len(args) > at else kwargs.get(key, kwargs.get(
        "dimension" if func is torch.Tensor.unfold else "axis", default))
    if name == "flip" and len(args) > 2:  # ``x.flip(3, 2)``
        dim = tuple(args[1:])
    dims = range(x.dim()) if dim is None else (dim,) if isinstance(dim, int) else dim
    if not isinstance(dims, (range, tuple, list)):
        return None
    cut: int | None = next((d % x.dim() for d in dims
                            if isinstance(d, int) and d % x.dim() in held), None)
    return cut


def _index_walk(index: Any, n_in: int) -> Iterator[tuple[int, int | None, Any]]:
    """``x[index]`` dim by dim: each input dim, its output dim (``None``: cut), its item.

    The dims after the index come with ``slice(None)``; a boolean mask spans its dims.
    """
    items = index if isinstance(index, tuple) else (index,)

    def span(item: Any) -> int:
        return item.dim() if isinstance(item, torch.Tensor) and item.dtype == torch.bool else 1

    used = sum(span(it) for it in items if it is not None and it is not Ellipsis)
    d = out = 0
    for item in items:
        if item is None:
            out += 1
            continue
        if item is Ellipsis:
            for _ in range(n_in - used):
                yield d, out, slice(None)
                d, out = d + 1, out + 1
            continue
        keeps = isinstance(item, slice)
        for _ in range(span(item)):
            yield d, out if keeps else None, item
            d += 1
        out += keeps
    for k in range(d, n_in):
        yield k, out + k - d, slice(None)


def _indexed_points(index: Any, n_in: int, src: Points) -> Points | None:
    """The dims of ``x[index]`` holding points (``None``: not read).

    Slices, ints, ``None`` and one index tensor or list (advanced indexing: its dims take
    the place of those it indexes) are read; several index tensors are not (torch may
    move their dims to the front).
    """
    items = index if isinstance(index, tuple) else (index,)
    advanced = [it for it in items if isinstance(it, bool) or not (
        it is None or it is Ellipsis or isinstance(it, (int, slice)))]
    if len(advanced) > 1:
        return None
    width = _index_width(advanced[0]) if advanced else 0
    if width is None:
        return None
    held: set[int] = set()
    passed = False  # the walk is past the index tensor
    for k, out, item in _index_walk(index, n_in):
        if advanced and item is advanced[0]:
            passed = True
        if k in src:
            if out is None:
                return None  # (a cut: refused before it runs)
            held.add(out + (width if passed else 0))
    return frozenset(held)


def _index_width(item: Any) -> int | None:
    """The dims an index tensor or list puts in the place of those it indexes."""
    if isinstance(item, torch.Tensor) and not item.is_floating_point() \
            and not item.is_complex():
        return 1 if item.dtype == torch.bool else item.dim()
    if isinstance(item, list) and item and all(
            isinstance(v, int) and not isinstance(v, bool) for v in item):
        return 1
    return None


def indexed_dims(index: Any, shape: Sequence[int], held: Points
                 ) -> tuple[int | None, int | None]:
    """The dim holding points that ``x[index]`` cuts, and the first one it slices.

    A cut: an int, an index tensor or a slice that leaves out rows. A slice of an empty
    tile keeps every row it has: the ranks agree on slices where a tile is empty.
    """
    cut, sliced = None, None
    for k, _, item in _index_walk(index, len(shape)):
        if k >= len(shape) or k not in held:
            continue
        if isinstance(item, slice):
            if item == slice(None):
                continue  # ``:``: every row, on every rank
            sliced = k if sliced is None else sliced
            if item.indices(shape[k]) == (0, shape[k], 1):
                continue
        cut = k if cut is None else cut
    return cut, sliced


def einsum_points(args: Sequence[Any], points: Callable[[Any], Points | None]
                  ) -> tuple[Points | None, bool]:
    """``einsum``'s output dims holding points, and whether it pairs or sums over them.

    ``points(t)``: the dims of the tile ``t`` holding points (``None``: not a tile, or not
    known). A subscript at a dim holding points names the points; an output that lacks
    one sums over them, and two tiles whose points have different subscripts pair every
    point with every other (``"bchw,bdgw->bcdhg"``), and a letter named twice by one tile
    (``"bcii->bc"``) takes a diagonal the tile does not hold; an ellipsis stands for the
    dims it covers. ``(None, False)`` where the subscripts are not read.
    """
    read = einsum_subscripts(args)
    if read is None:
        return None, False
    subscripts, output = read
    named: list[set[str]] = []
    repeated = False  # a letter at a dim holding points and another dim: a diagonal
    for sub, t in zip(subscripts, einsum_args(args)[1:], strict=True):
        held = points(t)
        if held is not None and isinstance(t, torch.Tensor) and len(sub) == t.dim():
            named.append({sub[d] for d in held})
            repeated |= any(sub.count(sub[d]) > 1 for d in held)
    if not named:
        return None, False
    every = set().union(*named)
    refused = repeated or any(n != named[0] for n in named) or not every <= set(output)
    return frozenset(output.index(s) for s in every if s in output), refused


def einsum_args(args: Sequence[Any]) -> tuple[Any, ...]:
    """``einsum``'s arguments, with operands given as one list spread out."""
    if len(args) == 2 and isinstance(args[1], (tuple, list)):
        return (args[0], *args[1])
    return tuple(args)


def einsum_subscripts(args: Sequence[Any]) -> tuple[list[str], str] | None:
    """``einsum``'s subscripts, one per operand, and its output's (each ``...`` spelled out).

    Without ``->``, the output is torch's implicit one. ``None`` where they are not read
    (counts that do not fit the operands).
    """
    args = einsum_args(args)
    if len(args) < 2 or not isinstance(args[0], str):
        return None
    equation = args[0].replace(" ", "")
    if "->" not in equation:  # torch's implicit output: the letters used once, sorted
        used = equation.replace("...", "").replace(",", "")
        once = "".join(sorted(c for c in set(used) if used.count(c) == 1))
        equation += "->" + ("..." if "..." in equation else "") + once
    inputs, output = equation.split("->")
    subscripts = inputs.split(",")
    if len(subscripts) != len(args) - 1:
        return None
    if "..." in equation:
        return _without_ellipsis(subscripts, output, args[1:])
    return subscripts, output


def _without_ellipsis(subscripts: list[str], output: str, operands: Sequence[Any]
                      ) -> tuple[list[str], str] | None:
    """``einsum``'s subscripts with each ``...`` spelled out in letters of its own.

    The dims an ellipsis stands for line up from the right across the operands (they
    broadcast), as in torch. ``None`` where an operand is not a tensor or the counts do
    not fit.
    """
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
            if c not in "".join(subscripts) + output]
    counts = []
    for sub, t in zip(subscripts, operands, strict=True):
        if not isinstance(t, torch.Tensor) or sub.count("...") > 1:
            return None
        n = t.dim() - (len(sub) - 3) if "..." in sub else 0
        if n < 0:
            return None
        counts.append(n)
    most = max(counts)
    if most > len(free) or output.count("...") > 1:
        return None
    spelled = [sub.replace("...", "".join(free[most - n:most]))
               for sub, n in zip(subscripts, counts, strict=True)]
    return spelled, output.replace("...", "".join(free[:most]))


def regroups(func: Any, n_in: int, n_out: int) -> bool:
    """Whether `follow` reads ``func``'s dims from the sizes.

    The sizes differ between ranks: the caller agrees on the result.
    """
    name = getattr(func, "__name__", "")
    return name in ("view", "reshape", "unflatten")


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


def tensordot_points(args: Sequence[Any], kwargs: dict[str, Any],
                     points: Callable[[Any], Points | None]) -> bool:
    """Whether ``torch.tensordot`` pairs two tiles' points or sums a tile over its points.

    Two tiles pair every point with every other (or sum over them where contracted); one
    tile is summed over its points where a contracted dim holds them.
    """
    operands = tensordot_free(args, kwargs)
    if operands is None:
        return any(points(t) for t in args[:2])  # (not read: refused rather than guessed)
    held = [points(t) for t, _ in operands]
    if all(held):
        return True
    return any(h and not h <= set(free) for h, (_, free) in zip(held, operands, strict=True))


def tensordot_free(args: Sequence[Any], kwargs: dict[str, Any]
                   ) -> list[tuple[torch.Tensor, list[int]]] | None:
    """``torch.tensordot``'s two operands, each with its dims not contracted, in order.

    The output holds ``a``'s free dims, then ``b``'s. ``None`` where the call is not read.
    """
    a = args[0] if args else kwargs.get("a")
    b = args[1] if len(args) > 1 else kwargs.get("b")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    dims = args[2] if len(args) > 2 else kwargs.get("dims", 2)
    if isinstance(dims, torch.Tensor):
        dims = dims.tolist()
    contracted: Sequence[Sequence[int]]
    if isinstance(dims, int) and not isinstance(dims, bool):
        contracted = (range(a.dim() - dims, a.dim()), range(dims))
    elif isinstance(dims, (tuple, list)) and len(dims) == 2:
        contracted = [[d] if isinstance(d, int) else list(d) for d in dims]
    else:
        return None
    out = []
    for t, c in zip((a, b), contracted, strict=True):
        gone = {d % max(t.dim(), 1) for d in c}
        out.append((t, [d for d in range(t.dim()) if d not in gone]))
    return out


def _arg(rest: Sequence[Any], kwargs: dict[str, Any], i: int, key: str, default: Any) -> Any:
    return rest[i] if len(rest) > i else kwargs.get(key, default)


def _moved(src: Points, where: Any) -> Points:
    return frozenset(where(d) for d in src)


def _reshapes(name: str) -> bool:
    return name in ("view", "reshape", "view_as", "reshape_as", "unflatten")


def follow_block(func: Any, args: Sequence[Any], kwargs: dict[str, Any], src: Points,
                 block: Block | None, in_shape: Sequence[int], out: torch.Tensor
                 ) -> Block | None:
    """The `Block` of ``out``'s dim holding points, after ``func`` (``None``: not known).

    Only for a tile whose points lie in one dim (``src``, with ``block``); `follow` gives
    the dim. A flatten or a reshape merges unsplit dims into it or splits them off; any
    other call it follows keeps the dim whole.
    """
    if block is None or len(src) != 1:
        return None
    name = getattr(func, "__name__", "")
    (d,) = src
    if name == "flatten":
        n = max(len(in_shape), 1)
        start = _arg(args[1:], kwargs, 0, "start_dim", 0) % n
        end = _arg(args[1:], kwargs, 1, "end_dim", -1) % n
        if not start <= d <= end:
            return block
        return (block[0] * math.prod(in_shape[start:d]),
                block[1] * math.prod(in_shape[d + 1:end + 1]))
    if regroups(func, len(in_shape), out.dim()):
        found = _regrouped(src, in_shape, out.shape, block)
        return None if found is None else found[1]
    return block


_ROWS_WHOLE = 1 << 26
_WINDOWS = 1 << 52


def readings(src: Points, block: Block | None, in_shape: Sequence[int],
             out_shape: Sequence[int], held: Points | None) -> dict[int, float] | None:
    """Each output dim of a reshape that may hold the points, with a code of how it does.

    ``held``: `follow`'s answer, used where there is no block to read (``None``: not
    read). Where a tile's one window of split rows reads two ways, both
    readings come: the ranks keep the dims every rank reads alike (`reading_block`
    decodes). ``None``: not read.
    """
    if block is not None and len(src) == 1:
        (d,) = src
        for gi, gj in reshape_groups(in_shape, out_shape) or ():
            if d in gi:
                found = _split_rows(gi, gj, d, block, in_shape, out_shape)
                return {j: _code(b, w) for j, b, w in found} or None
    return None if held is None else {d: 0.0 for d in held}  # (no block: code 0)


def _code(block: Block | None, window: int) -> float:
    """One number for a reading: 0 without a block, else its block, or its window."""
    if block is None:
        return 0.0
    if window:
        return float(_WINDOWS + window)
    return float(block[0] * _ROWS_WHOLE + block[1])


def reading_block(code: float) -> Block | None:
    """The `Block` a reading's code stands for (`readings`)."""
    c = int(code)
    if not c:
        return None
    if c >= _WINDOWS:
        return (1, 1)
    return (c // _ROWS_WHOLE, c % _ROWS_WHOLE)


def reshape_groups(in_shape: Sequence[int], out_shape: Sequence[int]
                   ) -> list[tuple[list[int], list[int]]] | None:
    """A reshape's groups: input dims and the output dims they become (``None``: unread)."""
    groups = []
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
        groups.append((gi, gj))
        i, j = i + 1, j + 1
    return groups


def _regrouped(src: Points, in_shape: Sequence[int], out_shape: Sequence[int],
               block: Block | None) -> tuple[Points, Block | None] | None:
    """Points after a reshape: an output dim made of input dims holding points holds them.

    Where a dim holding points is split into several, the `Block` says which part holds
    them (unknown without one). Returns the points and, with ``block``, the new block.
    """
    groups = reshape_groups(in_shape, out_shape)
    if groups is None:
        return None
    out: set[int] = set()
    new_block: Block | None = None
    for gi, gj in groups:
        held = [d for d in gi if d in src and in_shape[d] != 1]
        if not held:
            continue
        wide = [d for d in gj if out_shape[d] != 1]
        if block is not None and len(src) == 1 and held == [min(src)]:
            found = _split_rows(gi, gj, held[0], block, in_shape, out_shape)
            if len(found) != 1:
                return None
            out.add(found[0][0])
            new_block = found[0][1]
        elif len(wide) > 1:
            return None
        else:
            out.update(wide)
    return frozenset(out), new_block


def _split_rows(gi: Sequence[int], gj: Sequence[int], d: int, block: Block,
                in_shape: Sequence[int], out_shape: Sequence[int]
                ) -> list[tuple[int, Block, int]]:
    """The output dims of a reshape group that may get input dim ``d``'s split rows.

    The group's input is ``outer x rows x inner`` (row-major). Output dim ``j`` holds the
    split rows where the dims before it take a part of ``outer`` and either the dims after
    it a part of ``inner`` (the rows whole in ``j``: tokens back to an image), or the dims
    before it all of ``outer`` and those after it all of ``inner`` and windows of ``w``
    rows (``j`` counts the windows, the dims after it hold a window's rows: an image cut
    into windows, which then lie whole on one rank, as every tile's rows are a multiple
    of ``w``). Returns each such dim with its block and ``w`` (0: the rows whole): none
    where the split rows are cut otherwise; two where the tile holds one window (does the
    dim of size 1 count the windows?).
    """
    outer = block[0] * math.prod(in_shape[k] for k in gi if k < d)
    inner = block[1] * math.prod(in_shape[k] for k in gi if k > d)
    rows = in_shape[d] // (block[0] * block[1])
    found: list[tuple[int, Block, int]] = []
    for j in gj:
        before = math.prod(out_shape[k] for k in gj if k < j)
        after = math.prod(out_shape[k] for k in gj if k > j)
        if outer % before:
            continue
        part = outer // before
        if out_shape[j] != 1 and inner % after == 0 and \
                out_shape[j] == part * rows * (inner // after):
            found.append((j, (part, inner // after), 0))
        elif part == 1 and after % inner == 0 and rows % (after // inner) == 0 and \
                out_shape[j] == rows // (after // inner):
            found.append((j, (1, 1), after // inner))
    return found
