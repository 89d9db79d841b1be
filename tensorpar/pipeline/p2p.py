"""Point-to-point transfers whose backward is their mirror: a send's backward receives.

A pipeline stage hands its activation to the next stage with `send` and the next stage
takes it with `recv`. In the backward pass the roles swap: the receiver sends the gradient
of what it received back to the sender, and the sender's backward receives it. Both sides
stay in one autograd graph each: `send` returns a `TensorPlaceholder` (the activation now
lives on ``dst``) whose ``.backward()`` waits for that gradient and pushes it into the
sender's graph.

The activation's metadata travels with it, as a small int64 header (shape, dtype,
``requires_grad``; never pickle), so the receiver needs no shape inference and a new shape
every call works. The first message of an activation is a *frame*: the header, then room
for ``room`` bytes of data that both sides agree on before the transfer (a pipeline uses
what the same transfer carried in its previous step; the public functions use 0). When
the activation fits, it travels inside the frame: one message. Otherwise the data follows
in a second message; the receiver learns which from the header. A gradient travels in a
frame too, whose room both sides know from the activation's shape (`gradient_room`): so
a rank that raised can send a frame that says no gradient comes (`send_no_gradient`) to
a peer waiting for one, and the peer raises instead of waiting; and a stage that did not
use what it received says so (`send_unused`): the sender's backward gives no gradient
there, as dense gives none.

``dst``/``src`` are ranks **within** ``group``; the conversion to global ranks happens here.
Sends are posted with ``isend``; ``pending`` lets a schedule collect the handles and wait
for them once (the public functions wait before returning). On a link that may post ahead
(``eager``: a backend that pairs transfers by tag, gloo), receives are posted before they
are needed: the gradient's as soon as the activation is sent, and a schedule's activations
through an `Inbox`. gloo moves a message only once both sides have posted it, so a receive
posted late waits for the sender's progress thread; posted early, the data is there.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.graph import GradientEdge

from tensorpar.comm._faults import Pending, raise_translated_peer
from tensorpar.comm._group import Group, GroupLike, resolve_group
from tensorpar.errors import CollectiveArgumentError, CollectiveTypeError
from tensorpar.placeholder import (
    HEADER_LEN,
    KIND_NONE,
    KIND_OTHER,
    KIND_TENSOR,
    Header,
    TensorPlaceholder,
    decode_header,
    encode_header,
)

__all__ = ["NothingSent", "follows_for", "gradient_sent", "linger", "receive_edge", "recv", "send",
           "send_no_gradient", "send_nothing", "send_unused"]


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
    eager: bool = False  # receives may be posted ahead (the backend pairs them by tag)

    def reverse(self) -> Link:
        """The link the gradient of this transfer travels on (the other way)."""
        return Link(self.group, self.peer, self.back_tag, self.tag, self.pending, self.waited,
                    self.eager)

    def post_receive(self, buffer: torch.Tensor) -> Posted:
        """Post a receive into ``buffer`` (``irecv``); `Posted.wait` returns it."""
        try:
            work = dist.irecv(buffer, src=self.group.global_rank(self.peer),
                              group=self.group.handle, tag=self.tag)
        except RuntimeError as exc:  # a peer gone: named, as a collective's would be
            raise_translated_peer(exc, "recv", self.group, self.peer)
        return Posted(self._named(work, "recv"), buffer, self.waited)

    def post_send(self, *tensors: torch.Tensor) -> None:
        """Post a send of each tensor (``isend``); wait at once when there is no ``pending``."""
        handle = self.group.handle
        dst = self.group.global_rank(self.peer)
        for t in tensors:
            try:
                work = self._named(dist.isend(t, dst=dst, group=handle, tag=self.tag), "send")
            except RuntimeError as exc:
                raise_translated_peer(exc, "send", self.group, self.peer)
            if work is None:  # pragma: no cover - not a member of the group
                continue
            if self.pending is None:
                work.wait()
            else:
                self.pending.append((work, tensors))

    def receive(self, buffer: torch.Tensor) -> torch.Tensor:
        """Receive into ``buffer`` (blocking) and return it."""
        start = time.perf_counter()
        try:
            dist.recv(buffer, src=self.group.global_rank(self.peer), group=self.group.handle,
                      tag=self.tag)
        except RuntimeError as exc:
            raise_translated_peer(exc, "recv", self.group, self.peer)
        if self.waited is not None:
            self.waited[0] += time.perf_counter() - start
        return buffer

    def _named(self, work: Any, kind: str) -> Any:
        """``work`` whose ``wait`` raises `PeerLostError` naming the peer if it went away."""
        return None if work is None else Pending(work, kind, self.group, self.peer)


@dataclass(eq=False)
class Posted:
    """A receive posted ahead: ``wait()`` returns the filled buffer."""

    work: Any
    buffer: torch.Tensor
    waited: list[float] | None = None

    def wait(self) -> torch.Tensor:
        """Wait for the data (counted in ``waited``) and return the buffer."""
        if self.work is not None:
            start = time.perf_counter()
            self.work.wait()
            self.work = None
            if self.waited is not None:
                self.waited[0] += time.perf_counter() - start
        return self.buffer


HEAD_BYTES = -(-HEADER_LEN * 8 // 64) * 64
"""Bytes at the front of a frame that hold the header (aligned for any dtype after it)."""


FRAME_DATA_LIMIT = 1 << 20
"""The most data bytes a frame carries: a larger activation travels in a message of its
own, not copied into the frame and out again (two copies of a large tensor for one
message saved)."""


def nbytes(x: torch.Tensor) -> int:
    """The bytes of ``x``'s data."""
    return x.numel() * x.element_size()


