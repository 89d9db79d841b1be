"""Which tensors of a forward are tiles and which are pooled (replicated) features.

After a global pooling a domain-parallel model may continue on replicated data: every rank
holds the whole pooled features, and the layers that take them run as dense (a classifier
head). The tiles go on beside them, through converted layers with their halos, and the two
may meet again (`_meet`: squeeze-and-excitation, an image-pooling branch). Which path a
layer or a functional call takes is decided by what it is given, so every tensor of a
forward carries a mark.

While a converted model runs, every tensor derived from the image tile is marked a tile
and every tensor derived from a global pooling's output (and not from a tile) is marked
pooled: a converted layer marks its output, and the functional-call conversion marks the
outputs of every other call from its inputs (`output_kind`; an in-place write marks its
target). Tensors made otherwise (constants, the timestep, ``x.new_zeros``) are neither;
``torch.zeros_like(x)`` is what ``x`` is.
The marks live for one forward, keyed by the tensor's identity.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["POOLED", "TILE", "Kind", "Marks", "Scan", "mixing_error", "output_kind",
           "reads_only_metadata", "tensors_in"]

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
    """The kind of a call's output (raises where pooled features spread into tiles).

    A tensor argument that only gives a dtype, a device or a shape (``y.to(x)``,
    ``x.new_zeros(...)``) passes no mark on; ``torch.zeros_like(x)`` has ``x``'s shape and
    mark (a constant tile is a tile). Pooled features
    meeting a tile with the image's dims are `_meet`'s; here they meet a tile's partial
    reduction: allowed where nothing is broadcast over the tile's points (a loss made of
    a tile's partial sum plus a pooled one), refused where the pooled tensor is spread over
    more elements than it has. After the pooling a parameter is replicated data: what a
    call makes of it alone is pooled.
    """
    if reads_only_metadata(func):  # the first argument's shape (``_like``) or data (``to``)
        if not getattr(func, "__name__", "").startswith("new_") and args \
                and isinstance(args[0], torch.Tensor):
            return marks.kind_of(args[0])
        return None
    name = getattr(func, "__name__", "")
    if POOLED in scan.kinds and TILE in scan.kinds:
        if any(t.numel() > scan.pooled_numel for t in tensors_in(out)):
            raise mixing_error(name or str(func))
        return None
    if len(scan.kinds) == 1:
        return next(iter(scan.kinds))
    if reduced and scan.params:
        return POOLED
    return None


def reads_only_metadata(func: Any) -> bool:
    """Whether ``func`` reads only the dtype, device or shape of some tensor arguments.

    Of those after the first: ``y.to(x)``, ``y.type_as(x)``; of all: ``x.new_zeros``,
    ``torch.zeros_like(x)``.
    """
    name = getattr(func, "__name__", "")
    return name.startswith("new_") or name.endswith("_like") or name in ("to", "type_as")


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
    """Pooled features and tiles meet in ``what`` in a way that cannot be followed."""
    return RuntimeError(
        f"{what} (domain-parallel) takes both tiles and features after a global pooling "
        f"(replicated on every rank), and the pooled operand is spread over the tile's points "
        f"in a way that is not followed: pooled features go back into the tiles where they "
        f"have size 1 along every split dim (a gate broadcast over the tile), or through "
        f"F.interpolate, expand or repeat to the tile's size")
