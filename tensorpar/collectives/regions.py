"""Megatron's region mappings: how a tensor enters and leaves a tensor-parallel region.

Inside a tensor-parallel region every rank of ``group`` holds either the same tensor
(replicated) or its own slice of it (split). Four Functions move between the two, each the
dual of another, so gradients come out as on one process:

| function | forward | backward |
|---|---|---|
| `copy_to_group` (*f*) | identity | all-reduce (sum) |
| `reduce_from_group` (*g*) | all-reduce (sum) | identity |
| `split_to_group` | take own chunk | all-gather |
| `gather_from_group` | all-gather | take own chunk |

As everywhere in tensorpar, ``group=None`` is the default group, resolved at call time, and a
group of one rank issues no collective.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from tensorpar.collectives._entry import resolve_args, split_args, tensor_args
from tensorpar.collectives._meta import chunks_spec, sole_chunk
from tensorpar.collectives._split import SplitSpec, sizes_or_balanced
from tensorpar.collectives._symmetric import (
    _AllReduce,
    _CopyToGroup,
    _GatherFromGroup,
    _SplitToGroup,
)
from tensorpar.collectives._traced import collectives as _traced
from tensorpar.collectives._traced._dispatch import compiled_call
from tensorpar.comm._compiling import compiling
from tensorpar.comm._group import Group, GroupLike
from tensorpar.comm._launch import SYNC
from tensorpar.placeholder import _normalize_dim

__all__ = ["copy_to_group", "enter_region", "gather_from_group", "reduce_from_group",
           "split_to_group"]


def copy_to_group(x: torch.Tensor, *, group: GroupLike = None) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input.

    Forward: identity. Backward: all-reduce (sum) of the gradient, since every rank's
    partial computation contributes to the input's gradient (Megatron's *f*).

    In validation mode (`tensorpar.validation`) the ranks also compare a checksum of ``x``
    and raise `CollectiveMismatchError` on every rank if it differs.

    Args:
        x: the input, the same on every rank of ``group``.
        group: the tensor-parallel group (``None``: the default group).

    Returns:
        ``x`` itself (autograd records the backward all-reduce).

    Raises:
        CollectiveTypeError: ``x`` is not a tensor.
        CollectiveMismatchError: in validation mode, ``x`` differs across the ranks.

    Shape:
        output: the shape of ``x``.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.copy_to_group(torch.ones(2))
        tensor([1., 1.])
    """
    return enter_region(x, group)


def enter_region(x: torch.Tensor, group: GroupLike, label: str = "") -> torch.Tensor:
    """`copy_to_group`, with ``label`` naming the caller (a layer) in validation messages."""
    if compiling():  # the traced namesake, or this function between two graphs
        named = functools.partial(enter_region, label=label)  # (validation's messages)
        return compiled_call(named, _traced.copy_to_group, True, x, group=group)
    fn = "copy_to_group"
    g, tensor = tensor_args(fn, x, group, label)
    if g.is_single:
        return tensor
    out: torch.Tensor = _CopyToGroup.apply(tensor, g)
    return out


def reduce_from_group(x: torch.Tensor, *, group: GroupLike = None) -> torch.Tensor:
    """Leave a tensor-parallel region by summing the partial results.

    Forward: all-reduce (sum). Backward: identity: the result feeds a replicated loss, so
    each rank's gradient is already the full gradient (Megatron's *g*). The same as
    ``all_reduce(x, backward="identity")``.

    Args:
        x: this rank's partial result (same shape and dtype on every rank).
        group: the tensor-parallel group (``None``: the default group).

    Returns:
        The sum over the group, on every rank (a new tensor; ``x`` is not modified).

    Raises:
        CollectiveTypeError: ``x`` is not a tensor.

    Shape:
        output: the shape of ``x``.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.reduce_from_group(torch.ones(2))
        tensor([1., 1.])
    """
    if compiling():  # the traced namesake, or this function between two graphs
        return compiled_call(reduce_from_group, _traced.reduce_from_group, True, x, group=group)
    fn = "reduce_from_group"
    g, tensor = tensor_args(fn, x, group)
    if g.is_single:
        return tensor
    out: torch.Tensor = _AllReduce.apply(tensor, g, "sum", "identity", False, SYNC)
    return out