def room_for(x: torch.Tensor) -> int:
    """The room the next frame of a transfer that carried ``x`` gets (both sides agree)."""
    return _room(nbytes(x))


def follows_for(x: torch.Tensor) -> int:
    """The bytes of data the next frame of a transfer that carried ``x`` is followed by.

    Where receives are posted ahead, that data's receive is posted with the frame's
    (0: none; both sides agree, as on `room_for`).
    """
    return _follows(nbytes(x))


def _follows(size: int) -> int:
    return size if size > FRAME_DATA_LIMIT else 0


def gradient_room(meta: Meta) -> int:
    """The room of the frame of a gradient of ``meta`` (both sides know the activation's)."""
    return _room(_meta_bytes(meta))


def data_follows(meta: Meta) -> bool:
    """Whether a gradient of ``meta`` travels in a second message (too large for a frame)."""
    return _follows(_meta_bytes(meta)) > 0


def _meta_bytes(meta: Meta) -> int:
    return _bytes_of(meta.shape, meta.dtype)


def _bytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _room(size: int) -> int:
    return size if size <= FRAME_DATA_LIMIT else 0


def _frame(x: torch.Tensor, link: Link, requires_grad: bool, room: int
           ) -> tuple[torch.Tensor, ...]:
    """The messages that carry ``x``: its frame, then its data when it did not fit."""
    data = x.detach().contiguous()
    header = encode_header(KIND_TENSOR, x.shape, x.dtype, requires_grad, x.device.type)
    frame = torch.empty(HEAD_BYTES + room, dtype=torch.uint8,
                        device=link.group.comm_device(x.device))
    frame[:HEADER_LEN * 8].view(torch.int64).copy_(header)
    size = nbytes(data)
    fits = size <= room
    frame[HEADER_LEN * 8:HEAD_BYTES].zero_()
    frame[HEAD_BYTES + (size if fits else 0):].zero_()  # no stale bytes on the wire
    if not fits:
        return frame, data
    frame[HEAD_BYTES:HEAD_BYTES + size].view(x.dtype).copy_(data.reshape(-1))
    return (frame,)


_LINGERING: list[tuple[Any, Any]] = []
"""Transfers left in flight by a failed step, ``(work, tensors)``: kept alive until done.

gloo drops a receive or send whose work is freed before it completes, and a message that
arrives for a dropped receive goes to the next one posted on its tag: the next pipeline's.
"""


def linger(works: Iterable[tuple[Any, Any]]) -> None:
    """Keep ``works`` (``(work, tensors)`` pairs) alive until they complete.

    (A gloo send or receive reports itself complete only once waited for: those stay.)
    """
    _LINGERING[:] = [(w, t) for w, t in [*_LINGERING, *works] if not w.is_completed()]


class NothingSent(CollectiveTypeError):
    """The peer sent a frame that says no tensor follows: it raised (`send_nothing`).

    ``peer``: that rank (within the group), where known.
    """

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class _Unused(NothingSent):
    """A gradient's frame that says the peer's stage did not use the tensor (`send_unused`)."""


