"""The ring attention autograd Function: key/value chunks travel the ring, queries stay.

Forward, on rank ``r`` of ``W``: at step ``s`` the rank holds the key/value chunk of rank
``(r - s) % W``. It posts the send of that chunk to ``r + 1`` and the receive of the next
one from ``r - 1``, computes its queries against the chunk it holds (block by block, see
`tensorpar.context._blocks`), merges the result into the running output with the
log-sum-exp, then waits for the transfer. ``W - 1`` transfers; no rank ever holds more than
two key/value chunks.

Backward: the same ring again (the chunks are not kept from the forward). The gradient of
the queries stays local; each chunk's key/value gradient is an accumulator that travels
with the chunk, each rank adding its queries' share, and one last hop brings it home to the
owner. A rank computes its share into a fresh buffer while the accumulator is in flight, so
the transfer overlaps the computation.

Key/value heads travel unrepeated: grouped-query attention repeats them on arrival, and the
gradient of the repeated heads is summed back before it travels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from tensorpar.comm._group import Group
from tensorpar.context._blocks import (
    Piece,
    Segment,
    Visible,
    block_backward,
    block_forward,
    blocks,
    merge,
)

__all__ = ["RingSpec", "ring_apply"]

_KV_TAG = 0x52A1
_GRAD_TAG = 0x52A2


@dataclass(frozen=True)
class RingSpec:
    """Everything a ring attention call needs besides its tensors (the same on every rank).

    ``layout[r]`` lists rank ``r``'s segments in the order its rows hold them;
    ``visible``: which keys each query sees besides the causal mask and the window (a
    packed row's documents, or a padding mask's kept keys).
    """

    group: Group
    layout: tuple[tuple[Segment, ...], ...]
    causal: bool
    window: int | None
    scale: float
    kv_groups: int  # query heads per key/value head
    visible: Visible | None = None

    def rows(self, rank: int) -> int:
        return sum(seg.length for seg in self.layout[rank])

    def slices(self, rank: int) -> list[tuple[Segment, slice]]:
        out, at = [], 0
        for seg in self.layout[rank]:
            out.append((seg, slice(at, at + seg.length)))
            at += seg.length
        return out


def ring_apply(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Run `_RingAttention` (inputs already validated).

    ``sinks``: one logit per query head (``(H,)``, not scaled) that joins every query's
    softmax without a value (gpt-oss's attention sinks): the output is scaled by the share
    of the normaliser the keys hold.
    """
    if q.stride(-1) != 1:  # the CPU's fused kernel reads the head dim as contiguous
        q = q.contiguous()  # (k and v are packed into one buffer, contiguous, anyway)
    out: torch.Tensor = _RingAttention.apply(q, k, v, spec, sinks)  # type: ignore[no-untyped-call]
    return out


