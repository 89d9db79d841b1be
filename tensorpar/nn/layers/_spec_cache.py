"""A layer's region mappings through their cheapest path: specs kept per input shape.

`split_to_group` and `gather_from_group` check their arguments and work out how a tensor is
cut (a `SplitSpec`) on every call, from nothing but the input's shape and dtype and the
layer's shard. A layer makes the same calls with the same shard step after step, so
`SpecCache` does that work once per shape and applies the region's Function directly. In
validation mode and under ``torch.compile`` the public functions run instead (every call
fingerprinted; or traced).
"""

from __future__ import annotations

import torch

from tensorpar.collectives._meta import chunks_spec
from tensorpar.collectives._split import SplitSpec
from tensorpar.collectives._symmetric import _GatherFromGroup, _SplitToGroup
from tensorpar.collectives.regions import gather_from_group, split_spec, split_to_group
from tensorpar.nn.layers._path import LayerPath, layer_path
from tensorpar.nn.state._shards import AnyShard

__all__ = ["SpecCache"]

MAX_SHAPES = 64
"""Shapes kept per layer and mapping; past that the cache starts over (e.g. generation
with a growing sequence)."""
_CACHED = frozenset({LayerPath.FUSED, LayerPath.NO_GRAPH})  # else the public function


class SpecCache:
    """The split and gather specs of one layer's shard, per input shape and dtype.

    Args:
        fn: the layer's name, used in error messages.
        shard: the layer's shard of the split dimension (the last one).
    """

    __slots__ = ("fn", "gathers", "shard", "splits")

    def __init__(self, fn: str, shard: AnyShard) -> None:
        self.fn = fn
        self.shard = shard
        self.splits: dict[tuple[torch.Size, torch.dtype], SplitSpec] = {}
        self.gathers: dict[tuple[torch.Size, torch.dtype], SplitSpec] = {}

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``split_to_group(x, dim=-1, group=shard.group, sizes=shard.sizes)``."""
        s = self.shard
        if layer_path(x, s.group, casts=False) not in _CACHED:  # the public function decides
            return split_to_group(x, dim=-1, group=s.group, sizes=s.sizes)
        key = (x.shape, x.dtype)
        spec = self.splits.get(key)
        if spec is None:
            spec = split_spec(self.fn, x, -1, s.group, s.sizes)
            _remember(self.splits, key, spec)
        out: torch.Tensor = _SplitToGroup.apply(x, spec)  # type: ignore[no-untyped-call]
        return out

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """``gather_from_group(y, dim=-1, group=shard.group, sizes=shard.sizes)``."""
        s = self.shard
        if layer_path(y, s.group, casts=False) not in _CACHED:  # the public function decides
            return gather_from_group(y, dim=-1, group=s.group, sizes=s.sizes)
        key = (y.shape, y.dtype)
        spec = self.gathers.get(key)
        if spec is None:
            spec, _ = chunks_spec(self.fn, y, -1, s.group, s.sizes, root=-1)
            _remember(self.gathers, key, spec)
        out: torch.Tensor = _GatherFromGroup.apply(y, spec)  # type: ignore[no-untyped-call]
        return out


def _remember(specs: dict[tuple[torch.Size, torch.dtype], SplitSpec],
              key: tuple[torch.Size, torch.dtype], spec: SplitSpec) -> None:
    if len(specs) >= MAX_SHAPES:
        specs.clear()
    specs[key] = spec
