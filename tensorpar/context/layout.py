"""Which positions of a sequence each rank of a context-parallel group holds."""

from __future__ import annotations

import torch

from tensorpar.context._blocks import Segment

__all__ = ["Layout", "contiguous_layout", "zigzag_layout"]

Layout = tuple[tuple[Segment, ...], ...]
"""``layout[r]``: rank ``r``'s segments of global positions, in the order its rows hold them."""


def _balanced(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def contiguous_layout(lengths: list[int]) -> Layout:
    """Rank ``r`` holds the ``r``-th of consecutive chunks of the given lengths.

    Example:
        >>> contiguous_layout([2, 0, 3])[2]
        (Segment(start=2, length=3),)
    """
    starts = [sum(lengths[:r]) for r in range(len(lengths))]
    return tuple((Segment(s, n),) for s, n in zip(starts, lengths, strict=True))


def zigzag_layout(total: int, world: int) -> Layout:
    """The causal load-balanced layout: rank ``r`` holds chunks ``r`` and ``2W - 1 - r``.

    The sequence is cut into ``2W`` chunks as even as they can be (the first ``total % 2W``
    one longer; any length works, chunks may be empty). Under a causal mask an early chunk
    sees few keys and a late one many, so each rank's pair costs about the same.

    Example:
        >>> zigzag_layout(7, 2)[0]  # chunks of 2, 2, 2, 1: rank 0 holds the first and last
        (Segment(start=0, length=2), Segment(start=6, length=1))
    """
    lengths = _balanced(total, 2 * world)
    starts = [sum(lengths[:i]) for i in range(2 * world)]
    return tuple(
        (Segment(starts[r], lengths[r]), Segment(starts[2 * world - 1 - r],
                                                 lengths[2 * world - 1 - r]))
        for r in range(world))


def positions(layout: Layout, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of rank ``rank``'s rows, in order (an int64 tensor)."""
    parts = [torch.arange(s.start, s.start + s.length, device=device) for s in layout[rank]]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
