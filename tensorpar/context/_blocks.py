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

import bisect
import itertools
from typing import NamedTuple, cast

import torch

from tensorpar._torch import CPU_FLASH_ATTENTION, CPU_FLASH_ATTENTION_BACKWARD

__all__ = ["CAUSAL", "SKIP", "Documents", "Padding", "Piece", "Segment", "Visible",
           "block_backward", "block_forward", "blocks", "merge", "pair_mask"]

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


class Piece(NamedTuple):
    """One block to compute: ``rows`` of the batch, queries ``q`` against keys ``k``."""

    rows: slice
    q: Segment
    k: Segment
    mask: Mask


MAX_PIECES = 64
"""More shared documents than this per row (or per batch, where every row holds the same
documents) in one pair of segments: one masked block instead (each piece is a kernel call
and a merge)."""


class Documents:
    """Which document each position of each row belongs to: a packed row's documents.

    ``ids``: ``(B, T)`` integers over the whole sequence, nondecreasing along each row.
    Queries see keys of their own document only. A pair of segments is computed as one
    block per document they share (the kernels' own causal mode on the diagonal, no mask
    elsewhere), which is the work a variable-length kernel does; rows with other
    documents are computed apart. The documents are kept on the host (the pieces are
    planned there, without a device sync) and on the attention's device (the masks of
    `MAX_PIECES` fallbacks).
    """

    def __init__(self, ids: torch.Tensor, device: torch.device) -> None:
        host = ids.to("cpu", torch.int64)
        self.on_device = ids.to(device, torch.int64)
        runs = [_runs(row) for row in host]
        # one plan for the whole batch where every row holds the same documents
        rows = [(slice(None), runs[0])] if all(r == runs[0] for r in runs) else \
            [(slice(b, b + 1), r) for b, r in enumerate(runs)]
        self.groups = [(at, r, [end for _, end in r]) for at, r in rows]

    def pieces(self, q: Segment, k: Segment, causal: bool, window: int | None,
               device: torch.device) -> list[Piece]:
        """The blocks of the pair ``(q, k)``: within each document they share."""
        shared = [(rows, _shared(runs, ends, q, k)) for rows, runs, ends in self.groups]
        if sum(len(runs) for _, runs in shared) > MAX_PIECES * len(self.groups):
            return self._masked(q, k, causal, window, device)  # counted before any is built
        out: list[Piece] = []
        for rows, runs in shared:
            for start, end in runs:
                qp, kp = _clip(q, start, end), _clip(k, start, end)
                mask = pair_mask(qp, kp, causal, window, device)
                if mask is not SKIP:
                    out.append(Piece(rows, qp, kp, mask))
        return out

    def _masked(self, q: Segment, k: Segment, causal: bool, window: int | None,
                device: torch.device) -> list[Piece]:
        """The pair as one block, masked to each row's documents."""
        positions = pair_mask(q, k, causal, window, device)
        if positions is SKIP:
            return []
        ids = self.on_device
        same = ids[:, q.start:q.start + q.length, None] == ids[:, None, k.start:k.start + k.length]
        visible = _visible(positions, q.length, k.length, ids.device)
        if visible is not None:
            same &= visible
        return [Piece(slice(None), q, k, same.unsqueeze(1))]


