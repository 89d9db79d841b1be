"""The traced data paths: functional collectives arranged so that autograd sees each dual.

Everything here runs only while ``torch.compile`` (dynamo) traces. The collectives are
PyTorch's functional ones (``tensorpar._torch.C10D_FUNCTIONAL``): they return a fresh
tensor that is valid after ``wait_tensor``, and the process group travels as its name, a string the
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

The rooted collectives are autograd Functions, one node per collective on every rank (so
that the backward collectives run in the same order on every rank, whatever each holds): a
scatter is an all-to-all in which only the source sends, a gather one in which every rank
sends to the destination only, broadcast and reduce wrap the functional broadcast and
all-reduce; each is its dual's backward. A rank without data takes part through an empty
"anchor" tensor, as eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tensorpar._torch import C10D_FUNCTIONAL
from tensorpar.collectives._autograd import no_backward as _no_backward
from tensorpar.comm._group import Group

__all__ = ["Broadcast", "CopyToGroup", "ForwardOnly", "Gather", "GatherFromGroup", "Reduce",
           "ReduceIdentity",
           "Scatter", "SplitToGroup", "all_gather_dim", "all_reduce_sum", "all_to_all_dims",
           "gather_dim", "group_name", "no_backward", "reduce_scatter_dim", "scatter_dim", "wait"]

_C = C10D_FUNCTIONAL


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


def _real_pairs(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous, a complex one as its real pairs (``view_as_real``)."""
    x = x.contiguous()
    return torch.view_as_real(x.resolve_conj()).contiguous() if x.is_complex() else x


def _equal(sizes: Sequence[int]) -> bool:
    """Whether every chunk has the first's length.

    Compared one by one, not through a ``set``: hashing a length Dynamo made symbolic
    fixes it to its value (a new graph for every sequence length), where a comparison of
    the balanced split's lengths only tells the length's remainder by the group size.
    """
    return all(s == sizes[0] for s in sizes)


def _to_front(x: torch.Tensor, dim: int) -> torch.Tensor:
    return (x if dim == 0 else x.movedim(dim, 0)).contiguous()


def all_gather_dim(x: torch.Tensor, dim: int, sizes: Sequence[int], name: str,
                   coalesced: bool = False) -> torch.Tensor:
    """Every rank's chunk (``sizes[r]`` long along ``dim``) concatenated along ``dim``.

    Backward (autograd through the functional all-gather): the reduce-scatter (sum) of the
    gradient's chunks. ``coalesced``: through the coalesced all-gather of one tensor (the
    same collective), which the graph never merges with a plain one (see `ReduceIdentity`).
    """
    n, width = len(sizes), max(sizes)
    front = _to_front(x, dim)  # (L_rank, *rest)
    if front.shape[0] != width:  # uneven: pad to the longest chunk
        pad = front.new_zeros((width - front.shape[0], *front.shape[1:]))
        front = torch.cat([front, pad])
    if coalesced:  # (complex as real pairs: gloo's coalesced all-gather takes no complex)
        rows = wait(_C.all_gather_into_tensor_coalesced([_real_pairs(front)], n, name)[0])
        rows = torch.view_as_complex(rows) if front.is_complex() else rows
    else:
        rows = wait(_C.all_gather_into_tensor(front, n, name))  # (n * width, *rest)
    if _equal(sizes):
        out = rows
    else:
        out = torch.cat([rows.narrow(0, r * width, sizes[r]) for r in range(n)])
    return out if dim == 0 else _contiguous_at(out, dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, sizes: Sequence[int], rank: int, name: str,
                       op: str) -> torch.Tensor:
    """This rank's chunk (``sizes[rank]`` along ``dim``) of the reduction of every ``x``.

    ``op`` is ``"sum"`` (a mean divides before), ``"max"`` or ``"min"``. Backward: the
    all-gather of the chunk gradients.
    """
    n, width = len(sizes), max(sizes)
    front = _to_front(x, dim)  # (L, *rest)
    if not _equal(sizes):  # uneven: every chunk padded to the longest
        parts = []
        for part in front.split(list(sizes)):
            parts.append(part)
            if part.shape[0] != width:
                parts.append(part.new_zeros((width - part.shape[0], *part.shape[1:])))
        front = torch.cat(parts)
    out = wait(_C.reduce_scatter_tensor(front, op, n, name))  # (width, *rest)
    if out.shape[0] != sizes[rank]:
        out = out.narrow(0, 0, sizes[rank])
    return out if dim == 0 else _contiguous_at(out, dim)


