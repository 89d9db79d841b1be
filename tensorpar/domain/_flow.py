"""Which tensors of a forward are tiles and which are pooled (replicated) features.

After a global pooling a domain-parallel model continues on replicated data: every rank
holds the whole pooled features and the layers after it run as dense. That is right for a
head on the pooled features (a classifier) and wrong for anything that brings the tiles
back: pooled features multiplied into the tiles (squeeze-and-excitation), up-sampled and
concatenated with them (DeepLab's image-pooling branch), or a tile reaching a converted
layer after the pooling (it would run without its halo). Those are refused at the call.

While a converted model runs, every tensor derived from the image tile is marked a tile
and every tensor derived from a global pooling's output (and not from a tile) is marked
pooled: a converted layer marks its output, and the functional-call conversion marks the
outputs of every other call from its inputs (`output_kind`; an in-place write marks its
target). Tensors made otherwise (constants, the timestep, ``x.new_zeros``) are neither.
The marks live for one forward, keyed by the tensor's identity.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["POOLED", "TILE", "Kind", "Marks", "Scan", "output_kind", "tensors_in"]

Kind = Literal["tile", "pooled"]
TILE: Kind = "tile"
POOLED: Kind = "pooled"


class Marks:
    """Each marked tensor's kind, for one forward."""

    def __init__(self) -> None:
        self._kinds: dict[int, tuple[weakref.ref[torch.Tensor], Kind]] = {}

    def clear(self) -> None:
        """Forget every mark (a new forward)."""
        self._kinds.clear()

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
        """The kinds among a call's arguments, the largest pooled one, the parameters."""
        scan = Scan(set(), 0, [])
        for t in tensors_in((args, kwargs)):
            kind = self.kind_of(t)
            if kind is not None:
                scan.kinds.add(kind)
                if kind == POOLED:
                    scan.pooled_numel = max(scan.pooled_numel, t.numel())
            if isinstance(t, nn.Parameter):
                scan.params.append(t)
        return scan


@dataclass
class Scan:
    """What a call takes: its tensors' kinds, its largest pooled tensor, its parameters."""

    kinds: set[Kind]
    pooled_numel: int
    params: list[torch.Tensor]


def output_kind(func: Any, args: Sequence[Any], out: Any, scan: Scan, marks: Marks,
                reduced: bool) -> Kind | None:
    """The kind of a call's output (raises where pooled features broadcast into tiles).

    A tensor argument that only gives a dtype, a device or a shape (``y.to(x)``,
    ``x.new_zeros(...)``, ``torch.zeros_like(x)``) passes no mark on. Tiles and pooled
    features may meet where nothing is broadcast over the tile's points (a loss made of a
    tile's partial sum plus a pooled one); where a pooled tensor is spread over more
    elements than it has (a gate multiplied into the tile, a concatenation), the gradient
    it would get is this tile's share only: refused. After the pooling a parameter is
    replicated data: what a call makes of it alone is pooled.
    """
    name = getattr(func, "__name__", "")
    if name.startswith("new_") or name.endswith("_like"):
        return None
    if name in ("to", "type_as") and args and isinstance(args[0], torch.Tensor):
        return marks.kind_of(args[0])
    if POOLED in scan.kinds and TILE in scan.kinds:
        if any(t.numel() > scan.pooled_numel for t in tensors_in(out)):
            raise mixing_error(name or str(func))
        return None
    if len(scan.kinds) == 1:
        return next(iter(scan.kinds))
    if reduced and scan.params:
        return POOLED
    return None


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


def mixing_error(what: str) -> RuntimeError:
    """Pooled features and tiles meet in ``what``."""
    return RuntimeError(
        f"{what} (domain-parallel) takes both tiles and features after a global pooling "
        f"(replicated on every rank): pooled features fed back into the tiles "
        f"(squeeze-and-excitation, an image-pooling branch) are not supported; the model "
        f"must continue on the pooled features alone")


def tile_after_pooling_error(what: str) -> RuntimeError:
    """A tile reaches ``what`` after the forward's global pooling."""
    return RuntimeError(
        f"{what} (domain-parallel) got a tile after a global pooling: after it the model "
        f"runs dense on the pooled (replicated) features, and a tile would be processed "
        f"without its halo; compute what the tiles need before the global pooling")
