"""Batch, group and instance norm over a split domain with one exchange each way.

The general path (`tensorpar.domain._norms`) builds the statistics from autograd ops: two
all-reduces forward (the mean, then the squared deviations), two backward, and a handful
of passes over the tile each way. This Function does what a fused kernel does:

- forward: each rank's mean and squared deviations per channel (torch's batch-norm
  statistics kernel; ``var_mean`` in float64), merged over the domain in one all-gather
  (Chan's pairwise formula: no cancellation), then torch's own ``batch_norm`` kernel with
  those statistics;
- backward: torch's ``batch_norm`` backward with fixed statistics (the gradient as if the
  statistics were constants) and the per-channel sums of the gradient, which one
  all-reduce turns into the domain's; the statistics' share of the input gradient is
  affine in the centred input (two more passes).

The tensor is viewed as ``(A, K, B)``: statistics per ``K`` over ``A`` and ``B`` (batch
norm: ``(N, C, points)``; group norm: ``(1, N * groups, rest)``). Differentiable once
(``parallelize_domain(..., double_backward=True)`` keeps the general path).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tensorpar.comm._comm import all_gather_into, all_reduce
from tensorpar.comm._group import Group
from tensorpar.domain._layout import DomainContext

__all__ = ["fused_norm"]

_SUM: Any = dist.ReduceOp.SUM if dist.is_available() else None


def fused_norm(ctx: DomainContext, xv: torch.Tensor, weight: torch.Tensor | None,
               bias: torch.Tensor | None, eps: float, count: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, biased var)`` of ``xv`` ``(A, K, B)`` normalised per ``K``.

    ``count``: the domain's points per ``K``. ``weight`` and ``bias`` (``K`` entries) are
    applied inside (batch norm's affine).
    """
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = _DomainNorm.apply(  # type: ignore[no-untyped-call]
        xv, weight, bias, ctx, eps, count)
    return out


def _merge(stats: torch.Tensor, group: Group) -> torch.Tensor:
    """Merge ``[count, mean (K), M2 (K)]`` over ``group`` (pairwise update, float64)."""
    every = stats.new_empty(group.size * stats.numel())
    all_gather_into(every, stats, group)
    rows = every.view(group.size, -1)
    k = (stats.numel() - 1) // 2
    n, means, m2 = rows[:, :1], rows[:, 1:1 + k], rows[:, 1 + k:]
    total = n.sum()
    mean = (n * means).sum(0) / total.clamp(min=1)
    spread = (m2 + n * (means - mean) ** 2).sum(0)
    return torch.cat([total.view(1), mean, spread])


def _local_moments(xv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This tile's biased variance (float64) and mean per channel of ``(A, K, B)``."""
    if xv.dtype == torch.float64:  # exact: the tests hold float64 to 1e-10 of dense
        var, mean = torch.var_mean(xv, dim=(0, 2), correction=0)
        return var.double(), mean
    # torch's batch-norm statistics kernel, several times faster than var_mean on a CPU;
    # with eps 0 the variance is 1 / invstd**2 (0 where the tile is constant), a rounding
    # well below the input's own in low precision
    _, mean, invstd = torch.ops.aten.native_batch_norm(xv, None, None, None, None, True,
                                                       0.0, 0.0)
    return torch.where(torch.isinf(invstd), 0.0, invstd.double().pow(-2)), mean


class _DomainNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, xv: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None,
                dctx: DomainContext, eps: float, count: int) -> tuple[torch.Tensor, ...]:
        k = xv.shape[1]
        n_local = xv.shape[0] * xv.shape[2]
        if n_local:
            var, mean = _local_moments(xv)
            stats = torch.cat([mean.new_full((1,), float(n_local), dtype=torch.float64),
                               mean.double(), var * n_local])
        else:  # an empty tile: nothing to add
            stats = xv.new_zeros(1 + 2 * k, dtype=torch.float64)
        for g in dctx.groups:
            if not g.is_single:
                stats = _merge(stats.to(g.comm_device(xv.device)), g).to(xv.device)
        mean = stats[1:1 + k].to(xv.dtype)
        var = (stats[1 + k:] / max(count, 1)).to(xv.dtype)
        y = F.batch_norm(xv, mean, var, w, b, False, 0.0, eps) if n_local else xv.clone()
        ctx.save_for_backward(xv, w, mean, var)
        ctx.args = (dctx, eps, count, b is not None)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError("a fused domain-parallel norm is differentiable once; for double "
                               "backward convert with parallelize_domain(..., "
                               "double_backward=True)")
        xv, w, mean, var = ctx.saved_tensors
        dctx, eps, count, has_bias = ctx.args
        k = xv.shape[1]
        if xv.numel():
            gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
                gy.contiguous(), xv, w, mean, var, None, None, False, eps, [True, True, True])
        else:
            gx, gw, gb = torch.zeros_like(xv), xv.new_zeros(k), xv.new_zeros(k)
        # gw = sum(gy * xhat), gb = sum(gy) on this tile (weight or not); over the domain:
        sums = torch.stack([gb, gw])
        for g in dctx.groups:
            if not g.is_single:
                all_reduce(sums, _SUM, g)
        rstd = torch.rsqrt(var + eps)
        scale = (w if w is not None else torch.ones_like(rstd)) * rstd / max(count, 1)
        if xv.numel():  # minus scale * (sum(gy) + xhat * sum(gy * xhat)), xhat from x - mean
            centred = xv - mean.view(1, k, 1)
            gx.addcmul_(centred, (-scale * rstd * sums[1]).view(1, k, 1))
            gx.sub_((scale * sums[0]).view(1, k, 1))
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        return (gx if need_x else None, gw if need_w else None,
                gb if need_b and has_bias else None, None, None, None)