def send_nothing(link: Link, room: int, device: torch.device | None, follows: int = 0
                 ) -> None:
    """Tell the peer that nothing will come: a frame with no tensor (``room``: its room).

    The peer's receive of this transfer raises `NothingSent` instead of waiting. Waits for
    the frame to go where ``link`` has no ``pending`` (the public `send`). ``follows``: the
    bytes of a data receive the peer posted ahead, answered with a stand-in.
    """
    _send_empty_frame(link, room, device, KIND_OTHER, follows)


def _send_empty_frame(link: Link, room: int, device: torch.device | None, kind: int,
                      follows: int = 0) -> None:
    frame = _frame_buffer(link, room, device).zero_()
    frame[:HEADER_LEN * 8].view(torch.int64).copy_(encode_header(kind))
    link.post_send(frame, *_stand_in(follows, device))


def _stand_in(follows: int, device: torch.device | None) -> tuple[torch.Tensor, ...]:
    """What answers a data receive of ``follows`` bytes posted ahead that the data missed."""
    return (torch.zeros(follows, dtype=torch.uint8, device=device),) if follows else ()


def _gradient_messages(grad: torch.Tensor, link: Link) -> tuple[torch.Tensor, ...]:
    """The messages that carry a gradient: its frame, then its data if it did not fit."""
    return _frame(grad, link, False, room_for(grad))


def send_no_gradient(link: Link, meta: Meta) -> None:
    """Tell the peer that the gradient of ``meta`` it waits for will not come.

    Its wait raises `NothingSent`. Where the peer posted the receive of the gradient's
    data ahead (an ``eager`` link, a gradient too large for its frame), that receive gets
    a message too: every posted receive is answered, so none is left to catch a later
    transfer on its tag.
    """
    _send_gradient_frame(link, meta, KIND_OTHER)


def send_unused(link: Link, meta: Meta) -> None:
    """Tell the peer that the activation of ``meta`` it sent has no gradient: unused.

    The stage that received it did not differentiate through it (it ignored or detached
    it), so the sender's backward of that send gives no gradient, as dense gives none:
    its stage's parameters get none from it (an optimizer skips them).
    """
    _send_gradient_frame(link, meta, KIND_NONE)


def _send_gradient_frame(link: Link, meta: Meta, kind: int) -> None:
    """A gradient's frame with no tensor, and a stand-in for its data posted ahead."""
    _send_empty_frame(link, gradient_room(meta), meta.device, kind)
    if link.eager and data_follows(meta):
        link.post_send(torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device))


@dataclass(eq=False)
class GradientReceipt:
    """The receive of a gradient: on an ``eager`` link its messages are posted at once.

    ``link``: the gradient's link; ``meta``: the activation's (the gradient's) metadata.
    Posted receives join ``link.pending``: a step waits for them, also when it fails.
    """

    link: Link
    meta: Meta
    frame: Posted | None = None
    data: Posted | None = None
    got: tuple[torch.Tensor | None] | None = None  # received ahead of the backward (`fetch`)

    def __post_init__(self) -> None:
        if not self.link.eager:
            return
        room = gradient_room(self.meta)
        self.frame = self._post(_frame_buffer(self.link, room, self.meta.device))
        if data_follows(self.meta):  # its receive posted ahead too
            self.data = self._post(self._buffer())

    def _post(self, buffer: torch.Tensor) -> Posted:
        posted = self.link.post_receive(buffer)
        if self.link.pending is not None and posted.work is not None:
            self.link.pending.append((posted.work, (buffer,)))
        return posted

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.meta.shape, dtype=self.meta.dtype, device=self.meta.device)

    def fetch(self) -> None:
        """Receive the gradient now; `wait` returns it later.

        Where receives are not posted ahead they happen in the order the peer sends:
        a backward deferred as a whole (zero-bubble's W) takes its gradient at its B.
        """
        if self.got is None:
            self.got = (self._receive(),)

    def wait(self) -> torch.Tensor | None:
        """The gradient (waiting for it); ``None`` where the peer did not use the tensor.

        Raises:
            NothingSent: the peer raised instead of sending it (`send_no_gradient`).
        """
        got, self.got = self.got, None
        return got[0] if got is not None else self._receive()

    def _receive(self) -> torch.Tensor | None:
        room = gradient_room(self.meta)
        frame = self.frame.wait() if self.frame is not None else \
            self.link.receive(_frame_buffer(self.link, room, self.meta.device))
        try:
            header, data = _unframe(frame, self.meta.device)
        except _Unused:
            if self.data is not None:  # (its stand-in)
                self.data.wait()
            return None
        except NothingSent:
            raise NothingSent(f"no gradient came from rank {self.link.peer}: it raised instead "
                              f"(its error says why)", self.link.peer) from None
        if (header.shape, header.tensor_dtype) != (self.meta.shape, self.meta.dtype):
            raise CollectiveArgumentError(
                f"a gradient of {self.meta.dtype}{list(self.meta.shape)} was expected from "
                f"rank {self.link.peer}, which sent {header.describe()}")
        if data is not None:
            return data
        if self.data is not None:
            return self.data.wait()
        return self.link.receive(self._buffer())


