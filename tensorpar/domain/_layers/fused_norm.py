"""Batch, group and instance norm over a split domain with one exchange each way.

The general path (`tensorpar.domain._layers.norms`) builds the statistics from autograd ops: two
all-reduces forward (the mean, then the squared deviations), two backward, and a handful
of passes over the tile each way. This Function does what a fused kernel does:

- forward: each rank's mean and squared deviations per statistics channel (torch's
  group-norm kernel, which computes them in one pass; ``var_mean`` in float64), merged
  over the domain in one all-gather (Chan's pairwise formula: no cancellation), then one
  pass of torch's ``batch_norm`` kernel that normalises and applies the affine at once;
- backward: torch's ``batch_norm`` backward with fixed statistics (the gradient as if the
  statistics were constants) and the per-channel sums of the gradient, which one
  all-gather (summed in rank order) turns into the domain's; the statistics' share of the
  input gradient is affine in the input (two more passes).

On CPU both exchanges are one step, every rank sending to every rank, not gloo's ring.

The tensor comes *fine*, ``(A, K * r, B)``: each fine channel has its own affine weight,
and ``r`` consecutive fine channels share statistics, taken over ``A``, the ``r`` channels
and ``B`` (batch norm: ``(N, C, points)``, ``r = 1``; group norm: ``(1, N * C, points)``,
``r = C / groups``, its weight repeated per sample). Differentiable once
(``parallelize_domain(..., double_backward=True)`` keeps the general path).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from tensorpar.comm._comm import all_gather_into, all_to_all
from tensorpar.comm._group import Group
from tensorpar.domain._tiles.layout import DomainContext
from tensorpar.domain._tiles.rows import RowPlan

__all__ = ["RowsAhead", "fused_norm"]


def fused_norm(ctx: DomainContext, xf: torch.Tensor, weight: torch.Tensor | None,
               bias: torch.Tensor | None, eps: float, count: int, r: int = 1,
               ahead: RowsAhead | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, biased var, rows)`` of the fine view ``xf`` ``(A, K * r, B)``.

    Statistics per ``K`` (``r`` consecutive fine channels each); ``count``: the domain's
    points per ``K``. ``weight`` and ``bias`` (one entry per fine channel) are applied in
    the same pass. ``ahead``: halo rows of ``xf`` to send with the statistics (`RowsAhead`;
    split dim one group); ``rows`` is then what arrived, normalised, ``(A, K * r, R * L)``
    (else empty).
    """
    if bias is not None and weight is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)
    out: tuple[torch.Tensor, ...] = _DomainNorm.apply(  # type: ignore[no-untyped-call]
        xf.contiguous(), weight, bias, ctx, eps, count, r, ahead)
    return out  # type: ignore[return-value]


class RowsAhead(NamedTuple):
    """Halo rows a norm sends with its statistics (`tensorpar.domain._tiles.ahead`).

    The fine view's points ``B`` are ``plan.n_in`` rows of ``length`` points (the split
    dim is the first spatial dim); ``plan`` says which go where (one split dim's group).
    """

    plan: RowPlan
    length: int


