"""What every public collective does on entry, before it communicates.

Resolve the group; in validation mode, compare the call's fingerprint across the ranks
(before any check that could raise on one rank only); check the rank arguments and the form
of ``sizes``. Then each collective's own argument checks, in one function per kind of
collective, called by both of its implementations: the eager one
(`tensorpar.collectives.functional`, `tensorpar.collectives.regions`) and the one
``torch.compile`` traces (`tensorpar.collectives._traced`). Every check
here is plain Python on metadata (shapes, dtypes, ints), so it runs at trace time as eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorpar.collectives._autograd import check_op
from tensorpar.collectives._meta import require_tensor, sole_input
from tensorpar.collectives._split import check_sizes, check_total, sizes_or_balanced
from tensorpar.comm._group import Group, GroupLike, resolve_group
from tensorpar.errors import CollectiveArgumentError
from tensorpar.placeholder import _normalize_dim
from tensorpar.validation import check_call

__all__ = ["all_to_all_args", "check_all_reduce_args", "reduction_args", "resolve_args",
           "source_chunk", "split_args", "tensor_args"]


def resolve_args(fn: str, group: GroupLike, sizes: Sequence[int] | None, *, x: object = None,
                 dim: object = None, op: object = None, backward: object = None,
                 label: str = "", **ranks: int) -> tuple[Group, tuple[int, ...] | None]:
    """Resolve ``group``, check the rank arguments (group ranks) and the form of ``sizes``.

    In validation mode the ranks first compare the call's fingerprint (``x``'s dtype and
    shape, ``dim``, ``op``, ``backward``, ``sizes``, the rank arguments and the call site;
    ``label`` names what the call is part of in messages).
    """
    g = resolve_group(group, fn)
    check_call(fn, g, x, dim, op, backward, sizes, next(iter(ranks.values()), -1), label)
    for name, value in ranks.items():
        g.check_rank(fn, name, value)
    return g, None if sizes is None else check_sizes(fn, sizes, g.size)


def tensor_args(fn: str, x: object, group: GroupLike, label: str = ""
                ) -> tuple[Group, torch.Tensor]:
    """The arguments of a region mapping that takes one tensor (`copy_to_group`, ...)."""
    g, _ = resolve_args(fn, group, None, x=x, label=label)
    return g, require_tensor(fn, x)


def reduction_args(fn: str, x: object, op: object, group: GroupLike, *,
                   backward: object = None, inplace: bool = False, **ranks: int
                   ) -> tuple[Group, torch.Tensor, str]:
    """The arguments of `all_reduce` (with ``backward``) and `reduce` (with ``dst``).

    Returns the group, the tensor and the checked op name.
    """
    g, _ = resolve_args(fn, group, None, x=x, op=op, backward=backward, label="", **ranks)
    tensor = require_tensor(fn, x)
    op_name = check_op(fn, op, tensor, g)
    if backward is not None:
        check_all_reduce_args(fn, tensor, backward, inplace)
    return g, tensor, op_name


def check_all_reduce_args(fn: str, x: torch.Tensor, backward: object, inplace: bool) -> None:
    """Validate all_reduce's ``backward`` mode and that an in-place reduction is possible."""
    if backward not in ("sum", "identity"):
        raise CollectiveArgumentError(f"{fn}: backward={backward!r}; expected 'sum' or 'identity'")
    if inplace and not x.is_contiguous():
        raise CollectiveArgumentError(
            f"{fn}: inplace=True needs a contiguous tensor (its bytes are reduced "
            f"in memory order); got strides {x.stride()} for shape "
            f"{tuple(x.shape)}. Call .contiguous() first or reduce out of place")


def split_args(fn: str, x: object, dim: object, group: GroupLike,
               sizes: Sequence[int] | None, op: object = None
               ) -> tuple[Group, torch.Tensor, str | None, int, tuple[int, ...]]:
    """The arguments of a collective that splits a tensor every rank holds whole.

    That is `reduce_scatter` (with ``op``) and `split_to_group` (``op=None``). Returns the
    group, the tensor, the checked op name (``None`` without ``op``), the normalised dim and
    the chunk lengths (``sizes`` checked against the tensor, or the balanced split).
    """
    g, checked = resolve_args(fn, group, sizes, x=x, dim=dim, op=op)
    tensor = require_tensor(fn, x)
    op_name = None if op is None else check_op(fn, op, tensor, g)
    d = _normalize_dim(fn, dim, tensor.ndim)
    split = sizes_or_balanced(fn, checked, tensor.shape[d], d, g.size, "the input")
    return g, tensor, op_name, d, split


def source_chunk(fn: str, x: object, dim: int, sizes: Sequence[int] | None) -> torch.Tensor:
    """`scatter` on a group of one rank: ``x`` itself, checked against ``dim`` and ``sizes``."""
    tensor = sole_input(fn, x)
    d = _normalize_dim(fn, dim, tensor.ndim)
    if sizes is not None:
        check_total(fn, sizes, tensor.shape[d], d, "the source tensor")
    return tensor.contiguous()


def all_to_all_args(fn: str, x: object, split_dim: object, concat_dim: object, g: Group,
                    sizes: Sequence[int] | None
                    ) -> tuple[torch.Tensor, int, int, tuple[int, ...] | None]:
    """The arguments of `all_to_all` on its resolved group ``g``.

    Returns the tensor, the normalised split and concat dims and the checked ``sizes``.
    """
    checked = None if sizes is None else check_sizes(fn, sizes, g.size)
    tensor = require_tensor(fn, x)
    sd = _normalize_dim(fn, split_dim, tensor.ndim)
    cd = _normalize_dim(fn, concat_dim, tensor.ndim)
    if checked is not None:
        check_total(fn, checked, tensor.shape[sd], sd, "this rank's tensor")
    return tensor, sd, cd, checked
