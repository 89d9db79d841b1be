"""Shard arithmetic for the parallel layers: who holds which slice of a dimension.

A `Shard` is one balanced slice of a dimension. A `PackedShard` is the shard of a fused
dimension made of blocks (``[q; k; v]``, ``[gate; up]``): every block is split on its own and
a rank holds its slice of each block, one after the other. Both describe where a rank's
pieces sit in the dense dimension (`Shard.pieces`), so gathering, scattering and checkpoints
treat them alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import nn

from tensorpar.collectives._split import balanced_sizes
from tensorpar.collectives.functional import gather, scatter
from tensorpar.comm._group import Group, GroupLike, resolve_group
from tensorpar.placeholder import TensorPlaceholder

__all__ = ["AnyShard", "PackedShard", "Piece", "Shard", "gather_shards", "keep_frozen",
           "packed_shard_of", "scatter_shards", "shard_of"]

Piece: TypeAlias = tuple[int, int, int]
"""``(dense start, local start, length)``: one contiguous piece of a rank's shard."""


@dataclass(frozen=True)
class Shard:
    """This rank's slice ``[start, start + length)`` of a dimension of ``total``."""

    group: Group
    total: int
    sizes: tuple[int, ...]

    @property
    def start(self) -> int:
        return sum(self.sizes[: self.group.rank])

    @property
    def length(self) -> int:
        return self.sizes[self.group.rank]

    @property
    def stop(self) -> int:
        return self.start + self.length

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """This rank's shard as pieces of the dense dimension: one, here."""
        return ((self.start, 0, self.length),)

    def take(self, dense: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's shard of ``dense`` along ``dim`` (a view)."""
        return dense.narrow(dim, self.start, self.length)

    def pack(self, dense: torch.Tensor, dim: int) -> torch.Tensor:
        """``dense`` reordered so that every rank's shard is contiguous (here: as is)."""
        return dense

    def unpack(self, ranks: torch.Tensor, dim: int) -> torch.Tensor:
        """The inverse of `pack`: every rank's shard, concatenated, in dense order."""
        return ranks


@dataclass(frozen=True)
class PackedShard:
    """This rank's slice of every block of a fused dimension, concatenated block after block.

    Attributes:
        group: the group the blocks are split across.
        blocks: each block's own balanced split (its ``total`` is the block's size).
    """

    group: Group
    blocks: tuple[Shard, ...]

    @property
    def total(self) -> int:
        return sum(b.total for b in self.blocks)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every rank's local length: the sum of its slices of the blocks."""
        return tuple(sum(b.sizes[r] for b in self.blocks) for r in range(self.group.size))

    @property
    def length(self) -> int:
        return self.sizes[self.group.rank]

    def _pieces(self, rank: int) -> list[Piece]:
        out, block_start, local = [], 0, 0
        for b in self.blocks:
            size = b.sizes[rank]
            out.append((block_start + sum(b.sizes[:rank]), local, size))
            block_start, local = block_start + b.total, local + size
        return out

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """This rank's slice of each block: where it sits densely and in the local shard."""
        return tuple(self._pieces(self.group.rank))

    def take(self, dense: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's shard of ``dense`` along ``dim`` (a copy: the pieces, concatenated)."""
        return torch.cat([dense.narrow(dim, start, n) for start, _, n in self.pieces], dim)

    def pack(self, dense: torch.Tensor, dim: int) -> torch.Tensor:
        """``dense`` reordered rank after rank, each rank's pieces block after block."""
        return torch.cat([dense.narrow(dim, start, n) for r in range(self.group.size)
                          for start, _, n in self._pieces(r)], dim)

    def unpack(self, ranks: torch.Tensor, dim: int) -> torch.Tensor:
        """The inverse of `pack`: every rank's shard, concatenated, back in dense order."""
        offsets = [sum(self.sizes[:r]) for r in range(self.group.size)]
        order = sorted((start, offsets[r] + local, n) for r in range(self.group.size)
                       for start, local, n in self._pieces(r))
        return torch.cat([ranks.narrow(dim, at, n) for _, at, n in order], dim)


AnyShard: TypeAlias = Shard | PackedShard


def shard_of(fn: str, total: int, group: GroupLike, multiple_of: int = 1) -> Shard:
    """Balanced shards of ``total`` (like ``torch.tensor_split``), in units of ``multiple_of``.

    Example:
        >>> shard_of("f", 10, None).sizes   # one rank holds everything
        (10,)
    """
    g = resolve_group(group, fn)
    if multiple_of < 1 or total % multiple_of:
        raise ValueError(f"{fn}: cannot split {total} into shards that are multiples of "
                         f"{multiple_of}: {total} % {multiple_of} = {total % max(multiple_of, 1)}")
    sizes = tuple(s * multiple_of for s in balanced_sizes(total // multiple_of, g.size))
    return Shard(g, total, sizes)


def packed_shard_of(fn: str, blocks: Sequence[int], group: GroupLike,
                    multiple_of: int | Sequence[int] = 1) -> PackedShard:
    """Every block split on its own, balanced in units of its ``multiple_of``.

    Example:
        >>> packed_shard_of("f", (8, 4, 4), None, (4, 2, 2)).sizes   # one rank: everything
        (16,)
    """
    units = (multiple_of,) * len(blocks) if isinstance(multiple_of, int) else tuple(multiple_of)
    if len(units) != len(blocks):
        raise ValueError(f"{fn}: multiple_of={list(units)} gives {len(units)} units for "
                         f"{len(blocks)} blocks {list(blocks)}; expected one per block")
    g = resolve_group(group, fn)
    return PackedShard(g, tuple(shard_of(fn, n, g, unit) for n, unit in zip(blocks, units,
                                                                             strict=True)))


def gather_shards(local: torch.Tensor, shard: AnyShard, dim: int, dst: int
                  ) -> torch.Tensor | TensorPlaceholder:
    """Every rank's shard gathered on ``dst``, in the dense order (blocks unpermuted)."""
    out = gather(local, dim=dim, dst=dst, group=shard.group, sizes=shard.sizes)
    return shard.unpack(out, dim) if isinstance(out, torch.Tensor) else out


def scatter_shards(dense: Any, shard: AnyShard, dim: int, src: int) -> torch.Tensor:
    """This rank's shard of the dense tensor on ``src`` (``None``/a placeholder elsewhere)."""
    if isinstance(dense, torch.Tensor) and shard.group.rank == src:
        dense = shard.pack(dense, dim)
    return scatter(dense, dim=dim, src=src, group=shard.group, sizes=shard.sizes)


def keep_frozen(layer: nn.Module, dense: nn.Module) -> None:
    """Give ``layer``'s own parameters the ``requires_grad`` of ``dense``'s of the same name.

    A sharded layer makes new parameters (trainable); a frozen dense weight stays frozen.
    """
    for name, p in layer.named_parameters(recurse=False):
        source = getattr(dense, name, None)
        if isinstance(source, torch.Tensor):
            p.requires_grad_(source.requires_grad)
