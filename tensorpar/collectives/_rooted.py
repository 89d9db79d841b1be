"""Rooted collectives as autograd Functions: scatter <-> gather, broadcast <-> reduce.

Each backward calls its dual's ``.apply``. On ranks that hold no data the Functions take and
return an empty "anchor" tensor, which keeps those ranks in the autograd graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tensorpar.collectives._autograd import (
    no_backward,
    scale_for_mean,
    tie_to_output,
    torch_op,
)
from tensorpar.collectives._meta import placeholder_input
from tensorpar.collectives._split import RootSpec, SplitSpec, as_bytes
from tensorpar.comm import _comm
from tensorpar.comm._group import Group
from tensorpar.comm._launch import SYNC, Launch
from tensorpar.placeholder import Header, TensorPlaceholder
from tensorpar.validation import check_backward, last_site

__all__ = ["placeholder_for", "placeholder_of", "root_input"]


def root_input(x: object, root: int, g: Group, header: Header) -> torch.Tensor:
    """The autograd input of a rooted Function: the tensor on the root, an anchor elsewhere.

    The anchor is described by the source's ``header``.
    """
    if g.rank == root:
        assert isinstance(x, torch.Tensor)  # source_header checked it
        return x
    ph = x if isinstance(x, TensorPlaceholder) else None
    assert header.dtype is not None  # a source header always has one
    return placeholder_input(ph, header.dtype, header.requires_grad and torch.is_grad_enabled(),
                             g, header.device_type)


def placeholder_of(anchor: torch.Tensor, spec: RootSpec) -> TensorPlaceholder:
    """The placeholder a non-root rank gets, carrying the collective's autograd anchor."""
    return placeholder_for(anchor, spec.full_shape, spec.dtype, spec.root, spec.group)


def placeholder_for(anchor: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, root: int,
                    g: Group) -> TensorPlaceholder:
    """`placeholder_of` from the fields of a spec (what the traced collectives have)."""
    return TensorPlaceholder(shape, dtype, device=anchor.device,
                             requires_grad=anchor.requires_grad, owner=root, group=g.handle,
                             _anchor=anchor)


def scatter_data(x: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
    """Root: ``x`` is the full tensor. Others: ``x`` only supplies the device."""
    g, numels = spec.group, spec.numels
    shape = spec.chunk_shape(g.rank)
    width = max(numels)
    if width == 0:
        return x.new_empty(shape, dtype=spec.dtype)
    recv = x.new_empty(width, dtype=spec.dtype)
    chunks: list[torch.Tensor] | None = None
    if spec.is_root:
        parts = x.detach().split(list(spec.sizes), spec.dim)
        if spec.is_even:
            chunks = [as_bytes(p.contiguous()) for p in parts]
        else:
            stage = x.new_empty((g.size, width), dtype=spec.dtype)
            for r, p in enumerate(parts):
                stage[r, : numels[r]].view(p.shape).copy_(p)
            chunks = [as_bytes(row) for row in stage]
    _comm.scatter(as_bytes(recv), chunks, spec.root, g)
    return recv[: numels[g.rank]].view(shape)


def gather_data(chunk: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
    """Root: returns the full tensor. Others: returns an empty autograd anchor."""
    g, numels = spec.group, spec.numels
    width = max(numels)
    if width == 0:
        return chunk.new_empty(spec.full_shape if spec.is_root else (0,))
    send = chunk.detach().contiguous().view(-1)
    if not spec.is_even:
        send = torch.cat([send, send.new_empty(width - send.numel())])
    if not spec.is_root:
        _comm.gather(as_bytes(send), None, spec.root, g)
        return chunk.new_empty(0)
    direct = spec.is_even and spec.leading_is_one
    full = chunk.new_empty(spec.full_shape) if direct else chunk.new_empty((g.size, width))
    rows = full.view(g.size, width)
    _comm.gather(as_bytes(send), [as_bytes(row) for row in rows], spec.root, g)
    if direct:
        return full
    parts = [rows[r, : numels[r]].view(spec.chunk_shape(r)) for r in range(g.size)]
    return torch.cat(parts, spec.dim)


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
        ctx.spec = spec
        ctx.site = last_site(spec.group)  # for the backward's check
        out = scatter_data(x, spec)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        check_backward("gather", ctx.spec.group, ctx.spec, site=ctx.site)
        return _Gather.apply(tie_to_output(grad, ctx), ctx.spec), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: SplitSpec) -> torch.Tensor:
        ctx.spec = spec
        ctx.site = last_site(spec.group)  # for the backward's check
        out = gather_data(x, spec)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        check_backward("scatter", ctx.spec.group, ctx.spec, site=ctx.site)
        return _Scatter.apply(tie_to_output(grad, ctx), ctx.spec), None


class _Broadcast(torch.autograd.Function):
    """Root: ``x`` is the tensor (copied, never aliased). Others: ``x`` is an anchor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: RootSpec, launch: Launch) -> torch.Tensor:
        ctx.spec = spec
        ctx.site = last_site(spec.group)  # for the backward's check
        # a contiguous copy: the bytes travel in memory order, whatever x's strides are
        out = x.detach().clone(memory_format=torch.contiguous_format) if spec.is_root \
            else x.new_empty(spec.full_shape)
        if spec.full_shape.numel():  # as bytes where the backend cannot move the dtype
            launch.add(_comm.broadcast(as_bytes(out), spec.root, spec.group, launch.async_op),
                       out)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        check_backward("reduce", ctx.spec.group, ctx.spec, op="sum", site=ctx.site)
        return _Reduce.apply(tie_to_output(grad, ctx), ctx.spec, "sum", SYNC), None, None


class _Reduce(torch.autograd.Function):
    """Root gets the reduction; other ranks get an empty anchor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: RootSpec, op: str, launch: Launch
                ) -> torch.Tensor:
        ctx.spec, ctx.op = spec, op
        ctx.site = last_site(spec.group)  # for the backward's check
        # torch.distributed.reduce may use non-root inputs as scratch: reduce a copy.
        buf = scale_for_mean(x.detach(), op, spec.group.size).clone(
            memory_format=torch.contiguous_format)
        if buf.numel():
            launch.add(_comm.reduce(buf, spec.root, torch_op(op), spec.group, launch.async_op),
                       buf)
        out = buf if spec.is_root else x.new_empty(0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.op in ("max", "min"):
            raise no_backward("reduce", ctx.op)
        check_backward("broadcast", ctx.spec.group, ctx.spec, site=ctx.site)
        out = _Broadcast.apply(tie_to_output(grad, ctx), ctx.spec, SYNC)
        return scale_for_mean(out, ctx.op, ctx.spec.group.size), None, None, None
