"""Shard arithmetic for the parallel layers: who holds which slice of a dimension."""

from __future__ import annotations

from dataclasses import dataclass

from tensorpar._group import Group, GroupLike, resolve_group
from tensorpar._split import balanced_sizes

__all__ = ["Shard", "shard_of"]


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