def _contiguous_at(front: torch.Tensor, dim: int) -> torch.Tensor:
    """``front``'s leading dim moved to ``dim``, in a contiguous tensor, as eagerly.

    The moved view alone has other strides than the eager result: code that views it
    (``.view``) would fail compiled only, and reductions over it may add in another order.
    """
    return front.movedim(0, dim).contiguous()


def all_to_all_dims(x: torch.Tensor, split_dim: int, concat_dim: int, sizes: Sequence[int],
                    rank: int, name: str) -> torch.Tensor:
    """Chunk ``r`` (``sizes[r]`` along ``split_dim``) to rank ``r``; received ones concatenated.

    Every rank holds the same shape and ``sizes``. Backward (autograd through the functional
    all-to-all): the all-to-all of the gradient with the split sizes and dims swapped.
    """
    n, mine = len(sizes), sizes[rank]
    front = _to_front(x, split_dim)  # (L, *rest)
    # (n * mine, ...); gloo's all-to-all takes no complex type: a complex one travels as pairs
    recv = wait(_C.all_to_all_single(_real_pairs(front), [mine] * n, list(sizes), name))
    recv = torch.view_as_complex(recv) if front.is_complex() else recv
    chunks = [recv.narrow(0, r * mine, mine) for r in range(n)]
    if split_dim != 0:
        chunks = [c.movedim(0, split_dim) for c in chunks]
    return torch.cat(chunks, concat_dim)


