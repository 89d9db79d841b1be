"""Point-to-point transfers whose backward is their mirror: a send's backward receives.

A pipeline stage hands its activation to the next stage with `send` and the next stage
takes it with `recv`. In the backward pass the roles swap: the receiver sends the gradient
of what it received back to the sender, and the sender's backward receives it. Both sides
stay in one autograd graph each: `send` returns a `TensorPlaceholder` (the activation now
lives on ``dst``) whose ``.backward()`` waits for that gradient and pushes it into the
sender's graph.

The activation's metadata travels first, as a small int64 header (shape, dtype,
``requires_grad``; never pickle), so the receiver needs no shape inference and a new shape
every call works. Gradients travel without a header: both sides know their shape.

``dst``/``src`` are ranks **within** ``group``; the conversion to global ranks happens here.
Sends are posted with ``isend``; ``pending`` lets a schedule collect the handles and wait
for them once (the public functions wait before returning).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from tensorpar.comm._group import Group, GroupLike, resolve_group
from tensorpar.errors import CollectiveArgumentError, CollectiveTypeError
from tensorpar.placeholder import (
    HEADER_LEN,
    KIND_TENSOR,
    TensorPlaceholder,
    decode_header,
    encode_header,
)

__all__ = ["recv", "send"]


class Meta(NamedTuple):
    """What a receive buffer needs: shape, dtype and device."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


@dataclass(eq=False)
class Link:
    """One direction of a transfer: the peer (a group rank), the tag, where sends wait.

    ``back_tag`` is the tag the gradient of this transfer travels with, the other way.
    ``pending`` collects ``(work, tensors)`` of posted sends; ``None``: wait at once.
    """

    group: Group
    peer: int
    tag: int
    back_tag: int
    pending: list[tuple[Any, tuple[torch.Tensor, ...]]] | None = field(default=None)
    waited: list[float] | None = field(default=None)  # seconds spent in receives, added up

    def reverse(self) -> Link:
        """The link the gradient of this transfer travels on (the other way)."""
        return Link(self.group, self.peer, self.back_tag, self.tag, self.pending, self.waited)

    def post_send(self, *tensors: torch.Tensor) -> None:
        """Post a send of each tensor (``isend``); wait at once when there is no ``pending``."""
        handle = self.group.handle
        dst = self.group.global_rank(self.peer)
        for t in tensors:
            work = dist.isend(t, dst=dst, group=handle, tag=self.tag)
            if work is None:  # pragma: no cover - not a member of the group
                continue
            if self.pending is None:
                work.wait()
            else:
                self.pending.append((work, tensors))

    def receive(self, buffer: torch.Tensor) -> torch.Tensor:
        """Receive into ``buffer`` (blocking) and return it."""
        start = time.perf_counter()
        dist.recv(buffer, src=self.group.global_rank(self.peer), group=self.group.handle,
                  tag=self.tag)
        if self.waited is not None:
            self.waited[0] += time.perf_counter() - start
        return buffer


def _header_of(x: torch.Tensor, link: Link, requires_grad: bool) -> torch.Tensor:
    header = encode_header(KIND_TENSOR, x.shape, x.dtype, requires_grad, x.device.type)
    return header.to(link.group.comm_device(x.device))


