"""Collectives where every rank holds data, as autograd Functions with dual backwards.

all_gather <-> reduce_scatter, all_reduce (sum-adjoint) <-> itself, all_reduce
(identity-adjoint) <-> copy_to_group, split_to_group <-> gather_from_group, and all_to_all
<-> all_to_all with the dims swapped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorpar import _comm
from tensorpar._autograd import SYNC, Launch, no_backward, scale_for_mean, tie_to_output, torch_op
from tensorpar._group import Group
from tensorpar._split import NATIVE_DTYPES, SplitSpec, as_bytes

__all__ = ["AllGather", "AllReduce", "AllToAll", "AllToAllSpec", "CopyToGroup",
           "GatherFromGroup", "ReduceScatter", "SplitToGroup"]


def all_gather_equal(x: torch.Tensor, group: Group, launch: Launch) -> torch.Tensor:
    """Every rank's ``x`` has the same non-empty shape and a native dtype: the chunks land in
    place along dim 0 (no flattening, no spec)."""
    send = x.contiguous()  # only read: no graph is recorded on this path
    out = send.new_empty((group.size * send.shape[0], *send.shape[1:]))
    launch.add(_comm.all_gather_into(out, send, group, async_op=launch.async_op), send)
    return out


def reduce_scatter_equal(x: torch.Tensor, group: Group, op: str, launch: Launch
                         ) -> torch.Tensor:
    """``x`` (non-empty, native dtype, the same shape on every rank) splits into equal chunks
    along dim 0; rank r keeps the reduction of chunk r."""
    send = scale_for_mean(x, op, group.size).contiguous()  # no graph is recorded here
    out = send.new_empty((send.shape[0] // group.size, *send.shape[1:]))
    launch.add(_comm.reduce_scatter_into(out, send, torch_op(op), group, launch.async_op),
               send)
    return out


def equal_on_dim0(x: torch.Tensor, dim: int, sizes: Sequence[int]) -> bool:
    """Whether the ``*_equal`` shortcuts apply: equal non-empty chunks along dim 0."""
    return dim == 0 and x.dtype in NATIVE_DTYPES and sizes[0] > 0 and len(set(sizes)) == 1


def all_gather_data(x: torch.Tensor, spec: SplitSpec, launch: Launch) -> torch.Tensor:
    if equal_on_dim0(x, spec.dim, spec.sizes):
        return all_gather_equal(x, spec.group, launch)
    g, numels = spec.group, spec.numels
    width = max(numels)
    if width == 0:
        return x.new_empty(spec.full_shape)
    send = x.detach().contiguous().view(-1)
    if not spec.is_even:
        send = torch.cat([send, send.new_empty(width - send.numel())])
    if spec.is_even and spec.leading_is_one:  # every rank's chunk lands in place
        out = x.new_empty(spec.full_shape)
        launch.add(_comm.all_gather_into(as_bytes(out), as_bytes(send), g,
                                         async_op=launch.async_op), send)
        return out
    rows = x.new_empty((g.size, width))
    work = _comm.all_gather_into(as_bytes(rows), as_bytes(send), g, async_op=launch.async_op)
    if work is not None:
        work.wait()  # the chunks are reassembled below, so they must be valid now
    return torch.cat([rows[r, : numels[r]].view(spec.chunk_shape(r)) for r in range(g.size)],
                     spec.dim)


def reduce_scatter_data(x: torch.Tensor, spec: SplitSpec, op: str, launch: Launch
                        ) -> torch.Tensor:
    if equal_on_dim0(x, spec.dim, spec.sizes):
        return reduce_scatter_equal(x, spec.group, op, launch)
    g, numels = spec.group, spec.numels
    shape = spec.chunk_shape(g.rank)
    width = max(numels)
    if width == 0:
        return x.new_empty(shape)
    source = scale_for_mean(x.detach(), op, g.size)
    if spec.is_even and spec.leading_is_one:
        inp = source.contiguous().view(-1)
        out = x.new_empty(shape)
        launch.add(_comm.reduce_scatter_into(out.view(-1), inp, torch_op(op), g,
                                             launch.async_op), inp)
        return out
    stage = x.new_empty((g.size, width))  # the padding is reduced but never read
    for r, part in enumerate(source.split(list(spec.sizes), spec.dim)):
        stage[r, : numels[r]].view(part.shape).copy_(part)
    recv = x.new_empty(width)
    launch.add(_comm.reduce_scatter_into(recv, stage.view(-1), torch_op(op), g,
                                         launch.async_op), stage)
    return recv[: numels[g.rank]].view(shape)


def all_reduce_data(x: torch.Tensor, group: Group, op: str, inplace: bool, launch: Launch
                    ) -> torch.Tensor:
    """All-reduce into ``x`` itself (``inplace``) or into a contiguous copy of it."""
    if inplace:
        out = x.div_(group.size) if op == "mean" else x
    else:  # a contiguous copy: every rank's bytes must be in the same (memory) order
        out = x.detach().clone(memory_format=torch.contiguous_format)
        if op == "mean":
            out.div_(group.size)
    launch.add(_comm.all_reduce(out, torch_op(op), group, launch.async_op), out)
    return out


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: SplitSpec, launch: Launch) -> torch.Tensor:
        ctx.spec = spec
        out = all_gather_data(x, spec, launch)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ReduceScatter.apply(tie_to_output(grad, ctx), ctx.spec, "sum", SYNC), None, None


class ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: SplitSpec, op: str, launch: Launch
                ) -> torch.Tensor:
        ctx.spec, ctx.op = spec, op
        out = reduce_scatter_data(x, spec, op, launch)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.op in ("max", "min"):
            raise no_backward("reduce_scatter", ctx.op)
        out = AllGather.apply(tie_to_output(grad, ctx), ctx.spec, SYNC)
        return scale_for_mean(out, ctx.op, ctx.spec.group.size), None, None, None


class AllReduce(torch.autograd.Function):
    """``mode="sum"``: backward all-reduces the gradient; ``"identity"``: passes it through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, op: str, mode: str, inplace: bool,
                launch: Launch) -> torch.Tensor:
        ctx.group, ctx.op, ctx.mode = group, op, mode
        if inplace:
            ctx.mark_dirty(x)
        out = all_reduce_data(x, group, op, inplace, launch)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.op in ("max", "min"):
            raise no_backward("all_reduce", ctx.op)
        grad = tie_to_output(grad, ctx)
        if ctx.mode == "sum":
            out = AllReduce.apply(grad, ctx.group, "sum", "sum", False, SYNC)
        else:
            out = CopyToGroup.apply(grad, ctx.group)
        return scale_for_mean(out, ctx.op, ctx.group.size), None, None, None, None, None