class _Transfer:
    """One point-to-point step of the ring: send to ``r + 1``, receive from ``r - 1``."""

    def __init__(self, spec: RingSpec, send: torch.Tensor | None, recv: torch.Tensor | None,
                 tag: int) -> None:
        g = spec.group
        handle = g.handle
        self.works: list[dist.Work] = []
        nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
        if recv is not None and recv.numel():
            work = dist.irecv(recv, group=handle, group_src=prv, tag=tag)
            if work is not None:
                self.works.append(work)
        if send is not None and send.numel():
            work = dist.isend(send, group=handle, group_dst=nxt, tag=tag)
            if work is not None:
                self.works.append(work)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(flat: torch.Tensor, k_shape: tuple[int, ...], v_shape: tuple[int, ...]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    nk = 1
    for n in k_shape:
        nk *= n
    return flat[:nk].view(k_shape), flat[nk:].view(v_shape)


def _shapes(k: torch.Tensor, v: torch.Tensor, rows: int
            ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    b, h, _, d = k.shape
    return (b, h, rows, d), (b, h, rows, v.shape[-1])


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _unrepeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x.view(b, h // groups, groups, n, d).sum(2)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _pieces(spec: RingSpec, mine: list[tuple[Segment, slice]], owner: int,
            device: torch.device) -> list[tuple[Piece, slice, slice, slice]]:
    """This rank's blocks against ``owner``'s keys: each with its rows and local slices."""
    out = []
    for qseg, qs in mine:
        for kseg, ks in spec.slices(owner):
            for piece in blocks(qseg, kseg, spec.causal, spec.window, device, spec.visible):
                q0 = qs.start + piece.q.start - qseg.start
                k0 = ks.start + piece.k.start - kseg.start
                out.append((piece, piece.rows, slice(q0, q0 + piece.q.length),
                            slice(k0, k0 + piece.k.length)))
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: RingSpec, sinks: torch.Tensor | None) -> torch.Tensor:
        g, rank = spec.group, spec.group.rank
        acc = _acc_dtype(q)
        # (B, H, Tq, Dv) laid out as (B, Tq, H, Dv): what attention layers reshape it to next
        b, h, tq, _ = q.shape
        out = q.new_zeros((b, tq, h, v.shape[-1]), dtype=acc).transpose(1, 2)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=acc)  # (B, H, Tq)
        kv = _pack(k, v)
        mine = spec.slices(rank)
        for step in range(g.size):
            owner = (rank - step) % g.size
            transfer = None
            if step < g.size - 1:
                nxt_shapes = _shapes(k, v, spec.rows((owner - 1) % g.size))
                incoming = kv.new_empty(_numel(nxt_shapes[0]) + _numel(nxt_shapes[1]))
                transfer = _Transfer(spec, kv, incoming, _KV_TAG)
            kj, vj = _unpack(kv, *_shapes(k, v, spec.rows(owner)))
            for piece, rows, qs, ks in _pieces(spec, mine, owner, q.device):
                o, l_ = block_forward(q[rows, :, qs], _repeat(kj[rows, :, ks], spec.kv_groups),
                                      _repeat(vj[rows, :, ks], spec.kv_groups), piece.mask,
                                      spec.scale)
                merge(out[rows, :, qs], lse[rows, :, qs], o.to(acc), l_.to(acc))
            if transfer is not None:
                transfer.wait()
                kv = incoming
        if sinks is not None:  # the sink's share of each normaliser, taken from the keys'
            sink = sinks.detach().to(acc).view(1, -1, 1)
            total = torch.logaddexp(lse, sink.expand_as(lse))
            out.mul_(torch.exp(lse - total).unsqueeze(-1))
            lse = total
        out = out.to(q.dtype)
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, torch.Tensor | None]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        spec: RingSpec = ctx.spec
        g, rank = spec.group, spec.group.rank
        acc = _acc_dtype(q)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, H, Tq)
        kv = _pack(k, v)
        mine = spec.slices(rank)
        pending: tuple[_Transfer, torch.Tensor] | None = None  # accumulator in flight
        for step in range(g.size):
            owner = (rank - step) % g.size
            transfer = None
            if step < g.size - 1:
                nxt_shapes = _shapes(k, v, spec.rows((owner - 1) % g.size))
                incoming = kv.new_empty(_numel(nxt_shapes[0]) + _numel(nxt_shapes[1]))
                transfer = _Transfer(spec, kv, incoming, _KV_TAG)
            k_shape, v_shape = _shapes(k, v, spec.rows(owner))
            kj, vj = _unpack(kv, k_shape, v_shape)
            dkv = kv.new_zeros(kv.shape, dtype=acc)
            dkj, dvj = _unpack(dkv, k_shape, v_shape)
            for piece, rows, qs, ks in _pieces(spec, mine, owner, q.device):
                dqb, dkb, dvb = block_backward(
                    dout[rows, :, qs], q[rows, :, qs], _repeat(kj[rows, :, ks], spec.kv_groups),
                    _repeat(vj[rows, :, ks], spec.kv_groups), out[rows, :, qs],
                    lse[rows, :, qs], delta[rows, :, qs], piece.mask, spec.scale)
                dq[rows, :, qs] += dqb
                dkj[rows, :, ks] += _unrepeat(dkb, spec.kv_groups)
                dvj[rows, :, ks] += _unrepeat(dvb, spec.kv_groups)
            if pending is not None:  # the accumulator of this chunk, from the ranks before
                pending[0].wait()
                dkv += pending[1]
            grad_in = dkv.new_empty(0)
            if g.size > 1:
                back = (owner - 1) % g.size if step < g.size - 1 else rank
                shapes = _shapes(k, v, spec.rows(back))
                grad_in = dkv.new_empty(_numel(shapes[0]) + _numel(shapes[1]))
                pending = (_Transfer(spec, dkv, grad_in, _GRAD_TAG), grad_in)
            if transfer is not None:
                transfer.wait()
                kv = incoming
        if pending is not None:
            pending[0].wait()
            dkv = pending[1]
        dk, dv = _unpack(dkv, *_shapes(k, v, k.shape[2]))
        dsinks = None
        if sinks is not None:  # d out / d sink = -p_sink * out, so -sum of p_sink * delta
            p_sink = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)
            dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, dsinks