def _unframe(frame: torch.Tensor, device: torch.device
             ) -> tuple[Header, torch.Tensor | None]:
    """The header in ``frame`` and the data it carries (``None``: a second message has it).

    Raises:
        NothingSent: the sender raised instead of sending (`send_nothing`); `_Unused` where
            it says its stage did not use the tensor (`send_unused`).
    """
    header = decode_header(frame[:HEADER_LEN * 8].view(torch.int64).cpu())
    if header.kind == KIND_NONE:
        raise _Unused("no gradient: the peer's stage did not use the tensor")
    if header.kind != KIND_TENSOR:
        raise NothingSent("no tensor came: the sending rank raised instead (its error says why)")
    dtype = header.tensor_dtype
    size = _bytes_of(header.shape, dtype)
    if size > frame.numel() - HEAD_BYTES:  # more than the frame's room
        return header, None
    data = frame[HEAD_BYTES:HEAD_BYTES + size].view(dtype).view(header.shape)
    # a tensor of its own: the stage may modify it in place (a view of the frame may not)
    return header, torch.empty(header.shape, dtype=dtype, device=device).copy_(data)


def _frame_buffer(link: Link, room: int, device: torch.device | None) -> torch.Tensor:
    return torch.empty(HEAD_BYTES + room, dtype=torch.uint8,
                       device=link.group.comm_device(device))


class _Send(torch.autograd.Function):
    """Forward: send ``x`` to the peer. Backward: receive its gradient from the peer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, link: Link,
                messages: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ctx.link = link
        # the gradient's receive (posted now on an eager link: ready whenever it comes)
        ctx.receipt = GradientReceipt(link.reverse(), Meta(x.shape, x.dtype, x.device))
        link.post_send(*messages)
        return x.new_empty(0)  # the anchor of the send in this rank's graph

    @staticmethod
    def backward(ctx: Any, anchor_grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        got = ctx.receipt.wait()
        if got is None:  # the peer's stage did not use it: no gradient, as dense has none
            return None, None, None
        grad: torch.Tensor = _Recv.apply(anchor_grad, ctx.link.reverse(), lambda: got)
        return grad, None, None


class _Recv(torch.autograd.Function):
    """Forward: receive a tensor from the peer. Backward: send its gradient to the peer."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, link: Link,
                source: Callable[[], torch.Tensor]) -> torch.Tensor:
        ctx.link = link
        ctx.anchor_shape = anchor.shape
        ctx.set_materialize_grads(False)  # (no gradient stays None: `send_unused`)
        got = source()  # the received tensor (a receive, or one posted ahead)
        ctx.meta = Meta(got.shape, got.dtype, got.device)
        return got

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None]:
        ctx.sent = True  # read by gradient_sent (ctx is the graph's node)
        if grad is None:  # this stage gave what it received no gradient: none goes back
            send_unused(ctx.link.reverse(), ctx.meta)
            return None, None, None
        # not eager: a double backward's receive would share its tag with the activations'
        back = dataclasses.replace(ctx.link.reverse(), eager=False)
        anchor_grad: torch.Tensor = _Send.apply(grad, back, _gradient_messages(grad, back))
        return anchor_grad.reshape(ctx.anchor_shape), None, None