class ReduceIdentity(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: identity (`reduce_from_group`, Megatron's *g*)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:
        # the coalesced all-reduce of one tensor (the same collective): the graph merges
        # identical calls (common subexpressions), and this one merged with a sum-backward
        # all-reduce of ``x`` gives two outputs in one buffer, sharing a gradient; neither a
        # clone of the result nor a fresh input buffer keeps them apart under inductor,
        # which removes both as no-ops before it merges
        pairs = _real_pairs(x)
        out = wait(_C.all_reduce_coalesced([pairs], "sum", name)[0])
        return torch.view_as_complex(out) if x.is_complex() else out

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
        return all_gather_dim(x, dim, sizes, name, coalesced=True)  # (as ReduceIdentity)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        start = sum(ctx.sizes[: ctx.rank])
        return grad.narrow(ctx.dim, start, ctx.sizes[ctx.rank]).contiguous(), None, None, \
            None, None


# ---------------------------------------------------------------------------------------
# rooted: scatter <-> gather (one all-to-all each), broadcast <-> reduce
# ---------------------------------------------------------------------------------------

_INDEXED = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
            torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
            torch.bool)
"""The dtypes `_send` writes with ``index_copy_`` (which has no kernel for the others)."""


def _send(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``x`` with ``dim`` moved to the front, in a fresh buffer of its own.

    The compiler merges identical calls (common subexpressions); two rooted collectives can
    be identical on one rank and not on another (a rank without data sends nothing, twice),
    and a merge on one rank only would pair the collectives wrongly. A fresh buffer (an
    ``empty`` the compiler never merges) makes every call its own on every rank.
    """
    front = x if dim == 0 else x.movedim(dim, 0)
    buf = _empty(front.shape, front)
    if front.numel() == 0:
        return buf
    if front.dtype not in _INDEXED:  # (float8, unsigned 16 to 64 bits: no index_copy)
        return buf.copy_(front)
    # written by an indexed copy, not ``copy_``: inductor removes a copy into a fresh
    # buffer as a no-op, and then merges two sends of one tensor on the root only
    rows = torch.arange(max(front.shape[0:1], default=1), device=front.device)
    if front.dim() == 0:
        return buf.reshape(1).index_copy_(0, rows, front.reshape(1)).reshape(())
    return buf.index_copy_(0, rows, front)


def _empty(shape: Sequence[int], like: torch.Tensor, dtype: torch.dtype | None = None
           ) -> torch.Tensor:
    """A fresh buffer (``torch.empty``, which the compiler never merges) on ``like``'s device."""
    return torch.empty(tuple(shape), dtype=dtype or like.dtype, device=like.device)


def _reading(buf: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """``buf``, computed so that it reads ``anchor`` (an empty tensor standing for no data).

    A rank without data sends nothing, but what produced its anchor (a gather's or a
    reduce's collective) must stay in its graph: the compiler drops a collective whose result
    nothing reads, and the peers would wait for this rank.
    """
    empty = anchor.reshape(-1)[:0].to(buf.dtype)
    return torch.cat([buf.reshape(-1), empty]).reshape(buf.shape)


def _one_hot(n: int, at: int, value: int) -> list[int]:
    out = [0] * n
    out[at] = value
    return out


def scatter_dim(x: torch.Tensor, shape: Sequence[int], dim: int, sizes: Sequence[int],
                src: int, rank: int, name: str) -> torch.Tensor:
    """Rank ``r``'s chunk (``sizes[r]`` along ``dim``) of the tensor ``x`` on ``src``.

    One all-to-all in which only ``src`` sends (chunk ``r`` to rank ``r``); elsewhere ``x``
    is an empty anchor (any shape with no element). ``shape`` is the full tensor's.
    """
    n = len(sizes)
    if rank == src:
        front, send = _send(x, dim), list(sizes)  # (L, *rest)
    else:
        rest = [s for i, s in enumerate(shape) if i != dim]
        front, send = _reading(_empty((0, *rest), x), x), [0] * n  # (0, *rest)
    out = wait(_C.all_to_all_single(front, _one_hot(n, src, sizes[rank]), send, name))
    return out if dim == 0 else out.movedim(0, dim).contiguous()  # (*, sizes[rank], *)


def gather_dim(x: torch.Tensor, dim: int, sizes: Sequence[int], dst: int, rank: int,
               name: str) -> torch.Tensor:
    """Every rank's chunk concatenated along ``dim`` on ``dst``; an empty anchor elsewhere.

    One all-to-all in which every rank sends its chunk to ``dst`` only.
    """
    n = len(sizes)
    front = _send(x, dim)  # (sizes[rank], *rest)
    recv = list(sizes) if rank == dst else [0] * n
    out = wait(_C.all_to_all_single(front, recv, _one_hot(n, dst, sizes[rank]), name))
    if rank != dst or dim == 0:
        return out  # dst: (L, *rest); elsewhere (0, *rest)
    return out.movedim(0, dim).contiguous()


@torch.library.custom_op("tensorpar::no_backward", mutates_args=())
def no_backward(grad: torch.Tensor, fn: str, op: str) -> torch.Tensor:
    """Raise `no_backward` when the compiled backward reaches a max/min reduction."""
    raise _no_backward(fn, op)


@no_backward.register_fake
def _(grad: torch.Tensor, fn: str, op: str) -> torch.Tensor:
    return torch.empty_like(grad)


def _empty_of(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """An empty tensor of ``shape`` computed from ``t``.

    A rank without data has no use for a collective's result, but the graph must not lose
    the collective: the compiler drops an op whose result nothing reads, and the peers would
    wait for this rank forever. An empty slice of the result keeps it read.
    """
    return t.reshape(-1)[:0].reshape(shape).clone()


class Scatter(torch.autograd.Function):
    """Forward: scatter from ``src`` (`scatter_dim`). Backward: gather to ``src``.

    One autograd node on every rank, whatever the rank holds (as eagerly): the autograd
    engine then orders the backward collectives the same way on every rank. Composed of
    plain differentiable ops instead, the graphs of the source and of the other ranks
    would differ and their backward collectives could run in different orders.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shape: tuple[int, ...], dim: int,
                sizes: tuple[int, ...], src: int, rank: int, name: str) -> torch.Tensor:
        ctx.args, ctx.anchor_shape = (dim, sizes, src, rank, name), x.shape
        return scatter_dim(x, shape, dim, sizes, src, rank, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dim, sizes, src, rank, name = ctx.args
        out = gather_dim(grad, dim, sizes, src, rank, name)
        return (out if rank == src else out.reshape(ctx.anchor_shape)), *[None] * 6


class Gather(torch.autograd.Function):
    """Forward: gather to ``dst`` (`gather_dim`; an empty anchor elsewhere). Backward: scatter."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, sizes: tuple[int, ...], dst: int,
                rank: int, name: str) -> torch.Tensor:
        full = list(x.shape)
        full[dim] = sum(sizes)
        ctx.args = (tuple(full), dim, sizes, dst, rank, name)
        return gather_dim(x, dim, sizes, dst, rank, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return scatter_dim(grad, *ctx.args), None, None, None, None, None


class Broadcast(torch.autograd.Function):
    """Forward: broadcast from ``src``. Backward: the reduction (sum) of the gradients on ``src``.

    ``x`` is the tensor on ``src``, an empty anchor elsewhere; ``shape`` and ``dtype`` are
    the source tensor's.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                src: int, rank: int, name: str) -> torch.Tensor:
        ctx.src, ctx.rank, ctx.name, ctx.anchor_shape = src, rank, name, x.shape
        buf = _send(x) if rank == src else _reading(_empty(shape, x, dtype), x)
        # (the functional broadcast writes into a copy of buf: the result never aliases x)
        return wait(_C.broadcast(buf, src, name)).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        total = all_reduce_sum(_send(grad), ctx.name)  # every rank joins; src keeps the sum
        out = total if ctx.rank == ctx.src else _empty_of(total, ctx.anchor_shape)
        return out, None, None, None, None, None


class ForwardOnly(torch.autograd.Function):
    """A max or min ``all_reduce``/``reduce_scatter``, whose backward raises as eagerly.

    The functional collectives have no max/min backward: without this, the graph of an
    input that requires grad would not compile at all.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: str, op: str, name: str, dim: int = 0,
                sizes: tuple[int, ...] = (), rank: int = 0) -> torch.Tensor:
        ctx.fn, ctx.op, ctx.shape = fn, op, x.shape
        if fn == "all_reduce":
            return all_reduce_sum(x, name, op).clone()  # (a tensor of its own: see above)
        return reduce_scatter_dim(x, dim, sizes, rank, name, op)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        raised = no_backward(grad, ctx.fn, ctx.op)  # (read below: the graph keeps it)
        return _reading(_empty(ctx.shape, grad), raised), None, None, None, None, None, None


class Reduce(torch.autograd.Function):
    """Forward: reduction onto ``dst`` (an empty anchor elsewhere). Backward: broadcast.

    ``op`` is ``"sum"`` (a mean divides before), ``"max"`` or ``"min"``; reaching the
    backward of max/min raises, as eagerly.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: str, dst: int, rank: int, name: str
                ) -> torch.Tensor:
        ctx.op, ctx.dst, ctx.rank, ctx.name, ctx.shape = op, dst, rank, name, x.shape
        out = wait(_C.all_reduce(_send(x), op, name))
        # a tensor of its own (as ReduceIdentity); elsewhere an empty anchor
        return out.clone() if rank == dst else _empty_of(out, (0,))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.op != "sum":  # raises when it runs, on every rank before communicating
            grad = no_backward(grad, "reduce", ctx.op)
        # (elsewhere a buffer that reads the gradient: one that did not would be computed
        # with the forward, on this rank only)
        buf = _send(grad) if ctx.rank == ctx.dst else _reading(_empty(ctx.shape, grad), grad)
        return wait(_C.broadcast(buf, ctx.dst, ctx.name)), None, None, None, None