class _Send(torch.autograd.Function):
    """Forward: send ``x`` to the peer. Backward: receive its gradient from the peer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, link: Link) -> torch.Tensor:
        data = x.detach().contiguous()
        link.post_send(data)
        ctx.link = link
        ctx.meta = Meta(x.shape, x.dtype, x.device)
        return x.new_empty(0)  # the anchor of the send in this rank's graph

    @staticmethod
    def backward(ctx: Any, anchor_grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad: torch.Tensor = _Recv.apply(anchor_grad, ctx.link.reverse(), ctx.meta)
        return grad, None


class _Recv(torch.autograd.Function):
    """Forward: receive a tensor from the peer. Backward: send its gradient to the peer."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, link: Link,
                meta: Meta) -> torch.Tensor:
        ctx.link = link
        ctx.anchor_shape = anchor.shape
        return link.receive(torch.empty(meta.shape, dtype=meta.dtype, device=meta.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        anchor_grad: torch.Tensor = _Send.apply(grad, ctx.link.reverse())
        return anchor_grad.reshape(ctx.anchor_shape), None, None


def send_activation(x: torch.Tensor, link: Link) -> TensorPlaceholder:
    """Send the header and ``x`` over ``link``; a placeholder of ``x`` owned by the peer."""
    graph = x.requires_grad and torch.is_grad_enabled()
    link.post_send(_header_of(x, link, graph))
    if graph:
        anchor = _Send.apply(x, link)
        return TensorPlaceholder(x.shape, x.dtype, device=x.device, requires_grad=True,
                                 owner=link.peer, group=link.group.handle, _anchor=anchor)
    link.post_send(x.detach().contiguous())
    return TensorPlaceholder(x.shape, x.dtype, device=x.device, requires_grad=False,
                             owner=link.peer, group=link.group.handle)


def recv_activation(like: TensorPlaceholder | None, link: Link,
                    device: torch.device | None = None) -> torch.Tensor:
    """Receive the header, check it against ``like``, then the data (in the graph if needed)."""
    comm = link.group.comm_device(device if device is not None else
                                  like.device if like is not None else None)
    header = decode_header(link.receive(torch.empty(HEADER_LEN, dtype=torch.int64,
                                                    device=comm)).cpu())
    dtype = header.tensor_dtype
    if like is not None and (like.shape, like.dtype) != (header.shape, dtype):
        raise CollectiveArgumentError(
            f"recv: the placeholder describes {like.dtype}{list(like.shape)}, but rank "
            f"{link.peer} sent {header.describe()}")
    where = device if device is not None else like.device if like is not None else comm
    meta = Meta(header.shape, dtype, where)
    if header.requires_grad and torch.is_grad_enabled():
        anchor = torch.empty(0, dtype=dtype, device=where, requires_grad=True)
        out: torch.Tensor = _Recv.apply(anchor, link, meta)
        return out
    return link.receive(torch.empty(meta.shape, dtype=dtype, device=where))


def _link(fn: str, group: GroupLike, peer: object, name: str, tag: object) -> Link:
    g = resolve_group(group, fn)
    rank = g.check_rank(fn, name, peer)
    if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise CollectiveTypeError(f"{fn}: tag must be an int >= 0, got {tag!r}")
    if rank == g.rank:
        raise CollectiveArgumentError(
            f"{fn}: {name}={rank} is this rank; a point-to-point transfer needs another rank")
    return Link(g, rank, tag, tag)


def send(x: torch.Tensor, *, dst: int, group: GroupLike = None, tag: int = 0
         ) -> TensorPlaceholder:
    """Send ``x`` to rank ``dst``; the gradient comes back the same way in the backward.

    Forward: send to ``dst``. Backward: receive the gradient from ``dst``.

    The metadata (shape, dtype, ``requires_grad``) travels first as an int64 header, so
    ``dst`` calls `recv` without knowing the shape. The result is a `TensorPlaceholder`
    (``owner=dst``); when ``x`` requires grad, its ``.backward()`` receives the gradient
    that ``dst``'s backward sends and accumulates it into the graph of ``x``.

    Args:
        x: the tensor to send.
        dst: the receiving rank, a rank **within** ``group``.
        group: the process group (``None``: the default group, resolved at call time).
        tag: tells transfers between the same two ranks apart (the gradient comes back
            with the same tag).

    Returns:
        A placeholder of ``x``, owned by ``dst``.

    Raises:
        CollectiveArgumentError: ``dst`` is not another rank of the group.
        CollectiveTypeError: ``x`` is not a tensor, or ``tag`` is not an int >= 0.

    Shape:
        ``x``: any; the placeholder has its shape.
    """
    if not isinstance(x, torch.Tensor):
        raise CollectiveTypeError(f"send: x must be a tensor, got {type(x).__name__}")
    return send_activation(x, _link("send", group, dst, "dst", tag))


def recv(like: TensorPlaceholder | None = None, *, src: int, group: GroupLike = None,
         tag: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """Receive the tensor rank ``src`` sends with `send`; its gradient goes back in backward.

    Forward: receive from ``src``. Backward: send the gradient to ``src``.

    Args:
        like: a placeholder to check the received metadata against (``None``: take it as
            it comes).
        src: the sending rank, a rank **within** ``group``.
        group: the process group (``None``: the default group, resolved at call time).
        tag: the tag the sender used.
        device: where to put the tensor (default: ``like``'s device, else the group's).

    Returns:
        The tensor; it requires grad when the sender's did.

    Raises:
        CollectiveArgumentError: ``src`` is not another rank of the group, or the metadata
            disagrees with ``like``.

    Shape:
        output: the sender's shape.
    """
    if like is not None and not isinstance(like, TensorPlaceholder):
        raise CollectiveTypeError(f"recv: like must be a TensorPlaceholder or None, got "
                                  f"{type(like).__name__}")
    link = _link("recv", group, src, "src", tag)
    return recv_activation(like, link, None if device is None else torch.device(device))
