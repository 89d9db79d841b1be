"""One block of ring attention: queries of one segment against keys of one segment.

A *segment* is a run of consecutive global positions ``[start, start + length)``. Ring
attention splits each rank's queries and each travelling key/value chunk into segments and
computes every (query segment, key segment) pair as one block: a block whose keys are all
hidden from its queries (causal, window) is skipped, one whose keys are all visible runs
without a mask, and only the blocks on a diagonal or a window edge build one.

Each block returns its output normalised on its own and its log-sum-exp (``lse``); `merge`
folds it into the running result (the online softmax). The backward recomputes a block's
probabilities from the *final* ``lse`` and output (flash-attention style), so no block's
probabilities are ever stored.

Two kernels compute a block: torch's fused CPU flash-attention operator (which returns the
log-sum-exp and takes it back in its backward) on CPU tensors, and a plain matmul/softmax
kernel everywhere else. Both are exact up to rounding.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch

from tensorpar._torch import CPU_FLASH_ATTENTION, CPU_FLASH_ATTENTION_BACKWARD

__all__ = ["CAUSAL", "SKIP", "Segment", "block_backward", "block_forward", "merge", "pair_mask"]

_NEG_INF = float("-inf")
SKIP = "skip"
"""`pair_mask`'s answer for a block with no visible key."""
CAUSAL = "causal"
"""`pair_mask`'s answer for a block on the diagonal: the same positions, causal, no window edge
(the kernels' own causal mode, which skips the hidden half)."""

Mask = torch.Tensor | str | None

_FUSED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


class Segment(NamedTuple):
    """Consecutive global positions ``[start, start + length)``."""

    start: int
    length: int


def pair_mask(q: Segment, k: Segment, causal: bool, window: int | None,
              device: torch.device) -> Mask:
    """Which keys of segment ``k`` each query of segment ``q`` sees.

    Causal: key position <= query position. A window ``w``: query - key < w (causal), or
    ``|query - key| < w`` (not causal).

    Returns:
        `SKIP` (no query sees any key), ``None`` (every query sees every key), `CAUSAL` (the
        same positions, lower triangle visible) or a boolean ``(q.length, k.length)`` tensor,
        True where visible.
    """
    if q.length == 0 or k.length == 0:
        return SKIP
    q_lo, q_hi, k_lo, k_hi = q.start, q.start + q.length - 1, k.start, k.start + k.length - 1
    if causal and k_lo > q_hi:
        return SKIP
    if window is not None and (q_lo - k_hi >= window or (not causal and k_lo - q_hi >= window)):
        return SKIP
    full = not causal or k_hi <= q_lo
    if window is not None:
        full = full and q_hi - k_lo < window and (causal or k_hi - q_lo < window)
    if full:
        return None
    if causal and q == k and (window is None or window >= q.length):
        return CAUSAL
    qp = torch.arange(q_lo, q_hi + 1, device=device).unsqueeze(1)  # (Lq, 1)
    kp = torch.arange(k_lo, k_hi + 1, device=device)  # (Lk,)
    dist = qp - kp
    visible = dist >= 0 if causal else torch.ones_like(dist, dtype=torch.bool)
    if window is not None:
        visible &= dist.abs() < window
    return visible


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in _FUSED_DTYPES


def _boolean(mask: Mask, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    if mask is CAUSAL:
        return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return cast(torch.Tensor | None, mask)  # a tensor or None: SKIP never reaches a kernel


def _additive(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill_(
        ~mask, _NEG_INF)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over ``k``/``v`` alone, and each query's log-sum-exp.

    A query that sees no key of this block gets a zero output and ``lse = -inf``.

    Shape:
        ``q``: ``(B, H, Lq, D)``; ``k``: ``(B, H, Lk, D)``; ``v``: ``(B, H, Lk, Dv)``;
        ``mask``: ``(Lq, Lk)`` or ``None``; returns ``(B, H, Lq, Dv)`` and ``(B, H, Lq)``.
    """
    if _fused(q) and k.shape[-1] == v.shape[-1]:
        if mask is CAUSAL:  # every query sees itself
            out, lse = CPU_FLASH_ATTENTION(
                q, k, v, is_causal=True, scale=scale)
            return out, lse
        mask = _boolean(mask, q, k)
        out, lse = CPU_FLASH_ATTENTION(
            q, k, v, attn_mask=_additive(mask, q), scale=scale)
        if mask is not None:  # the fused kernel reports lse 0 for a query that sees nothing
            lse = lse.masked_fill(~mask.any(-1), _NEG_INF)
        return out, lse
    mask = _boolean(mask, q, k)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    if mask is not None:
        s = s.masked_fill(~mask, _NEG_INF)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Lq)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p.to(v.dtype), v), lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                   mask: Mask, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block from the final output ``out`` and log-sum-exp ``lse``.

    ``delta`` is ``(dout * out).sum(-1)``, computed once per query segment.

    Returns:
        ``dq``, ``dk``, ``dv`` of this block (``dq`` to be added over the blocks).
    """
    if _fused(q) and k.shape[-1] == v.shape[-1]:
        causal = mask is CAUSAL
        attn_mask = None if causal else _additive(_boolean(mask, q, k), q)
        dq, dk, dv = CPU_FLASH_ATTENTION_BACKWARD(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=attn_mask, scale=scale)
        return dq, dk, dv
    mask = _boolean(mask, q, k)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, _NEG_INF)
    p = torch.exp(s - lse.unsqueeze(-1))  # (B, H, Lq, Lk): the final probabilities
    dv = torch.matmul(p.transpose(-1, -2).to(dout.dtype), dout)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    return torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q), dv


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return lse.masked_fill(lse == _NEG_INF, 0.0)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> None:
    """Fold one block's result into the running ``out``/``lse``, in place (online softmax).

    The weights are each side's share of the combined normaliser,
    ``exp(lse_side - logaddexp(lse, block_lse))``; a side with ``lse = -inf`` weighs 0.
    """
    new = torch.logaddexp(lse, block_lse)
    base = _finite(new)
    out.mul_(torch.exp(lse - base).unsqueeze(-1))
    out.add_(block_out * torch.exp(block_lse - base).unsqueeze(-1))
    lse.copy_(new)