def split_to_group(x: torch.Tensor, *, dim: int = -1, group: GroupLike = None,
                   sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Take this rank's chunk of a tensor that every rank holds (replicated).

    Forward: own chunk along ``dim`` (no communication). Backward: all-gather of the chunk
    gradients.

    In validation mode the ranks also compare a checksum of ``x``, as `copy_to_group` does.

    Args:
        x: the full tensor, the same on every rank of ``group``.
        dim: the dimension to split (negative counts from the end).
        group: the tensor-parallel group (``None``: the default group).
        sizes: every rank's chunk length along ``dim`` (default: balanced like
            ``torch.tensor_split``).

    Returns:
        This rank's chunk, a contiguous copy.

    Raises:
        CollectiveTypeError: ``x`` is not a tensor.
        ValueError: ``dim`` out of range, or ``sizes`` malformed or not summing to the length.

    Shape:
        ``x``: ``(*, L)``; output: ``(*, sizes[rank])``.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.split_to_group(torch.arange(4.0))
        tensor([0., 1., 2., 3.])
    """
    if compiling():  # the traced namesake, or this function between two graphs
        return compiled_call(split_to_group, _traced.split_to_group, True,
                             x, dim=dim, group=group, sizes=sizes)
    fn = "split_to_group"
    g, tensor, _, d, split = split_args(fn, x, dim, group, sizes)
    if g.is_single:
        return tensor
    spec = SplitSpec(group=g, root=-1, full_shape=tensor.shape, dtype=tensor.dtype, dim=d,
                     sizes=split)
    out: torch.Tensor = _SplitToGroup.apply(tensor, spec)
    return out


def split_spec(fn: str, x: torch.Tensor, dim: int, g: Group, sizes: tuple[int, ...] | None
               ) -> SplitSpec:
    """How `split_to_group` splits ``x``: ``dim`` and ``sizes`` checked against its shape.

    Depends only on ``x``'s shape and dtype, so a layer may keep it per shape.
    """
    d = _normalize_dim(fn, dim, x.ndim)
    sizes = sizes_or_balanced(fn, sizes, x.shape[d], d, g.size, "the input")
    return SplitSpec(group=g, root=-1, full_shape=x.shape, dtype=x.dtype, dim=d, sizes=sizes)


def gather_from_group(x: torch.Tensor, *, dim: int = -1, group: GroupLike = None,
                      sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's chunk on every rank, for a replicated consumer.

    Forward: all-gather along ``dim``. Backward: this rank's chunk of the gradient (the
    consumer is replicated, so every rank already holds the full gradient).

    Args:
        x: this rank's chunk.
        dim: the dimension to concatenate along (negative counts from the end).
        group: the tensor-parallel group (``None``: the default group).
        sizes: every rank's chunk length along ``dim``; without it the lengths are exchanged
            once. With it, every rank must pass the same ``sizes`` and either every rank's
            chunk requires grad or none does.

    Returns:
        The concatenation of every rank's chunk, in rank order.

    Raises:
        CollectiveArgumentError: chunks disagree in dtype or in a dim other than ``dim``
            (raised on every rank).
        ValueError: ``sizes`` malformed or disagreeing with this rank's chunk.

    Shape:
        ``x``: ``(*, L_rank)``; output: ``(*, sum(L))``.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.gather_from_group(torch.ones(1, 2))
        tensor([[1., 1.]])
    """
    if compiling():  # the traced namesake, or this function between two graphs
        return compiled_call(gather_from_group, _traced.gather_from_group, sizes is not None,
                             x, dim=dim, group=group, sizes=sizes)
    fn = "gather_from_group"
    g, sizes = resolve_args(fn, group, sizes, x=x, dim=dim)
    if g.is_single:
        return sole_chunk(fn, x, dim, sizes)
    spec, inp = chunks_spec(fn, x, dim, g, sizes, root=-1)
    out: torch.Tensor = _GatherFromGroup.apply(inp, spec)
    return out