def send_activation(x: torch.Tensor, link: Link, room: int = 0, what: str = "send",
                    follows: int = 0) -> TensorPlaceholder:
    """Send ``x`` and its header over ``link``; a placeholder of ``x`` owned by the peer.

    ``room``: the bytes of data the receiver's frame has room for (agreed by both sides).
    ``what``: where the send is, for the error raised (here and, as `NothingSent`, on the
    peer) when ``x`` cannot be sent: not one tensor, or one its header cannot describe.
    ``follows``: the bytes of the data receive the peer posted ahead (`follows_for` what
    the transfer carried last; 0: none); data of another size sends a stand-in first.
    """
    if not isinstance(x, torch.Tensor):
        send_nothing(link, room, None, follows)
        raise CollectiveTypeError(f"{what}: one tensor is sent, got {type(x).__name__}")
    graph = x.requires_grad and torch.is_grad_enabled()
    try:
        messages = _frame(x, link, graph, room)
    except CollectiveArgumentError as e:  # (its header: too many dims, or the dtype)
        send_nothing(link, room, x.device, follows)
        raise CollectiveArgumentError(f"{what}: {e} (a tensor of {x.dim()} dims, "
                                      f"{x.dtype})") from None
    if follows and not (len(messages) == 2 and nbytes(messages[1]) == follows):
        messages = (messages[0], *_stand_in(follows, x.device), *messages[1:])
    if graph:
        anchor = _Send.apply(x, link, messages)
        return TensorPlaceholder(x.shape, x.dtype, device=x.device, requires_grad=True,
                                 owner=link.peer, group=link.group.handle, _anchor=anchor)
    link.post_send(*messages)
    return TensorPlaceholder(x.shape, x.dtype, device=x.device, requires_grad=False,
                             owner=link.peer, group=link.group.handle)


def recv_activation(like: TensorPlaceholder | None, link: Link,
                    device: torch.device | None = None, room: int = 0
                    ) -> tuple[torch.Tensor, int]:
    """Receive the frame, check its header against ``like``, then the data if it follows.

    Returns the tensor (in the graph if the sender's was) and the room the next frame of
    this transfer will have (`room_for`).
    """
    hint = device if device is not None else like.device if like is not None else None
    comm = link.group.comm_device(hint)
    where = hint if hint is not None else comm
    header, data = _unframe(link.receive(_frame_buffer(link, room, hint)), where)
    dtype = header.tensor_dtype
    if like is not None and (like.shape, like.dtype) != (header.shape, dtype):
        raise CollectiveArgumentError(
            f"recv: the placeholder describes {like.dtype}{list(like.shape)}, but rank "
            f"{link.peer} sent {header.describe()}")
    if data is not None:
        return _in_graph(header.requires_grad, link, data, lambda: data), room_for(data)
    buffer = torch.empty(header.shape, dtype=dtype, device=where)
    return (_in_graph(header.requires_grad, link, buffer, lambda: link.receive(buffer)),
            room_for(buffer))


