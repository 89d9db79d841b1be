"""Collectives where every rank holds data, as autograd Functions with dual backwards.

all_gather <-> reduce_scatter, all_reduce (sum-adjoint) <-> itself, all_reduce
(identity-adjoint) <-> copy_to_group, split_to_group <-> gather_from_group. (all_to_all
has its own module, `_alltoall`.) The Functions the public API may call without a graph
carry their data path as ``data`` (see `apply_or_run`); so do the ones a backward applies,
which runs the data path unless a graph of the backward is being built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch

from tensorpar.collectives._autograd import (
    apply_or_run,
    no_backward,
    scale_for_mean,
    tie_to_output,
    torch_op,
)
from tensorpar.collectives._split import NATIVE_DTYPES, SplitSpec, as_bytes
from tensorpar.comm import _comm
from tensorpar.comm._group import Group
from tensorpar.comm._launch import SYNC, Launch
from tensorpar.validation import check_backward, last_site

__all__ = ["ReducePath", "all_gather_equal", "all_reduce_data", "equal_on_dim0",
           "reduce_scatter_equal"]

ReducePath: TypeAlias = Callable[[torch.Tensor, Group, str, bool, Launch], torch.Tensor]
"""How `_AllReduce` moves the data: ``path(x, group, op, inplace, launch)`` all-reduces ``x``
over ``group`` (into ``x`` itself where ``inplace``, else into a contiguous copy), divides
for ``op="mean"`` once, adds its work to ``launch`` and returns the result."""


def all_gather_equal(x: torch.Tensor, group: Group, launch: Launch) -> torch.Tensor:
    """All-gather equal chunks along dim 0, landing in place (no flattening, no spec).

    Every rank's ``x`` has the same non-empty shape and a native dtype.
    """
    send = x.contiguous()  # only read: no graph is recorded on this path
    out = send.new_empty((group.size * send.shape[0], *send.shape[1:]))
    # (through ``.data``: a backend that finishes with a copy into ``out`` when the handle
    # is waited on must not record it on autograd's output, whose gradient it would take)
    launch.add(_comm.all_gather_into(out.data, send, group, async_op=launch.async_op), send)
    return out


def reduce_scatter_equal(x: torch.Tensor, group: Group, op: str, launch: Launch
                         ) -> torch.Tensor:
    """Reduce-scatter equal chunks along dim 0: rank r keeps the reduction of chunk r.

    ``x`` is non-empty, of a native dtype and of the same shape on every rank.
    """
    send = scale_for_mean(x, op, group.size).contiguous()  # no graph is recorded here
    out = send.new_empty((send.shape[0] // group.size, *send.shape[1:]))
    launch.add(_comm.reduce_scatter_into(out.data, send, torch_op(op), group,
                                         launch.async_op), send)  # (.data: see above)
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

    def chunks() -> list[torch.Tensor]:
        return [rows[r, : numels[r]].view(spec.chunk_shape(r)) for r in range(g.size)]

    if work is None:
        return torch.cat(chunks(), spec.dim)
    # In flight: the chunks are reassembled into ``out`` when the handle is resolved. The
    # write goes through ``.data``: it fills a result nobody may read before then, and must
    # not count as an in-place change of a tensor a backward has saved.
    out = x.new_empty(spec.full_shape)
    launch.add(work, send, rows)
    launch.then(lambda: torch.cat(chunks(), spec.dim, out=out.data))
    return out


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
        launch.add(_comm.reduce_scatter_into(out.data.view(-1), inp, torch_op(op), g,
                                             launch.async_op), inp)  # (.data: as above)
        return out
    stage = x.new_empty((g.size, width))  # the padding is reduced but never read
    for r, part in enumerate(source.split(list(spec.sizes), spec.dim)):
        stage[r, : numels[r]].view(part.shape).copy_(part)
    recv = x.new_empty(width)
    work = _comm.reduce_scatter_into(recv, stage.view(-1), torch_op(op), g, launch.async_op)
    if work is None:
        return recv[: numels[g.rank]].view(shape)
    # In flight: copied out of ``recv`` when the handle is resolved, through ``.data`` (as
    # `all_gather_data`): a view of the buffer would be changed in place under autograd
    out = x.new_empty(shape)
    launch.add(work, stage, recv)
    launch.then(lambda: out.data.copy_(recv[: numels[g.rank]].view(shape)))
    return out


def all_reduce_data(x: torch.Tensor, group: Group, op: str, inplace: bool, launch: Launch
                    ) -> torch.Tensor:
    """All-reduce into ``x`` itself (``inplace``) or into a contiguous copy of it.

    The flat data path of `_AllReduce` (a `ReducePath`): one collective on ``group``.
    """
    if inplace:
        out = x.div_(group.size) if op == "mean" else x
    else:  # a contiguous copy: every rank's bytes must be in the same (memory) order
        out = x.detach().clone(memory_format=torch.contiguous_format)
        if op == "mean":
            out.div_(group.size)
    launch.add(_comm.all_reduce(out, torch_op(op), group, launch.async_op), out)
    return out


class _AllGather(torch.autograd.Function):
    data = staticmethod(all_gather_data)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: SplitSpec, launch: Launch) -> torch.Tensor:
        ctx.spec = spec
        ctx.site = last_site(spec.group)  # for the backward's check
        out = all_gather_data(x, spec, launch)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        check_backward("reduce_scatter", ctx.spec.group, ctx.spec, op="sum", site=ctx.site)
        return apply_or_run(_ReduceScatter, tie_to_output(grad, ctx), ctx.spec, "sum", SYNC), \
            None, None


class _ReduceScatter(torch.autograd.Function):
    data = staticmethod(reduce_scatter_data)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: SplitSpec, op: str, launch: Launch
                ) -> torch.Tensor:
        ctx.spec, ctx.op = spec, op
        ctx.site = last_site(spec.group)  # for the backward's check
        out = reduce_scatter_data(x, spec, op, launch)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.op in ("max", "min"):
            raise no_backward("reduce_scatter", ctx.op)
        check_backward("all_gather", ctx.spec.group, ctx.spec, site=ctx.site)
        out = apply_or_run(_AllGather, tie_to_output(grad, ctx), ctx.spec, SYNC)
        return scale_for_mean(out, ctx.op, ctx.spec.group.size), None, None, None


class _AllReduce(torch.autograd.Function):
    """``mode="sum"``: backward all-reduces the gradient; ``"identity"``: passes it through.

    ``path`` moves the data (`all_reduce_data`, the flat all-reduce, unless given; the
    hierarchical algorithm passes its own); the rest (in place, validation, the backward
    and its scaling for the mean, double backward) is the same for every path, and the
    backward reduces the gradient through the forward's path.
    """

    @staticmethod
    def data(x: torch.Tensor, group: Group, op: str, mode: str, inplace: bool, launch: Launch,
             path: ReducePath = all_reduce_data) -> torch.Tensor:
        out = path(x, group, op, inplace, launch)
        if inplace:  # what mark_dirty does: autograd must see that x was overwritten
            torch.autograd.graph.increment_version(x)
        return out

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, op: str, mode: str, inplace: bool,
                launch: Launch, path: ReducePath = all_reduce_data) -> torch.Tensor:
        ctx.group, ctx.op, ctx.mode, ctx.path = group, op, mode, path
        ctx.site = last_site(group)  # for the backward's check
        if inplace:
            ctx.mark_dirty(x)
        out = path(x, group, op, inplace, launch)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.op in ("max", "min"):
            raise no_backward("all_reduce", ctx.op)
        # a mean's gradient is divided before its sum too, as the forward's inputs are
        grad = scale_for_mean(tie_to_output(grad, ctx), ctx.op, ctx.group.size)
        if ctx.mode == "sum":
            check_backward("all_reduce", ctx.group, None, grad, op=ctx.op, mode=ctx.mode,
                           site=ctx.site)
            out = apply_or_run(_AllReduce, grad, ctx.group, "sum", "sum", False, SYNC, ctx.path)
        else:  # the identity mode issues nothing, so validation compares nothing either:
            # the ranks may differ in requires_grad, as they may without validation
            out = apply_or_run(_CopyToGroup, grad, ctx.group, ctx.path)
        return out, None, None, None, None, None, None


class _CopyToGroup(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient, through ``path``."""

    @staticmethod
    def data(x: torch.Tensor, group: Group, path: ReducePath = all_reduce_data
             ) -> torch.Tensor:
        return x

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, path: ReducePath = all_reduce_data
                ) -> torch.Tensor:
        ctx.group, ctx.path = group, path
        ctx.site = last_site(group)  # for the backward's check
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        check_backward("copy_to_group", ctx.group, None, grad, site=ctx.site)
        return apply_or_run(_AllReduce, tie_to_output(grad, ctx), ctx.group, "sum", "identity",
                            False, SYNC, ctx.path), None, None


class _SplitToGroup(torch.autograd.Function):
    """Forward: this rank's chunk of a replicated tensor. Backward: all-gather."""

    @staticmethod
    def data(x: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
        start = sum(spec.sizes[: spec.group.rank])
        return x.detach().narrow(spec.dim, start, spec.sizes[spec.group.rank]).clone(
            memory_format=torch.contiguous_format)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
        ctx.spec = spec
        ctx.site = last_site(spec.group)  # for the backward's check
        out = _SplitToGroup.data(x, spec)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        check_backward("split_to_group", ctx.spec.group, ctx.spec, site=ctx.site)
        return apply_or_run(_GatherFromGroup, tie_to_output(grad, ctx), ctx.spec), None


class _GatherFromGroup(torch.autograd.Function):
    """Forward: all-gather. Backward: this rank's chunk of the (replicated) gradient."""

    @staticmethod
    def data(x: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
        return all_gather_data(x, spec, SYNC)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
        ctx.spec = spec
        out = all_gather_data(x, spec, SYNC)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return apply_or_run(_SplitToGroup, tie_to_output(grad, ctx), ctx.spec), None
