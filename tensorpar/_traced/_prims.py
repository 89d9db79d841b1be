"""The traced data paths: functional collectives arranged so that autograd sees each dual.

Everything here runs only while ``torch.compile`` (dynamo) traces. The collectives are
PyTorch's functional ones (``torch.ops._c10d_functional``): they return a fresh tensor that
is valid after ``wait_tensor``, and the process group travels as its name, a string the
compiled graph holds as a constant. PyTorch registers autograd for them (all-reduce <->
all-reduce, all-gather <-> reduce-scatter, all-to-all <-> all-to-all reversed), and every
reshaping around them here (moving a dim to the front, padding, narrowing, concatenating)
is an ordinary differentiable op, so the compiled backward is each collective's dual, as in
eager mode. The two mappings whose backward is *not* the forward's adjoint under plain
autograd (an all-reduce whose gradient passes through, and an identity whose gradient is
all-reduced) are small autograd Functions that dynamo traces into the graph, forward and
backward.

Uneven chunks are padded to the longest one and travel in one all-gather / reduce-scatter
(the same single collective as even chunks, and the padding's gradient is dropped by the
narrow that removes it); an all-to-all takes its split sizes directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tensorpar._group import Group

__all__ = ["CopyToGroup", "GatherFromGroup", "ReduceIdentity", "SplitToGroup",
           "all_gather_dim", "all_reduce_sum", "all_to_all_dims", "group_name",
           "reduce_scatter_dim", "wait"]

_C = torch.ops._c10d_functional


def group_name(g: Group) -> str:
    """The registered name of ``g``'s process group: what the functional collectives take."""
    handle = g.handle
    assert handle is not None  # a group of one rank never reaches the traced collectives
    name: str = handle.group_name
    return name


def wait(t: torch.Tensor) -> torch.Tensor:
    """The result of a functional collective, once it is valid (``wait_tensor``)."""
    out: torch.Tensor = _C.wait_tensor(t)
    return out


def all_reduce_sum(x: torch.Tensor, name: str, op: str = "sum") -> torch.Tensor:
    """The all-reduce (its backward, for ``"sum"``, all-reduces the gradient)."""
    return wait(_C.all_reduce(x.contiguous(), op, name))


def _to_front(x: torch.Tensor, dim: int) -> torch.Tensor:
    return (x if dim == 0 else x.movedim(dim, 0)).contiguous()


def all_gather_dim(x: torch.Tensor, dim: int, sizes: Sequence[int], name: str
                   ) -> torch.Tensor:
    """Every rank's chunk (``sizes[r]`` long along ``dim``) concatenated along ``dim``.

    Backward (autograd through the functional all-gather): the reduce-scatter (sum) of the
    gradient's chunks.
    """
    n, width = len(sizes), max(sizes)
    front = _to_front(x, dim)  # (L_rank, *rest)
    if front.shape[0] != width:  # uneven: pad to the longest chunk
        pad = front.new_zeros((width - front.shape[0], *front.shape[1:]))
        front = torch.cat([front, pad])
    rows = wait(_C.all_gather_into_tensor(front, n, name))  # (n * width, *rest)
    if len(set(sizes)) == 1:
        out = rows
    else:
        out = torch.cat([rows.narrow(0, r * width, sizes[r]) for r in range(n)])
    return out if dim == 0 else out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, sizes: Sequence[int], rank: int, name: str,
                       op: str) -> torch.Tensor:
    """This rank's chunk (``sizes[rank]`` along ``dim``) of the reduction of every ``x``.

    ``op`` is ``"sum"`` (a mean divides before), ``"max"`` or ``"min"``. Backward: the
    all-gather of the chunk gradients.
    """
    n, width = len(sizes), max(sizes)
    front = _to_front(x, dim)  # (L, *rest)
    if len(set(sizes)) != 1:  # uneven: every chunk padded to the longest
        parts = []
        for part in front.split(list(sizes)):
            parts.append(part)
            if part.shape[0] != width:
                parts.append(part.new_zeros((width - part.shape[0], *part.shape[1:])))
        front = torch.cat(parts)
    out = wait(_C.reduce_scatter_tensor(front, op, n, name))  # (width, *rest)
    if out.shape[0] != sizes[rank]:
        out = out.narrow(0, 0, sizes[rank])
    return out if dim == 0 else out.movedim(0, dim)


def all_to_all_dims(x: torch.Tensor, split_dim: int, concat_dim: int, sizes: Sequence[int],
                    rank: int, name: str) -> torch.Tensor:
    """Chunk ``r`` (``sizes[r]`` along ``split_dim``) to rank ``r``; received ones concatenated.

    Every rank holds the same shape and ``sizes``. Backward (autograd through the functional
    all-to-all): the all-to-all of the gradient with the split sizes and dims swapped.
    """
    n, mine = len(sizes), sizes[rank]
    front = _to_front(x, split_dim)  # (L, *rest)
    recv = wait(_C.all_to_all_single(front, [mine] * n, list(sizes), name))  # (n * mine, *rest)
    chunks = [recv.narrow(0, r * mine, mine) for r in range(n)]
    if split_dim != 0:
        chunks = [c.movedim(0, split_dim) for c in chunks]
    return torch.cat(chunks, concat_dim)


class ReduceIdentity(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: identity (`reduce_from_group`, Megatron's *g*)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:
        # a tensor of its own: the graph may merge this all-reduce with an identical one
        # (common subexpressions), and two outputs aliasing one buffer would share a gradient
        return all_reduce_sum(x, name).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class CopyToGroup(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) (`copy_to_group`, Megatron's *f*)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_sum(grad, ctx.name), None


class SplitToGroup(torch.autograd.Function):
    """Forward: this rank's chunk. Backward: all-gather of the chunk gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, sizes: tuple[int, ...], rank: int,
                name: str) -> torch.Tensor:
        ctx.dim, ctx.sizes, ctx.name = dim, sizes, name
        # a copy, never a view of ``x`` (``contiguous`` of a leading slice is the view
        # itself): torch 2.11 traces the backward of a Function whose output is a view of
        # its input with a zero gradient
        return x.narrow(dim, sum(sizes[:rank]), sizes[rank]).clone(
            memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = all_gather_dim(grad, ctx.dim, ctx.sizes, ctx.name)
        return out, None, None, None, None


class GatherFromGroup(torch.autograd.Function):
    """Forward: all-gather. Backward: this rank's chunk of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, sizes: tuple[int, ...], rank: int,
                name: str) -> torch.Tensor:
        ctx.dim, ctx.sizes, ctx.rank = dim, sizes, rank
        out = all_gather_dim(x, dim, sizes, name)
        # a tensor of its own where it would be the collective's buffer (as ReduceIdentity)
        return out.clone() if dim == 0 and len(set(sizes)) == 1 else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        start = sum(ctx.sizes[: ctx.rank])
        return grad.narrow(ctx.dim, start, ctx.sizes[ctx.rank]).contiguous(), None, None, \
            None, None
