"""Autograd-safe collectives whose backward is their dual.

Every function takes ``group=None`` (the default group, resolved at call time; a
``ProcessGroup`` or a 1-D ``DeviceMesh`` also work), and ``src``/``dst`` are ranks **within**
that group. A group of one rank issues no collective. Inputs are never modified unless the
call says ``inplace=True``. Chunks along ``dim`` may be uneven (balanced like
``torch.tensor_split`` by default, or given by ``sizes=``). Every argument after the tensor
is keyword-only, so a call reads the same everywhere: ``gather(y, dim=1, dst=0)``.
Each docstring gives the dual pair; the region mappings are in `tensorpar.collectives.regions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import torch

from tensorpar.collaborative import CollaborativeTensor, as_result
from tensorpar.collectives._alltoall import run_all_to_all
from tensorpar.collectives._autograd import apply_or_run, needs_graph
from tensorpar.collectives._entry import reduction_args, resolve_args, source_chunk, split_args
from tensorpar.collectives._hierarchical import Algorithm, hierarchical_data, hierarchical_topology
from tensorpar.collectives._meta import chunks_spec, sole_chunk, sole_input, source_header
from tensorpar.collectives._rooted import (
    _Broadcast,
    _Gather,
    _Reduce,
    _Scatter,
    placeholder_of,
    root_input,
)
from tensorpar.collectives._split import RootSpec, SplitSpec, sizes_or_balanced
from tensorpar.collectives._symmetric import (
    _AllGather,
    _AllReduce,
    _ReduceScatter,
    all_gather_equal,
    equal_on_dim0,
    reduce_scatter_equal,
)
from tensorpar.collectives._traced import collectives as _traced
from tensorpar.collectives._traced._dispatch import compiled_call
from tensorpar.collectives._traced.rooted import TRACES
from tensorpar.comm._compiling import compiling
from tensorpar.comm._group import GroupLike
from tensorpar.comm._launch import SYNC, Launch
from tensorpar.hierarchical.topology import Topology
from tensorpar.placeholder import TensorPlaceholder, _normalize_dim

__all__ = ["all_gather", "all_reduce", "all_to_all", "broadcast", "gather", "reduce",
           "reduce_scatter", "scatter"]

ReduceOpName = Literal["sum", "mean", "max", "min"]
BackwardMode = Literal["sum", "identity"]


# ---------------------------------------------------------------------------------------
# rooted collectives
# ---------------------------------------------------------------------------------------

def scatter(x: torch.Tensor | TensorPlaceholder | None, *, dim: int = 0, src: int = 0,
            group: GroupLike = None, sizes: Sequence[int] | None = None,
            exchange_meta: bool = True) -> torch.Tensor:
    """Split ``x`` on rank ``src`` along ``dim`` and give every rank its chunk.

    Forward: scatter from ``src``. Backward: gather of the chunk gradients to ``src``.

    On ``src``, ``x`` is the full tensor; elsewhere a `TensorPlaceholder` or ``None``. A
    small metadata header exchanged first tells ``None`` ranks the dtype, shape and
    ``requires_grad`` and checks placeholders; a mistake raises on every rank.
    ``exchange_meta=False`` skips it when every non-source rank passes a placeholder. Every
    chunk has the source's ``requires_grad``, so every rank joins the backward gather.

    Args:
        x: the full tensor on ``src``; a placeholder or ``None`` elsewhere.
        dim: the dimension to split (negative counts from the end).
        src: the source rank, a rank **within** ``group``.
        group: the process group (``None``: the default group, resolved at call time), or a
            1-D ``DeviceMesh``.
        sizes: chunk length along ``dim`` for each rank (zeros allowed). Default: balanced
            like ``torch.tensor_split(x, group_size, dim)``.
        exchange_meta: exchange the metadata header (default). Pass ``False`` on every rank
            only when every non-source rank passes a correct placeholder.

    Returns:
        This rank's chunk: contiguous, the source's dtype, on this rank's device (the
            placeholder's, or the group's default device for ``None``).

    Raises:
        CollectiveArgumentError: ``sizes`` that do not add up to the source's length, or a
            placeholder that disagrees with the source tensor (raised on every rank).
        CollectiveTypeError: a placeholder or ``None`` on ``src``, or a tensor on another
            rank (raised on every rank).
        ValueError: ``dim`` out of range (on every rank), ``src`` not a rank of the group,
            or malformed ``sizes``.

    Shape:
        ``x``: ``(*, L, *)`` with ``L`` at ``dim``; output: ``(*, sizes[rank], *)``.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.scatter(torch.arange(6.0).view(3, 2), dim=-1)  # one rank: all of it
        tensor([[0., 1.],
                [2., 3.],
                [4., 5.]])
    """
    if compiling():  # the traced namesake, or this function between two graphs
        return compiled_call(scatter, _traced.scatter, not exchange_meta and TRACES,
                             x, dim=dim, src=src, group=group, sizes=sizes,
                             exchange_meta=exchange_meta)
    fn = "scatter"
    # without the header exchange, validation mode compares every rank's x (placeholders)
    g, sizes = resolve_args(fn, group, sizes, x=None if exchange_meta else x, dim=dim, src=src)
    if g.is_single:
        return source_chunk(fn, x, dim, sizes)
    header = source_header(fn, x, src, g, exchange_meta, dim, sizes)
    d = _normalize_dim(fn, dim, len(header.shape))
    sizes = sizes_or_balanced(fn, sizes, header.shape[d], d, g.size, "the source tensor")
    spec = SplitSpec(group=g, root=src, full_shape=header.shape, dtype=header.tensor_dtype,
                     dim=d, sizes=sizes)
    inp = root_input(x, src, g, header)
    out: torch.Tensor = _Scatter.apply(inp, spec)
    return out


def gather(x: torch.Tensor, *, dim: int = 0, dst: int = 0, group: GroupLike = None,
           sizes: Sequence[int] | None = None) -> torch.Tensor | TensorPlaceholder:
    """Concatenate every rank's chunk along ``dim`` on rank ``dst``.

    Forward: gather to ``dst``. Backward: scatter of the gradient from ``dst``.

    Chunk lengths along ``dim`` may differ across ranks; one small metadata exchange learns
    them and checks that dtypes and the other dims agree (on every rank). ``sizes`` skips
    it: every rank must then agree on the sizes and on whether its chunk requires grad.
    Every rank other than ``dst`` gets a `TensorPlaceholder` (full shape, ``owner=dst``);
    its ``.backward()`` joins the backward scatter while ``dst`` calls ``loss.backward()``.

    Args:
        x: this rank's chunk (every rank passes a tensor, possibly of length 0 along ``dim``).
        dim: the dimension to concatenate along (negative counts from the end).
        dst: the destination rank, a rank **within** ``group``.
        group: the process group (``None``: the default group, resolved at call time), or a
            1-D ``DeviceMesh``.
        sizes: every rank's chunk length along ``dim``, to skip the size exchange.

    Returns:
        The full tensor on ``dst``; a placeholder of it on every other rank.

    Raises:
        CollectiveArgumentError: chunks disagree in dtype, ndim or any dim but ``dim``, or
            ``dim`` is out of range (raised on every rank).
        CollectiveTypeError: a rank passed something that is not a tensor.
        ValueError: ``dst`` is not a rank of the group, or ``sizes`` is malformed or
            disagrees with this rank's chunk.

    Shape:
        ``x``: ``(*, L_rank, *)``; output on ``dst``: ``(*, sum(L), *)``.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.gather(torch.ones(2, 3), dim=1)  # one rank: its chunk is everything
        tensor([[1., 1., 1.],
                [1., 1., 1.]])
    """
    if compiling():  # the traced namesake, or this function between two graphs
        return compiled_call(gather, _traced.gather, sizes is not None and TRACES,
                             x, dim=dim, dst=dst, group=group, sizes=sizes)
    fn = "gather"
    g, sizes = resolve_args(fn, group, sizes, x=x, dim=dim, dst=dst)
    if g.is_single:
        return sole_chunk(fn, x, dim, sizes)
    spec, inp = chunks_spec(fn, x, dim, g, sizes, root=dst)
    out: torch.Tensor = _Gather.apply(inp, spec)
    return out if g.rank == dst else placeholder_of(out, spec)


@overload
def broadcast(x: torch.Tensor | TensorPlaceholder | None, *, src: int = ..., group: GroupLike = ...,
              exchange_meta: bool = ..., async_op: Literal[False] = ...) -> torch.Tensor: ...
@overload
def broadcast(x: torch.Tensor | TensorPlaceholder | None, *, src: int = ..., group: GroupLike = ...,
              exchange_meta: bool = ..., async_op: Literal[True]) -> CollaborativeTensor: ...
@overload
def broadcast(x: torch.Tensor | TensorPlaceholder | None, *, src: int = ..., group: GroupLike = ...,
              exchange_meta: bool = ..., async_op: bool) -> torch.Tensor | CollaborativeTensor: ...
def broadcast(x: torch.Tensor | TensorPlaceholder | None, *, src: int = 0,
              group: GroupLike = None, exchange_meta: bool = True, async_op: bool = False
              ) -> torch.Tensor | CollaborativeTensor:
    """Copy ``x`` from rank ``src`` to every rank.

    Forward: broadcast from ``src``. Backward: reduce (sum) of the gradients to ``src``.

    ``x`` is the tensor on ``src``, a `TensorPlaceholder` or ``None`` elsewhere; the
    metadata header works as in `scatter`. The result requires grad on every rank when the
    source does, and never shares storage with ``x`` (except on a group of one rank).

    Args:
        x: the tensor on ``src``; a placeholder or ``None`` elsewhere.
        src: the source rank, a rank **within** ``group``.
        group: the process group (``None``: the default group, resolved at call time).
        exchange_meta: exchange the metadata header (default).
        async_op: return a `CollaborativeTensor` without waiting.

    Returns:
        The tensor on every rank (or a handle to it with ``async_op=True``).

    Raises:
        CollectiveArgumentError, CollectiveTypeError: as for `scatter`, on every rank.
        ValueError: ``src`` is not a rank of the group.

    Shape:
        output: the shape of ``x`` on ``src``.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.broadcast(torch.tensor([1.0, 2.0]))
        tensor([1., 2.])
    """
    if compiling():  # the traced namesake, or this function between two graphs
        return compiled_call(broadcast, _traced.broadcast, not exchange_meta and TRACES,
                             x, src=src, group=group, exchange_meta=exchange_meta,
                             async_op=async_op)
    fn = "broadcast"
    g, _ = resolve_args(fn, group, None, x=None if exchange_meta else x, src=src)
    if g.is_single:
        return as_result(sole_input(fn, x), Launch(async_op), async_op)
    header = source_header(fn, x, src, g, exchange_meta)
    spec = RootSpec(group=g, root=src, full_shape=header.shape, dtype=header.tensor_dtype)
    inp = root_input(x, src, g, header)
    launch = Launch(async_op)
    out: torch.Tensor = _Broadcast.apply(inp, spec, launch)
    return as_result(out, launch, async_op)


def reduce(x: torch.Tensor, *, dst: int = 0, op: ReduceOpName = "sum",
           group: GroupLike = None) -> torch.Tensor | TensorPlaceholder:
    """Reduce every rank's ``x`` onto rank ``dst``.

    Forward: reduce to ``dst``. Backward: broadcast of the gradient from ``dst``.

    Every rank passes a tensor of the same shape and dtype. ``dst`` gets the reduction;
    the others get a `TensorPlaceholder` whose ``.backward()`` joins the backward broadcast.

    Args:
        x: this rank's tensor.
        dst: the destination rank, a rank **within** ``group``.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"`` (max/min have no backward).
        group: the process group (``None``: the default group, resolved at call time).

    Returns:
        The reduction on ``dst``; a placeholder of it elsewhere.

    Raises:
        ValueError: unknown ``op``, or ``dst`` is not a rank of the group.
        CollectiveTypeError: a dtype the backend cannot reduce (gloo: int16, uint16/32/64,
            float8), or max/min of complex numbers (on every rank, before communicating).
        TensorparError: backward through ``op="max"``/``"min"``.

    Shape:
        output: the shape of ``x``.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.reduce(torch.tensor([1.0, 2.0]), op="mean")
        tensor([1., 2.])
    """
    if compiling():  # the traced namesake, or this function between two graphs
        return compiled_call(reduce, _traced.reduce, TRACES, x, dst=dst, op=op, group=group)
    fn = "reduce"
    g, tensor, op_name = reduction_args(fn, x, op, group, dst=dst)
    if g.is_single:
        return tensor
    spec = RootSpec(group=g, root=dst, full_shape=tensor.shape, dtype=tensor.dtype)
    out: torch.Tensor = _Reduce.apply(tensor, spec, op_name, SYNC)
    return out if g.rank == dst else placeholder_of(out, spec)


# ---------------------------------------------------------------------------------------
# symmetric collectives
# ---------------------------------------------------------------------------------------

@overload
def all_gather(x: torch.Tensor, *, dim: int = ..., group: GroupLike = ...,
               sizes: Sequence[int] | None = ...,
               async_op: Literal[False] = ...) -> torch.Tensor: ...
@overload
def all_gather(x: torch.Tensor, *, dim: int = ..., group: GroupLike = ...,
               sizes: Sequence[int] | None = ...,
               async_op: Literal[True]) -> CollaborativeTensor: ...
@overload
def all_gather(x: torch.Tensor, *, dim: int = ..., group: GroupLike = ...,
               sizes: Sequence[int] | None = ...,
               async_op: bool) -> torch.Tensor | CollaborativeTensor: ...
def all_gather(x: torch.Tensor, *, dim: int = 0, group: GroupLike = None,
               sizes: Sequence[int] | None = None, async_op: bool = False
               ) -> torch.Tensor | CollaborativeTensor:
    """Concatenate every rank's chunk along ``dim``, on every rank.

    Forward: all-gather. Backward: reduce-scatter (sum), the true gradient when each rank's
    loss counts. For one replicated loss counted once use `gather_from_group` (here the
    gradient would come out multiplied by the group size).

    Chunk lengths may differ; one metadata exchange learns them unless ``sizes`` gives them
    (the same on every rank, and every rank's chunk requires grad or none does).

    Args:
        x: this rank's chunk.
        dim: the dimension to concatenate along.
        group: the process group (``None``: the default group, resolved at call time).
        sizes: every rank's chunk length along ``dim``, to skip the size exchange.
        async_op: return a `CollaborativeTensor` without waiting (uneven chunks, or a
            ``dim`` with longer dims before it, are reassembled when it is resolved).

    Returns:
        The concatenation (or a handle to it).

    Raises:
        CollectiveArgumentError: chunks disagree in dtype or in a dim other than ``dim``.
        ValueError: ``sizes`` malformed or disagreeing with this rank's chunk.

    Shape:
        ``x``: ``(*, L_rank, *)``; output: ``(*, sum(L), *)``.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.all_gather(torch.ones(2), sizes=[2])
        tensor([1., 1.])
    """
    if compiling():  # the traced namesake, or this function between two graphs
        return compiled_call(all_gather, _traced.all_gather, sizes is not None,
                             x, dim=dim, group=group, sizes=sizes, async_op=async_op)
    fn = "all_gather"
    g, sizes = resolve_args(fn, group, sizes, x=x, dim=dim)
    if g.is_single:
        return as_result(sole_chunk(fn, x, dim, sizes), Launch(async_op), async_op)
    launch = Launch(async_op)
    if sizes is not None and isinstance(x, torch.Tensor) and not needs_graph(x) \
            and equal_on_dim0(x, _normalize_dim(fn, dim, x.ndim), sizes) \
            and x.shape[0] == sizes[g.rank]:  # no graph, no spec: the shortest path
        return as_result(all_gather_equal(x, g, launch), launch, async_op)
    spec, inp = chunks_spec(fn, x, dim, g, sizes, root=-1)
    return as_result(apply_or_run(_AllGather, inp, spec, launch), launch, async_op)


@overload
def reduce_scatter(x: torch.Tensor, *, dim: int = ..., op: ReduceOpName = ...,
                   group: GroupLike = ..., sizes: Sequence[int] | None = ...,
                   async_op: Literal[False] = ...) -> torch.Tensor: ...
@overload
def reduce_scatter(x: torch.Tensor, *, dim: int = ..., op: ReduceOpName = ...,
                   group: GroupLike = ..., sizes: Sequence[int] | None = ...,
                   async_op: Literal[True]) -> CollaborativeTensor: ...
@overload
def reduce_scatter(x: torch.Tensor, *, dim: int = ..., op: ReduceOpName = ...,
                   group: GroupLike = ..., sizes: Sequence[int] | None = ...,
                   async_op: bool) -> torch.Tensor | CollaborativeTensor: ...
def reduce_scatter(x: torch.Tensor, *, dim: int = 0, op: ReduceOpName = "sum",
                   group: GroupLike = None, sizes: Sequence[int] | None = None,
                   async_op: bool = False) -> torch.Tensor | CollaborativeTensor:
    """Reduce every rank's ``x`` and keep this rank's chunk of the result.

    Forward: reduce-scatter. Backward: all-gather of the chunk gradients.

    Every rank passes a tensor of the same shape; the result is split along ``dim`` like
    ``torch.tensor_split`` (or by ``sizes``).

    Args:
        x: this rank's full-size contribution.
        dim: the dimension to split the result along.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"`` (max/min have no backward).
        group: the process group (``None``: the default group, resolved at call time).
        sizes: chunk lengths along ``dim``, one per rank.
        async_op: return a `CollaborativeTensor` without waiting.

    Returns:
        This rank's chunk of the reduction (or a handle to it).

    Raises:
        ValueError: unknown ``op``, bad ``dim`` or ``sizes``.
        CollectiveTypeError: a dtype the backend cannot reduce, as for `reduce`.
        TensorparError: backward through ``op="max"``/``"min"``.

    Shape:
        ``x``: ``(*, L, *)``; output: ``(*, sizes[rank], *)``.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.reduce_scatter(torch.arange(3.0))
        tensor([0., 1., 2.])
    """
    if compiling():  # the traced namesake, or this function between two graphs
        return compiled_call(reduce_scatter, _traced.reduce_scatter, True,
                             x, dim=dim, op=op, group=group, sizes=sizes, async_op=async_op)
    fn = "reduce_scatter"
    g, tensor, op_name, d, split = split_args(fn, x, dim, group, sizes, op)
    assert op_name is not None
    if g.is_single:
        return as_result(tensor, Launch(async_op), async_op)
    launch = Launch(async_op)
    if equal_on_dim0(tensor, d, split) and not needs_graph(tensor):  # the shortest path
        return as_result(reduce_scatter_equal(tensor, g, op_name, launch), launch, async_op)
    spec = SplitSpec(group=g, root=-1, full_shape=tensor.shape, dtype=tensor.dtype, dim=d,
                     sizes=split)
    return as_result(apply_or_run(_ReduceScatter, tensor, spec, op_name, launch), launch,
                     async_op)


@overload
def all_reduce(x: torch.Tensor, *, op: ReduceOpName = ..., backward: BackwardMode = ...,
               group: GroupLike = ..., async_op: Literal[False] = ..., inplace: bool = ...,
               algorithm: Algorithm = ..., topology: Topology | None = ...) -> torch.Tensor: ...
@overload
def all_reduce(x: torch.Tensor, *, op: ReduceOpName = ..., backward: BackwardMode = ...,
               group: GroupLike = ..., async_op: Literal[True], inplace: bool = ...,
               algorithm: Algorithm = ..., topology: Topology | None = ...
               ) -> CollaborativeTensor: ...
@overload
def all_reduce(x: torch.Tensor, *, op: ReduceOpName = ..., backward: BackwardMode = ...,
               group: GroupLike = ..., async_op: bool, inplace: bool = ...,
               algorithm: Algorithm = ..., topology: Topology | None = ...
               ) -> torch.Tensor | CollaborativeTensor: ...
def all_reduce(x: torch.Tensor, *, op: ReduceOpName = "sum", backward: BackwardMode = "sum",
               group: GroupLike = None, async_op: bool = False, inplace: bool = False,
               algorithm: Algorithm = "flat", topology: Topology | None = None
               ) -> torch.Tensor | CollaborativeTensor:
    """Reduce every rank's ``x``; every rank gets the result.

    Forward: all-reduce. Backward: ``backward="sum"`` all-reduces the gradient;
    ``backward="identity"`` passes it through.

    - ``"sum"`` (default) is the true adjoint when **each rank's loss counts** (the total
      loss is the sum of every rank's loss).
    - ``"identity"`` is right when the result feeds **one replicated loss** counted once,
      as after a row-parallel matmul (Megatron's *g*, `reduce_from_group`). With ``"sum"``
      the gradient would come out multiplied by the group size.

    ``op="mean"`` divides before reducing (no fp16 overflow) and scales the gradient the same
    way. ``op="max"``/``"min"`` are forward-only: reaching their backward raises.

    Args:
        x: this rank's tensor.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        backward: ``"sum"`` or ``"identity"``, see above.
        group: the process group (``None``: the default group, resolved at call time).
        async_op: return a `CollaborativeTensor` without waiting.
        inplace: reduce into ``x``'s own storage (no allocation) and return ``x``. Safe
            when nothing else reads or writes ``x`` until the result is resolved and autograd
            has not saved ``x`` for a backward pass (as for gradient buffers).
            Autograd refuses it on a leaf that requires grad.
        algorithm: ``"flat"``, ``"hierarchical"`` (machine by machine; sum/mean, with
            the same backward) or ``"auto"`` (hierarchical where it wins; the multi-machine guide).
        topology: the `Topology` of ``group``, for the non-flat algorithms.

    Returns:
        The reduction (or a handle to it). On a group of one rank, ``x`` itself.

    Raises:
        ValueError: unknown ``op`` or ``backward``, or ``inplace`` on a strided tensor.
        CollectiveTypeError: a dtype the backend cannot reduce, as for `reduce`.
        TensorparError: backward through ``op="max"``/``"min"``.

    Shape:
        output: the shape of ``x``.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.all_reduce(torch.ones(2), backward="identity")
        tensor([1., 1.])
    """
    if compiling():  # the traced namesake, or this function between two graphs
        return compiled_call(all_reduce, _traced.all_reduce, algorithm == "flat",
                             x, op=op, backward=backward, group=group, async_op=async_op,
                             inplace=inplace, algorithm=algorithm, topology=topology)
    fn = "all_reduce"
    g, tensor, op_name = reduction_args(fn, x, op, group, backward=backward, inplace=inplace)
    if g.is_single:
        return as_result(tensor, Launch(async_op), async_op)
    launch = Launch(async_op)
    topo = None if algorithm == "flat" else \
        hierarchical_topology(fn, algorithm, topology, tensor, op_name, g)
    out = apply_or_run(_AllReduce, tensor, g, op_name, backward, inplace, launch) \
        if topo is None else hierarchical_data(tensor, g, topo, op_name, backward, inplace, launch)
    return as_result(out, launch, async_op)


def all_to_all(x: torch.Tensor, *, split_dim: int, concat_dim: int, group: GroupLike = None,
               sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Split along ``split_dim``, send chunk ``r`` to rank ``r``, concatenate along ``concat_dim``.

    Forward: all-to-all. Backward: all-to-all of the gradient with the dims swapped.

    Without ``sizes`` the ranks exchange their shapes (one metadata message), so each rank
    may pass a different length along ``split_dim`` (split like ``torch.tensor_split``) and
    along ``concat_dim``. With ``sizes`` (the split lengths, the same list on every rank)
    every rank must pass a tensor of the same shape and no metadata is exchanged.

    Args:
        x: this rank's tensor.
        split_dim: the dimension to split and send.
        concat_dim: the dimension to concatenate the received chunks along.
        group: the process group (``None``: the default group, resolved at call time).
        sizes: chunk lengths along ``split_dim``, one per destination rank.

    Returns:
        The concatenation of the chunks every rank sent to this one, in rank order.

    Raises:
        CollectiveArgumentError: the received chunks cannot be concatenated (shapes that
            disagree outside ``concat_dim``), raised on every rank.
        ValueError: bad dims or ``sizes``.

    Shape:
        e.g. ``x``: ``(S, H)`` with ``split_dim=1, concat_dim=0`` on ``p`` ranks gives
        ``(p * S, H / p)``.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.all_to_all(torch.ones(2, 3), split_dim=1, concat_dim=0).shape
        torch.Size([2, 3])
    """
    if compiling():  # the traced namesake, or this function between two graphs
        return compiled_call(all_to_all, _traced.all_to_all, sizes is not None,
                             x, split_dim=split_dim, concat_dim=concat_dim, group=group,
                             sizes=sizes)
    return run_all_to_all(x, split_dim, concat_dim, group, sizes)
