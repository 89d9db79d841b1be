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

from typing import Any

import torch
import torch.nn.functional as F

from tensorpar.comm._comm import all_gather_into
from tensorpar.comm._group import Group
from tensorpar.domain._tiles.layout import DomainContext

__all__ = ["fused_norm"]


def fused_norm(ctx: DomainContext, xf: torch.Tensor, weight: torch.Tensor | None,
               bias: torch.Tensor | None, eps: float, count: int, r: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, biased var)`` of the fine view ``xf`` ``(A, K * r, B)``.

    Statistics per ``K`` (``r`` consecutive fine channels each); ``count``: the domain's
    points per ``K``. ``weight`` and ``bias`` (one entry per fine channel) are applied in
    the same pass.
    """
    if bias is not None and weight is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = _DomainNorm.apply(  # type: ignore[no-untyped-call]
        xf.contiguous(), weight, bias, ctx, eps, count, r)
    return out


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
                dctx: DomainContext, eps: float, count: int, r: int
                ) -> tuple[torch.Tensor, ...]:
        a, kr, bf = xf.shape
        k = kr // r
        if xf.numel():
            stats = _local_stats(xf.view(a, k, r * bf))
        else:  # an empty tile: nothing to add
            stats = xf.new_zeros(1 + 2 * k, dtype=torch.float64)
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
        ctx.save_for_backward(xf, w, fine_mean, fine_var)
        ctx.args = (dctx, eps, count, r, b is not None)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError("a fused domain-parallel norm is differentiable once; for double "
                               "backward convert with parallelize_domain(..., "
                               "double_backward=True)")
        xf, w, fine_mean, fine_var = ctx.saved_tensors
        dctx, eps, count, r, has_bias = ctx.args
        kr = xf.shape[1]
        if xf.numel():
            gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
                gy.contiguous(), xf, w, fine_mean, fine_var, None, None, False, eps,
                [True, True, True])
        else:
            gx, gw, gb = torch.zeros_like(xf), xf.new_zeros(kr), xf.new_zeros(kr)
        # per fine channel on this tile: gb = sum(gy), gw = sum(gy * xhat); the statistics'
        # share needs, per K over the domain, the sums of gy * weight and gy * weight * xhat
        scale_w = w if w is not None else torch.ones_like(fine_mean)
        sums = torch.stack([gb * scale_w, gw * scale_w]).view(2, -1, r).sum(2)
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
                gb if need_b and has_bias else None, None, None, None, None)
