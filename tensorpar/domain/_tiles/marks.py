"""Which tensors of a forward are tiles and which are pooled (replicated) features.

After a global pooling a domain-parallel model may continue on replicated data: every rank
holds the whole pooled features, and the layers that take them run as dense (a classifier
head). The tiles go on beside them, through converted layers with their halos, and the two
may meet again (`meet`: squeeze-and-excitation, an image-pooling branch). Which path a
layer or a functional call takes is decided by what it is given, so every tensor of a
forward carries a mark.

While a converted model runs, every tensor derived from the image tile is marked a tile
and every tensor derived from a global pooling's output (and not from a tile) is marked
pooled: a converted layer marks its output, and the functional-call conversion marks the
outputs of every other call from its inputs (`output_kind`; an in-place write marks its
target). ``torch.zeros_like(x)`` is what ``x`` is.

The rest (the parameters, a timestep, constants, what is computed from them alone) are
the same on every rank and take the side of what they meet. What is made of them in the
forward before its first global pooling is marked early: it keeps the tiles' road into a
converted layer after the pooling too (a mask of the tile's size made at the top), where
a tensor made after the pooling takes the pooled features' road. Where such a tensor meets
pooled features, the gradient that reaches it there is whole on every rank, and it gives
a share (`shares`), whether it is a parameter or computed from one.
The marks live for one forward, keyed by the tensor's identity.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["CHECKPOINTED", "EARLY", "PARTIAL", "POOLED", "TILE", "UNREAD", "Kind", "Marks",
           "Merged", "Scan", "tensors_in"]

Kind = Literal["tile", "pooled", "early", "partial"]
TILE: Kind = "tile"
POOLED: Kind = "pooled"
EARLY: Kind = "early"
PARTIAL: Kind = "partial"
"""A sum of the whole tile (a loss of the tile's part), alone or combined with pooled
features on each rank (a loss of both parts): summed over the ranks by the backward, so
combined further only by sums and scalings (`not_linear`)."""



UNREAD: frozenset[int] = frozenset({-1})
"""The held dims of a tile reshaped in a way that is not followed: which of its dims hold
the split dims' points is not known (not even that they are the image's)."""

CHECKPOINTED = "CheckpointFunctionBackward"  # torch.utils.checkpoint(use_reentrant=True)

Merged = tuple[tuple[int, int], ...]
"""A dim made of several (``x.flatten(2)``): each part's size and the split dim whose
points it holds (-1: none), in row-major order."""


class Marks:
    """Each marked tensor's kind, for one forward."""

    def __init__(self) -> None:
        self._kinds: dict[int, tuple[weakref.ref[torch.Tensor], Kind]] = {}
        self._as_tiles: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor,
                                        list[Callable[[], None]]]] = {}
        self._points: dict[int, tuple[weakref.ref[torch.Tensor], frozenset[int],
                                      tuple[int, int] | None]] = {}
        self._origins: dict[int, tuple[weakref.ref[torch.Tensor], torch.Size | None]] = {}
        self._orders: dict[int, tuple[weakref.ref[torch.Tensor], tuple[int, ...] | None,
                                      Merged | None]] = {}

    def clear(self) -> None:
        """Forget every mark (a new forward)."""
        self._kinds.clear()
        self._as_tiles.clear()
        self._points.clear()
        self._origins.clear()
        self._orders.clear()

    def hold_points(self, t: torch.Tensor, dims: frozenset[int],
                    block: tuple[int, int] | None = None) -> None:
        """Record the dims of the reshaped tile ``t`` that hold the split dims' points.

        ``block``: where the split rows lie in the one dim holding them (see
        `tensorpar.domain._forward.points.Block`; ``None``: not known).
        """
        self._points[id(t)] = (weakref.ref(t), dims, block)

    def hold_order(self, t: torch.Tensor, order: tuple[int, ...] | None,
                   merged: Merged | None = None) -> None:
        """Record which dim of ``t`` holds each split dim's points (tiles of a mesh).

        ``order``: the dim holding split dim ``i``'s points at ``i`` (``None``: not known);
        ``merged``: where the split dims' points share one dim (``x.flatten(2)`` of a
        mesh's tile), its parts in row-major order, each ``(size, split dim or -1)``
        (where this rank cannot list them, an empty tile's: the split dims' parts alone,
        each of size -1).
        """
        self._orders[id(t)] = (weakref.ref(t), order, merged)

    def order(self, t: torch.Tensor) -> tuple[bool, tuple[int, ...] | None, Merged | None]:
        """Whether `hold_order` recorded ``t``, and what (its order, its merged parts)."""
        entry = self._orders.get(id(t))
        if entry is None or entry[0]() is not t:
            return False, None, None
        return True, entry[1], entry[2]

    def mark_unread(self, t: torch.Tensor, origin: torch.Size | None) -> None:
        """Record ``t`` as `UNREAD`.

        ``origin``: the shape of the image-shaped tile it came from, in the same row-major
        order (a reshape back to that shape is that image again); ``None``: none.
        """
        self.hold_points(t, UNREAD)
        self._origins[id(t)] = (weakref.ref(t), origin)

    def origin(self, t: torch.Tensor) -> torch.Size | None:
        """The ``origin`` recorded by `mark_unread` (``None``: none)."""
        entry = self._origins.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def image_again(self, t: torch.Tensor) -> None:
        """Forget what is recorded of ``t``'s points: it has the image's layout again."""
        self._points.pop(id(t), None)
        self._orders.pop(id(t), None)

    def points(self, t: torch.Tensor) -> frozenset[int] | None:
        """The dims of the reshaped tile ``t`` holding points (``None``: not known)."""
        entry = self._points.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def block(self, t: torch.Tensor) -> tuple[int, int] | None:
        """The recorded block of the reshaped tile ``t`` (``None``: not known)."""
        entry = self._points.get(id(t))
        return entry[2] if entry is not None and entry[0]() is t else None

    def keep_as_tiles(self, pooled: torch.Tensor, tiles: torch.Tensor,
                      pending: Sequence[Callable[[], None]] = ()) -> None:
        """Remember ``tiles``: ``pooled`` computed as a tile, in case it meets one.

        ``pending``: what taking the tile version does (a norm's running statistics as its
        tile version left them), see `take_tiles`.
        """
        self._as_tiles[id(pooled)] = (weakref.ref(pooled), tiles, list(pending))

    def as_tiles(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t`` computed as a tile (`keep_as_tiles`), else ``None``."""
        entry = self._as_tiles.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def pending(self, t: torch.Tensor) -> list[Callable[[], None]]:
        """What taking ``t``'s tile version does (`keep_as_tiles`)."""
        entry = self._as_tiles.get(id(t))
        return entry[2] if entry is not None and entry[0]() is t else []

    def take_tiles(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s tile version, taken (its pending updates done), else ``None``."""
        tiles = self.as_tiles(t)
        for update in self.pending(t):
            update()
        return tiles

    def mark(self, value: Any, kind: Kind | None) -> None:
        """Mark every tensor in ``value`` (a tensor, or a tuple/list/dict of them)."""
        if kind is None:
            return
        for t in tensors_in(value):
            self._kinds[id(t)] = (weakref.ref(t), kind)

    def kind_of(self, t: torch.Tensor) -> Kind | None:
        """The kind of ``t`` (``None``: neither)."""
        entry = self._kinds.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def scan(self, args: Any, kwargs: Any) -> Scan:
        """What a call takes (see `Scan`)."""
        scan = Scan(set(), 0, [], False)
        for t in tensors_in((args, kwargs)):
            kind = self.kind_of(t)
            if (node := t.grad_fn) is not None and type(node).__name__ == CHECKPOINTED:
                scan.checkpointed = True
            if kind == EARLY:
                scan.early = True
            elif kind is not None:
                scan.kinds.add(kind)
                if kind == POOLED:
                    scan.pooled_numel = max(scan.pooled_numel, t.numel())
            if isinstance(t, nn.Parameter):
                scan.params.append(t)
        return scan


@dataclass
class Scan:
    """What a call takes.

    Attributes:
        kinds: the tile and pooled marks among its tensors.
        pooled_numel: the number of elements of its largest pooled tensor.
        params: its parameters.
        early: whether a tensor marked early is among them.
        checkpointed: whether the output of a reentrant activation checkpoint is among
            them (`flow.refuse_checkpointed`).
    """

    kinds: set[Kind]
    pooled_numel: int
    params: list[torch.Tensor]
    early: bool
    checkpointed: bool = False

    @property
    def road(self) -> Kind | None:
        """The kind whose road a call takes: a tile's, else pooled, else early, else none."""
        return (TILE if TILE in self.kinds else POOLED if POOLED in self.kinds
                else EARLY if self.early else None)


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, inside tuples, lists and dict values too."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)