class CopyToGroup(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return AllReduce.apply(tie_to_output(grad, ctx), ctx.group, "sum", "identity", False,
                               SYNC), None


class SplitToGroup(torch.autograd.Function):
    """Forward: this rank's chunk of a replicated tensor. Backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
        ctx.spec = spec
        start = sum(spec.sizes[: spec.group.rank])
        out = x.detach().narrow(spec.dim, start, spec.sizes[spec.group.rank]).clone(
            memory_format=torch.contiguous_format)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return GatherFromGroup.apply(tie_to_output(grad, ctx), ctx.spec), None


class GatherFromGroup(torch.autograd.Function):
    """Forward: all-gather. Backward: this rank's chunk of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
        ctx.spec = spec
        out = all_gather_data(x, spec, SYNC)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return SplitToGroup.apply(tie_to_output(grad, ctx), ctx.spec), None


@dataclass(frozen=True)
class AllToAllSpec:
    """What this rank sends (lengths along ``split_dim``) and receives (shapes per source)."""

    group: Group
    split_dim: int
    concat_dim: int
    send_sizes: tuple[int, ...]
    recv_shapes: tuple[torch.Size, ...]
    even: bool
    """Every rank sends and receives equal chunks; the same on every rank, since the ranks
    must agree on gloo's equal-split path versus its split-list one."""

    @functools.cached_property
    def out_shape(self) -> torch.Size:
        """The concatenation of the received chunks."""
        shape = list(self.recv_shapes[0])
        shape[self.concat_dim] = sum(s[self.concat_dim] for s in self.recv_shapes)
        return torch.Size(shape)

    def dual(self, in_shape: torch.Size) -> AllToAllSpec:
        """The spec of the backward: gradients travel back the way the data came."""
        sent = []
        for n in self.send_sizes:
            shape = list(in_shape)
            shape[self.split_dim] = n
            sent.append(torch.Size(shape))
        return AllToAllSpec(self.group, self.concat_dim, self.split_dim,
                            tuple(s[self.concat_dim] for s in self.recv_shapes), tuple(sent),
                            self.even)


def all_to_all_dim0(x: torch.Tensor, sizes: Sequence[int], group: Group, launch: Launch
                    ) -> torch.Tensor:
    """The common all-to-all (e.g. token dispatch): every rank holds the same shape and sends
    ``sizes[r]`` rows along dim 0 to rank ``r`` (the same ``sizes`` on every rank), so
    chunks leave and land in place. ``x`` must have a dtype the backends move natively."""
    send = x.contiguous()
    n = group.size
    if sizes.count(sizes[0]) == n:  # equal chunks: the output has x's shape
        recv = torch.empty_like(send)
        launch.add(_comm.all_to_all(recv, send, None, None, group, launch.async_op), send)
        return recv
    mine = sizes[group.rank]
    recv = send.new_empty((mine * n, *send.shape[1:]))
    per_row = send.numel() // send.shape[0]
    launch.add(_comm.all_to_all(recv.view(-1), send.view(-1), [mine * per_row] * n,
                                [k * per_row for k in sizes], group, launch.async_op), send)
    return recv


def all_to_all_data(x: torch.Tensor, spec: AllToAllSpec, launch: Launch) -> torch.Tensor:
    x = x.detach()
    if spec.split_dim == 0 == spec.concat_dim and spec.even and x.dtype in NATIVE_DTYPES:
        return all_to_all_dim0(x, spec.send_sizes, spec.group, launch)
    unit = 1 if x.dtype in NATIVE_DTYPES else x.element_size()  # as_bytes' elements per item
    if math.prod(x.shape[: spec.split_dim]) == 1:  # the parts are consecutive in memory
        send = x.contiguous()
        per_row = x.numel() // max(x.shape[spec.split_dim], 1)
        in_splits = [n * per_row for n in spec.send_sizes]
    else:
        parts = x.split(list(spec.send_sizes), spec.split_dim)
        send = torch.cat([p.reshape(-1) for p in parts])
        in_splits = [p.numel() for p in parts]
    out_numels = [math.prod(s) for s in spec.recv_shapes]
    out_shape = spec.out_shape
    lands_in_place = math.prod(out_shape[: spec.concat_dim]) == 1  # chunks arrive in order
    recv = x.new_empty(out_shape if lands_in_place else (sum(out_numels),))
    work = _comm.all_to_all(as_bytes(recv), as_bytes(send),
                            None if spec.even else [n * unit for n in out_numels],
                            None if spec.even else [n * unit for n in in_splits],
                            spec.group, launch.async_op)
    if lands_in_place:
        launch.add(work, send)
        return recv
    if work is not None:
        work.wait()
    pieces = recv.split(out_numels)
    return torch.cat([p.view(s) for p, s in zip(pieces, spec.recv_shapes, strict=True)],
                     spec.concat_dim)


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: AllToAllSpec, launch: Launch) -> torch.Tensor:
        ctx.spec, ctx.in_shape = spec, x.shape
        out = all_to_all_data(x, spec, launch)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return AllToAll.apply(tie_to_output(grad, ctx), ctx.spec.dual(ctx.in_shape), SYNC), \
            None, None