class Padding:
    """Keys that no query sees: a padding attention mask's zeros.

    ``keep``: ``(B, T)`` booleans over the whole sequence, True where a key takes part (an
    attention mask's ones). A pair of segments first drops the keys at its ends that no row
    keeps; if every row keeps the rest, the pair runs as without padding, else as one block
    masked to each row's kept keys (``(B, 1, Lq, Lk)``). Padding gathers at the rows' ends,
    so only the pairs across its edge build a mask. A query that sees no key at all (a
    left-padding position) gets a zero output, as SDPA gives it.
    """

    def __init__(self, keep: torch.Tensor, device: torch.device) -> None:
        host = keep.to("cpu", torch.bool)
        self.on_device = keep.to(device, torch.bool)
        self._kept = torch.nonzero(host.any(0)).flatten().tolist()  # by some row
        every = host.all(0).to(torch.int64).cumsum(0)  # kept by every row, up to each
        self._every = [0, *every.tolist()]

    def pieces(self, q: Segment, k: Segment, causal: bool, window: int | None,
               device: torch.device) -> list[Piece]:
        """The pair ``(q, k)``: its keys that some row keeps, masked where a row does not."""
        lo = bisect.bisect_left(self._kept, k.start)
        hi = bisect.bisect_left(self._kept, k.start + k.length)
        if lo == hi:
            return []
        k = Segment(self._kept[lo], self._kept[hi - 1] + 1 - self._kept[lo])
        positions = pair_mask(q, k, causal, window, device)
        if positions is SKIP:
            return []
        end = k.start + k.length
        if self._every[end] - self._every[k.start] == k.length:
            return [Piece(slice(None), q, k, positions)]
        kept = self.on_device[:, None, None, k.start:end]  # (B, 1, 1, Lk)
        visible = _visible(positions, q.length, k.length, kept.device)
        mask = kept.expand(-1, 1, q.length, -1) if visible is None else kept & visible
        return [Piece(slice(None), q, k, mask)]


Visible = Documents | Padding
"""Which keys each query sees besides the causal mask and the window."""


def _runs(row: torch.Tensor) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of equal ids in ``row``."""
    if row.numel() == 0:
        return []
    cuts = [0, *(torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist(), row.numel()]
    return list(itertools.pairwise(cuts))


def _shared(runs: list[tuple[int, int]], ends: list[int], q: Segment, k: Segment
            ) -> list[tuple[int, int]]:
    """The runs (sorted, ``ends`` their ends) that overlap both segments."""
    after = max(q.start, k.start)  # a shared run ends after both starts...
    before = min(q.start + q.length, k.start + k.length)  # ...and starts before both ends
    out = []
    i = bisect.bisect_right(ends, after)
    while i < len(runs) and runs[i][0] < before:
        out.append(runs[i])
        i += 1
    return out


def _clip(seg: Segment, start: int, end: int) -> Segment:
    lo = max(seg.start, start)
    return Segment(lo, min(seg.start + seg.length, end) - lo)


def blocks(q: Segment, k: Segment, causal: bool, window: int | None, device: torch.device,
           visible: Visible | None = None) -> list[Piece]:
    """The blocks to compute for queries of segment ``q`` against keys of segment ``k``."""
    if visible is not None:
        return visible.pieces(q, k, causal, window, device)
    mask = pair_mask(q, k, causal, window, device)
    return [] if mask is SKIP else [Piece(slice(None), q, k, mask)]


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


def _visible(mask: Mask, lq: int, lk: int, device: torch.device) -> torch.Tensor | None:
    """`pair_mask`'s answer (not `SKIP`) as a boolean tensor, or ``None``: every key."""
    if mask is CAUSAL:
        return torch.ones(lq, lk, dtype=torch.bool, device=device).tril()
    return cast(torch.Tensor | None, mask)


def _boolean(mask: Mask, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    return _visible(mask, q.shape[-2], k.shape[-2], q.device)


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
        ``mask``: ``(Lq, Lk)``, ``(B, 1, Lq, Lk)`` or ``None``; returns ``(B, H, Lq, Dv)``
        and ``(B, H, Lq)``.
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

    ``delta`` is ``(dout * out).sum(-1)``, computed once per query segment. A query that
    sees no key anywhere (``lse = -inf``, a zero output) gets no gradient.

    Returns:
        ``dq``, ``dk``, ``dv`` of this block (``dq`` to be added over the blocks).
    """
    lse = _finite(lse)  # exp(-inf - -inf) would be NaN where a query sees no key
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
    # p is in the log-sum-exp's (accumulation) dtype: back to the operands' for the matmuls
    ds = (p * (dp - delta.unsqueeze(-1)) * scale).to(k.dtype)
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
