"""``ulysses_attention``: the all-to-all variant of context-parallel attention.

Instead of passing key/value chunks around a ring, one all-to-all trades the sequence split
for a head split: every rank receives the *whole* sequence of ``H / W`` heads, runs ordinary
SDPA on them, and a second all-to-all trades back. Two collectives per call instead of
``W - 1`` ring hops, but each rank briefly holds the whole sequence of its heads, and the
head count bounds the group size usefully (heads are padded with zero heads up to a
multiple of ``W``; the padding is computed and dropped).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tensorpar.collectives.functional import all_to_all
from tensorpar.comm._group import Group, GroupLike, resolve_group
from tensorpar.context._autocast import as_sdpa_under_autocast
from tensorpar.context.attention import agreed_lengths

__all__ = ["ulysses_apply", "ulysses_attention"]

_FN = "ulysses_attention"


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      is_causal: bool = False, group: GroupLike = None,
                      scale: float | None = None, enable_gqa: bool = False,
                      window: int | None = None, lengths: Sequence[int] | None = None,
                      documents: torch.Tensor | None = None,
                      key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The same result as `ring_attention`, by two all-to-alls (sequence split <-> head split).

    Arguments, chunks and masks are `ring_attention`'s. With ``enable_gqa`` the key/value
    heads are repeated to the query heads *before* the exchange (they travel repeated).

    Forward: all-to-all (split heads, gather the sequence), SDPA, all-to-all back. Backward:
    the mirrored all-to-alls around SDPA's backward.

    Args:
        q: this rank's queries.
        k: this rank's keys.
        v: this rank's values.
        is_causal: causal by global position.
        group: the context-parallel group (``None``: the default group, resolved at call
            time).
        scale: the logits' factor (``None``: ``1 / sqrt(D)``).
        enable_gqa: allow fewer key/value heads than query heads.
        window: a sliding window, as in `ring_attention`.
        lengths: every rank's chunk length (skips the exchange that learns them).
        documents: packed sequences, as in `ring_attention` (a ``(B, 1, T, T)`` mask here).
        key_mask: padding, as in `ring_attention`.

    Returns:
        This rank's chunk of the attention output.

    Raises:
        CollectiveArgumentError: as `ring_attention` (also raised on every rank).

    Shape:
        ``q``: ``(B, H, T_r, D)``; ``k``, ``v``: ``(B, Hkv, T_r, D)``; output
        ``(B, H, T_r, D)``.
    """
    g = resolve_group(group, _FN)
    q, k, v, plain = as_sdpa_under_autocast(q, k, v)  # (the exchanges in its dtype too)
    lengths = agreed_lengths(q, k, v, is_causal, scale, enable_gqa, window, lengths, documents,
                             g, _FN, key_mask)
    with plain:
        return ulysses_apply(q, k, v, g, list(lengths), None, is_causal, window,
                             1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale),
                             documents, key_mask)


def ulysses_apply(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Group,
                  rows: list[int], order: torch.Tensor | None, causal: bool,
                  window: int | None, scale: float, documents: torch.Tensor | None,
                  key_mask: torch.Tensor | None) -> torch.Tensor:
    """The exchange and SDPA of `ulysses_attention` (arguments already checked).

    ``rows``: every rank's row count. ``order``: the global position of each row of the
    ranks' rows put end to end in rank order (``None``: contiguous chunks, already in
    order). The whole sequence is put in position order for SDPA (causal by its own kernel
    where nothing else masks), and back.
    """
    heads = q.shape[1]
    if k.shape[1] != heads:
        k, v = (t.repeat_interleave(heads // k.shape[1], dim=1) for t in (k, v))
    padded = -(-heads // g.size) * g.size
    total = sum(rows)

    def spread(t: torch.Tensor) -> torch.Tensor:  # (B, H, T_r, D) -> (B, H'/W, T, D)
        if padded != heads:
            t = torch.cat([t, t.new_zeros((t.shape[0], padded - heads, *t.shape[2:]))], dim=1)
        t = t if g.is_single else all_to_all(t, split_dim=1, concat_dim=2, group=g)
        return t if back is None else t.index_select(2, back)  # position order

    back = None if order is None else torch.argsort(order)
    qh, kh, vh = spread(q), spread(k), spread(v)
    mask = None
    if window is not None or (causal and (documents is not None or key_mask is not None)):
        pos = torch.arange(total, device=q.device)
        dist = pos.unsqueeze(1) - pos  # (T, T): only where something else masks too
        mask = dist >= 0 if causal else torch.ones_like(dist, dtype=torch.bool)
        if window is not None:
            mask &= dist.abs() < window
    if documents is not None:
        ids = documents.to(q.device)
        same = (ids[:, :, None] == ids[:, None, :]).unsqueeze(1)  # (B, 1, T, T)
        mask = same if mask is None else same & mask
    if key_mask is not None:
        kept = key_mask.to(q.device, torch.bool)[:, None, None, :]  # (B, 1, 1, T)
        mask = kept if mask is None else kept & mask
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask,
                                         is_causal=causal and mask is None, scale=scale)
    if order is not None:
        out = out.index_select(2, order)  # rank order
    if not g.is_single:  # (B, H'/W, T, D) -> (B, H', T_r, D): every rank the same shape
        out = all_to_all(out, split_dim=2, concat_dim=1, group=g, sizes=rows)
    return out[:, :heads]