def _with_rows(head: torch.Tensor, xf: torch.Tensor, idx: Sequence[int],
               counts: Sequence[int], ahead: RowsAhead) -> torch.Tensor:
    """The all-to-all's bytes: for each rank, ``head``, then the rows of ``xf`` it gets.

    ``xf``: ``(A, KR, rows * length)``, its rows ``idx`` sent, ``counts`` to each rank in
    rank order, each in its own dtype.
    """
    a, kr, points = xf.shape
    rows = xf.view(a, kr, points // ahead.length, ahead.length).index_select(
        2, torch.tensor(idx, dtype=torch.long, device=xf.device))
    flat = rows.movedim(2, 0).to(head.device).reshape(len(idx), a * kr * ahead.length)
    first = _bytes(head)
    pieces, at = [], 0
    for c in counts:
        pieces += [first, _bytes(flat[at:at + c])]
        at += c
    return torch.cat(pieces)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _exchange_with_rows(head: torch.Tensor, xf: torch.Tensor, send_idx: Sequence[int],
                        send: Sequence[int], recv: Sequence[int], ahead: RowsAhead,
                        group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``head`` (stacked in rank order) and the rows of ``xf`` that arrive.

    One all-to-all of bytes: each rank sends ``head`` to every rank and its rows
    ``send_idx`` by the ``send`` counts; returns the rows received, by source, as
    ``(A, KR, R * length)``.
    """
    a, kr, _ = xf.shape
    nh = head.numel() * head.element_size()
    per = a * kr * ahead.length * xf.element_size()
    out = torch.empty(sum(nh + c * per for c in recv), dtype=torch.uint8, device=head.device)
    all_to_all(out, _with_rows(head, xf, send_idx, send, ahead),
               [nh + c * per for c in recv], [nh + c * per for c in send], group, native=True)
    heads, rows, at = [], [], 0
    for c in recv:  # (copied out: a view of another dtype needs an aligned start)
        heads.append(out[at:at + nh].clone().view(head.dtype))
        rows.append(out[at + nh:at + nh + c * per])
        at += nh + c * per
    arrived = torch.cat(rows).view(xf.dtype).view(sum(recv), a, kr, ahead.length)
    return torch.stack(heads), arrived.movedim(0, 2).to(xf.device).reshape(a, kr, -1)


def _every(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's ``t`` (a few numbers), stacked in rank order.

    One step on CPU (every rank sends to every rank) rather than a ring: on gloo a ring of
    4 ranks is 3 messages one after the other, each waiting for a busy peer's turn.
    """
    every = t.new_empty(group.size * t.numel())
    all_gather_into(every, t, group, one_step=True)
    return every.view(group.size, *t.shape)


def _merge(stats: torch.Tensor, group: Group) -> torch.Tensor:
    """Merge ``[count, mean (K), M2 (K)]`` over ``group`` (pairwise update, float64)."""
    return _combine(_every(stats, group))


def _combine(rows: torch.Tensor) -> torch.Tensor:
    """Merge rows of ``[count, mean (K), M2 (K)]`` into one (Chan's pairwise update)."""
    k = (rows.shape[1] - 1) // 2
    n, means, m2 = rows[:, :1], rows[:, 1:1 + k], rows[:, 1 + k:]
    total = n.sum()
    mean = (n * means).sum(0) / total.clamp(min=1)
    spread = (m2 + n * (means - mean) ** 2).sum(0)
    return torch.cat([total.view(1), mean, spread])


def _local_stats(xv: torch.Tensor) -> torch.Tensor:
    """``[count, mean (K), M2 (K)]`` (float64) of this tile's ``(A, K, B)`` per ``K``."""
    a, k, b = xv.shape
    if xv.dtype == torch.float64:  # exact: the tests hold float64 to 1e-10 of dense
        var, mean = torch.var_mean(xv, dim=(0, 2), correction=0)
        return torch.cat([var.new_full((1,), float(a * b)), mean, var * (a * b)])
    # torch's group-norm kernel: mean and 1 / std of each (a, k) row in one pass, several
    # times faster than var_mean on a CPU; with eps 0 the variance is 1 / rstd**2 (0 where
    # a row is constant), a rounding well below the input's own in low precision
    _, mean, rstd = torch.ops.aten.native_group_norm(xv, None, None, a, k, b, k, 0.0)
    var = torch.where(torch.isinf(rstd), 0.0, rstd.double().pow(-2)).view(a, k)
    rows = torch.cat([var.new_full((a, 1), float(b)), mean.double().view(a, k), var * b], 1)
    return rows[0] if a == 1 else _combine(rows)


class _DomainNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, xf: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None,
                dctx: DomainContext, eps: float, count: int, r: int,
                ahead: RowsAhead | None) -> tuple[torch.Tensor, ...]:
        a, kr, bf = xf.shape
        k = kr // r
        if xf.numel():
            stats = _local_stats(xf.view(a, k, r * bf))
        else:  # an empty tile: nothing to add
            stats = xf.new_zeros(1 + 2 * k, dtype=torch.float64)
        arrived = xf.new_empty((a, kr, 0))
        if ahead is not None:  # one group: the statistics and the halo rows in one exchange
            g, plan = dctx.groups[0], ahead.plan
            every, arrived = _exchange_with_rows(
                stats.to(g.comm_device(xf.device)), xf, plan.send_idx, plan.send_counts,
                plan.recv_counts, ahead, g)
            stats = _combine(every).to(xf.device)
        else:
            for g in dctx.groups:
                if not g.is_single:
                    stats = _merge(stats.to(g.comm_device(xf.device)), g).to(xf.device)
        # statistics in the affine's dtype: float32 weights over a bfloat16 tile take
        # torch's mixed-precision kernels (computed in float32, output bfloat16), as dense
        dtype = w.dtype if w is not None else xf.dtype
        mean = stats[1:1 + k].to(dtype)
        var = (stats[1 + k:] / max(count, 1)).to(dtype)
        fine_mean, fine_var = mean.repeat_interleave(r), var.repeat_interleave(r)
        y = F.batch_norm(xf, fine_mean, fine_var, w, b, False, 0.0, eps) if xf.numel() \
            else xf.clone()
        rows = F.batch_norm(arrived, fine_mean, fine_var, w, b, False, 0.0, eps) \
            if arrived.numel() else arrived.clone()
        ctx.save_for_backward(xf, w, fine_mean, fine_var, arrived)
        ctx.args = (dctx, eps, count, r, b is not None, ahead)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var, rows

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor, _gm: Any, _gv: Any, g_rows: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError("a fused domain-parallel norm is differentiable once; for double "
                               "backward convert with parallelize_domain(..., "
                               "double_backward=True)")
        xf, w, fine_mean, fine_var, arrived = ctx.saved_tensors
        dctx, eps, count, r, has_bias, ahead = ctx.args
        kr = xf.shape[1]
        gx, gw, gb = _fixed_stats_backward(gy, xf, w, fine_mean, fine_var, eps)
        g_arrived = torch.zeros_like(arrived)
        if g_rows is not None and arrived.numel():  # the rows sent ahead, used here
            g_arrived, gw_rows, gb_rows = _fixed_stats_backward(
                g_rows, arrived, w, fine_mean, fine_var, eps)
            gw, gb = gw + gw_rows, gb + gb_rows
        # per fine channel on this tile: gb = sum(gy), gw = sum(gy * xhat); the statistics'
        # share needs, per K over the domain, the sums of gy * weight and gy * weight * xhat
        scale_w = w if w is not None else torch.ones_like(fine_mean)
        sums = torch.stack([gb * scale_w, gw * scale_w]).view(2, -1, r).sum(2)
        if ahead is not None:  # the sums, and each row's gradient home to its owner
            g, plan = dctx.groups[0], ahead.plan
            every, back = _exchange_with_rows(
                sums.to(g.comm_device(xf.device)).view(-1), g_arrived,
                range(g_arrived.shape[2] // ahead.length), plan.recv_counts,
                plan.send_counts, ahead, g)
            sums = every.sum(0).view(2, -1).to(xf.device)
            if back.numel():
                a = xf.shape[0]
                gx.view(a, kr, -1, ahead.length).index_add_(
                    2, torch.tensor(plan.send_idx, dtype=torch.long, device=xf.device),
                    back.view(a, kr, -1, ahead.length))
        else:
            for g in dctx.groups:
                if not g.is_single:  # summed in rank order: the same on every rank
                    sums = _every(sums.to(g.comm_device(xf.device)), g).sum(0).to(xf.device)
        if xf.numel():  # minus rstd / count * (S0 + xhat S1), xhat = (x - mean) rstd
            rstd = torch.rsqrt(fine_var + eps)
            s0, s1 = sums[0].repeat_interleave(r), sums[1].repeat_interleave(r)
            coef = rstd / max(count, 1)
            slope = coef * rstd * s1
            gx.addcmul_(xf, (-slope).view(1, kr, 1))
            gx.sub_((coef * s0 - slope * fine_mean).view(1, kr, 1))
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        return (gx if need_x else None, gw if need_w else None,
                gb if need_b and has_bias else None, None, None, None, None, None)


def _fixed_stats_backward(gy: torch.Tensor, xf: torch.Tensor, w: torch.Tensor | None,
                          mean: torch.Tensor, var: torch.Tensor, eps: float
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch-norm backward of torch as if the statistics were constants: gx, gw, gb."""
    if not xf.numel():
        kr = xf.shape[1]
        return torch.zeros_like(xf), xf.new_zeros(kr), xf.new_zeros(kr)
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = \
        torch.ops.aten.native_batch_norm_backward(gy.contiguous(), xf, w, mean, var, None,
                                                  None, False, eps, [True, True, True])
    return out