def _in_graph(requires_grad: bool, link: Link, buffer: torch.Tensor,
              source: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The received tensor, in this rank's graph (its backward sends the gradient) if needed."""
    if requires_grad and torch.is_grad_enabled():
        anchor = torch.empty(0, dtype=buffer.dtype, device=buffer.device, requires_grad=True)
        out: torch.Tensor = _Recv.apply(anchor, link, source)
        return out
    return source()


def gradient_sent(node: Any) -> bool:
    """Whether the backward of a receive (``node``: its output's ``grad_fn``) has run."""
    return bool(getattr(node, "sent", False))


def fetch_gradient(anchor: torch.Tensor) -> None:
    """Receive now the gradient of a send whose anchor is ``anchor`` (`GradientReceipt.fetch`)."""
    receipt = getattr(anchor.grad_fn, "receipt", None)
    if receipt is not None:
        receipt.fetch()


def receive_edge(x: torch.Tensor) -> GradientEdge | None:
    """Where a backward must end to send ``x``'s gradient back: its receive's anchor.

    ``None`` when ``x`` did not come from a receive in this rank's graph.
    """
    node = x.grad_fn
    if node is None or node.name() != f"{_Recv.__name__}Backward":
        return None
    anchor, slot = node.next_functions[0]
    assert anchor is not None  # the anchor requires grad
    return GradientEdge(anchor, slot)


class Inbox:
    """The activations a rank receives in one step, their frames' receives posted up front.

    ``rooms`` holds the room of each key's frame (missing: 0); each arrival updates it to
    the room of the same transfer in the next step (`room_for` what came). `take` waits
    for the frame and, where the data did not fit it, posts the data's receive and waits
    for that (gloo reports a posted receive complete only once it is waited for, so the
    arrival of a frame cannot be noticed earlier). Only for a backend that pairs transfers
    by tag (the receives are posted out of the senders' order).
    """

    def __init__(self, links: dict[Hashable, Link], device: torch.device,
                 rooms: dict[Hashable, int], follows: dict[Hashable, int]) -> None:
        self._device = device
        self._rooms = rooms
        self._follows = follows
        self._waiting: dict[Hashable, tuple[Link, Posted]] = {}
        self._ready: dict[Hashable, tuple[Link, Any, Posted]] = {}
        self._ahead: dict[Hashable, Posted] = {}  # data receives posted with the frames
        self._spare: list[Posted] = []  # those the data missed: a stand-in comes
        for key, link in links.items():
            room = rooms.get(key, 0)
            self._waiting[key] = (link, link.post_receive(_frame_buffer(link, room, device)))
            if follows.get(key, 0):  # the data's size repeats: its receive posted now
                self._ahead[key] = link.post_receive(torch.empty(
                    follows[key], dtype=torch.uint8, device=device))

    def _post_data(self, key: Hashable) -> None:
        link, posted = self._waiting.pop(key)
        try:
            header, data = _unframe(posted.wait(), self._device)
        except NothingSent as e:  # raised when the activation is taken
            self._let_go(key)
            self._ready[key] = (link, e, Posted(None, torch.empty(0)))
            return
        if data is not None:
            self._let_go(key)
            self._ready[key] = (link, header, Posted(None, data))
            self._rooms[key], self._follows[key] = room_for(data), 0
            return
        dtype = header.tensor_dtype
        size = _bytes_of(header.shape, dtype)
        ahead = self._ahead.get(key)
        if ahead is not None and ahead.buffer.numel() == size:  # the data is on its way
            del self._ahead[key]
            received = Posted(ahead.work, ahead.buffer.view(dtype).view(header.shape),
                              ahead.waited)
        else:
            self._let_go(key)
            received = link.post_receive(torch.empty(header.shape, dtype=dtype,
                                                     device=self._device))
        self._ready[key] = (link, header, received)
        self._rooms[key], self._follows[key] = room_for(received.buffer), _follows(size)

    def _let_go(self, key: Hashable) -> None:
        """Keep the data receive posted ahead for ``key`` (if any) until its stand-in comes.

        Called where the data will not come into it; a frame that raises anything but
        `NothingSent` leaves it in ``_ahead`` (still in flight).
        """
        ahead = self._ahead.pop(key, None)
        if ahead is not None:
            self._spare.append(ahead)

    def drain(self, order: Iterable[Hashable],
              answer: Callable[[Hashable, Header], None]) -> None:
        """After a failed step: wait for the frame of every activation not taken.

        ``order``: the keys in the order the peer sends them; ``answer(key, header)`` is
        called for each that carries a tensor once its frame is here, before the next is
        waited for (the peer may wait for that answer before it sends the next). The
        receives of their data stay posted (`in_flight`).
        """
        for key in order:
            if key in self._waiting:
                self._post_data(key)
            header = self._ready[key][1] if key in self._ready else None
            if isinstance(header, Header):
                answer(key, header)

    def in_flight(self) -> list[tuple[Any, Any]]:
        """The receives still posted, ``(work, buffer)`` (to `linger` after a failed step)."""
        posted = [p for _, p in self._waiting.values()]
        posted += [p for _, _, p in self._ready.values() if isinstance(p, Posted)]
        posted += [*self._ahead.values(), *self._spare]
        return [(p.work, p.buffer) for p in posted if p.work is not None]

    def take(self, key: Hashable) -> torch.Tensor:
        """The activation ``key`` (waiting for it), in the graph when the sender's was."""
        if key in self._waiting:
            self._post_data(key)
        link, header, posted = self._ready.pop(key)
        if isinstance(header, NothingSent):
            raise header
        return _in_graph(header.requires_grad, link, posted.buffer, posted.wait)


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
        CollectiveArgumentError: ``dst`` is not another rank of the group, or ``x`` has
            more dims than a header holds (12) or a dtype it cannot name (``dst``'s `recv`
            raises `NothingSent` then, instead of waiting).
        CollectiveTypeError: ``x`` is not a tensor (``dst``'s `recv` raises too), or
            ``tag`` is not an int >= 0.
        PeerLostError: ``dst`` went away (its process died) during the transfer.

    Shape:
        ``x``: any; the placeholder has its shape.
    """
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
        NothingSent: ``src``'s `send` raised instead of sending (a `CollectiveTypeError`).
        PeerLostError: ``src`` went away (its process died) during the transfer.

    Shape:
        output: the sender's shape.
    """
    if like is not None and not isinstance(like, TensorPlaceholder):
        raise CollectiveTypeError(f"recv: like must be a TensorPlaceholder or None, got "
                                  f"{type(like).__name__}")
    link = _link("recv", group, src, "src", tag)
    return recv_activation(like, link, None if device is None else torch.device(device))[0]
