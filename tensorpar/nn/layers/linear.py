"""Column- and row-parallel linear layers (uneven shards allowed)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.collectives.functional import broadcast
from tensorpar.collectives.regions import reduce_from_group
from tensorpar.comm._group import Group, GroupLike
from tensorpar.nn.layers._column_fn import SharedInput, column_linear
from tensorpar.nn.layers._row_fn import row_linear, wide_product
from tensorpar.nn.layers._spec_cache import SpecCache
from tensorpar.nn.layers.random import rng_kept
from tensorpar.nn.sequence import SequenceShards, column_on_gathered, sequence_row_output
from tensorpar.nn.state._shards import (
    AnyShard,
    Shard,
    gather_shards,
    keep_frozen,
    packed_shard_of,
    scatter_shards,
    shard_of,
)
from tensorpar.nn.state.replica_check import mark_sharded_layer
from tensorpar.placeholder import TensorPlaceholder

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ShardedLayer"]

DenseOrPlaceholders = nn.Linear | dict[str, TensorPlaceholder]


def row_output(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, g: Group,
               wide: torch.dtype | None) -> torch.Tensor:
    """The row-parallel layers' output from this rank's input slice ``x``.

    ``reduce_from_group(F.linear(x, weight)) + bias`` (``weight``: ``(out, shard)``), as one
    Function where it can be, in ``wide`` (a ``reduce_dtype``) where one is given.
    """
    widened = wide_product(x, weight, bias, wide)
    if widened is None:
        return row_linear(x, weight, bias, g)
    product, wide_bias, out = widened
    y = reduce_from_group(product, group=g)
    if wide_bias is not None:
        y = y + wide_bias
    return y.to(out)


def _init_linear(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        weight.uniform_(-bound, bound)
        if bias is not None:
            bias.uniform_(-bound, bound)


class ShardedLayer(nn.Module):
    """A layer whose parameters are split per `sharded_dims` (the rest replicated).

    Gives the dense parameters back (`full_state`) and takes them (`load_full_state`):
    sharded parameters are gathered / scattered along their dim with every block of a
    packed shard in its dense place; replicated ones (a row-parallel bias) are copied from
    ``dst`` / broadcast from ``src``.
    """

    sharded_dims: ClassVar[dict[str, int]]
    shard: AnyShard

    def full_state(self, dst: int = 0) -> dict[str, torch.Tensor | TensorPlaceholder]:
        """The dense parameters on ``dst`` (dense layout); placeholders elsewhere."""
        g = self.shard.group
        out: dict[str, torch.Tensor | TensorPlaceholder] = {}
        for name, p in self.named_parameters(recurse=False):
            dim = self.sharded_dims.get(name)
            value = p.detach()
            if dim is not None:
                out[name] = gather_shards(value, self.shard, dim, dst)
            else:
                out[name] = value.clone() if g.rank == dst else \
                    TensorPlaceholder.like(value, owner=dst, group=g.handle)
        return out

    def load_full_state(self, state: Mapping[str, Any], src: int = 0) -> None:
        """Load dense parameters held on ``src`` (``None``/placeholders elsewhere)."""
        with torch.no_grad():
            for name, p in self.named_parameters(recurse=False):
                dim = self.sharded_dims.get(name)
                p.copy_(scatter_shards(state.get(name), self.shard, dim, src) if dim is not None
                        else broadcast(state.get(name), src=src, group=self.shard.group))


class ColumnParallelLinear(ShardedLayer):
    """``y = x W^T + b`` with ``W``'s output features split across ``group``.

    Each rank holds ``out_features`` rows of its shard (balanced like ``tensor_split``, in
    units of ``multiple_of``) and computes that slice of ``y``. The input must be the same on
    every rank; its gradient is summed across the group (`copy_to_group`). In backward that
    all-reduce is launched before the weight gradient is computed and overlaps it.

    Args:
        in_features: size of each input sample.
        out_features: size of each (full) output sample.
        bias: learn an additive bias (sharded like the output).
        gather_output: all-gather the output so every rank gets the full ``y``; otherwise
            each rank keeps its slice (feed it to a `RowParallelLinear`).
        multiple_of: shard boundaries fall on multiples of this (e.g. ``head_dim``); with
            ``blocks``, one unit per block (or one for all).
        blocks: the output is a fused projection made of blocks of these sizes
            (``[q; k; v]``, ``[gate; up]``; they sum to ``out_features``): every block is
            split on its own and this rank holds its slice of each, block after block (its
            output is ``[q_r; k_r; v_r]``). ``None``: one block.
        group: the tensor-parallel group (a ``ProcessGroup`` or 1-D ``DeviceMesh``).
        device: the parameters' device.
        dtype: the parameters' dtype.

    Shape:
        input ``(*, in_features)``; output ``(*, out_features)`` with ``gather_output``
        (in the dense order, blocks unpermuted), else ``(*, shard)``.

    Raises:
        ValueError: ``blocks`` do not sum to ``out_features``, or a size is not a multiple
            of its unit.

    Attributes:
        sharded_dims: the dense dim each sharded parameter is split along.

    Example:
        >>> import torch
        >>> from tensorpar.nn import ColumnParallelLinear
        >>> dense = torch.nn.Linear(4, 6)
        >>> layer = ColumnParallelLinear.from_dense(dense)  # one rank: the whole layer
        >>> x = torch.randn(2, 4)
        >>> layer(x).shape
        torch.Size([2, 6])
        >>> torch.allclose(layer(x), dense(x))
        True
    """

    sharded_dims: ClassVar[dict[str, int]] = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, multiple_of: int | Sequence[int] = 1,
                 blocks: Sequence[int] | None = None, group: GroupLike = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.shard: AnyShard = column_shard("ColumnParallelLinear", out_features, group,
                                            multiple_of, blocks)
        self.weight = nn.Parameter(torch.empty(self.shard.length, in_features, device=device,
                                               dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.shard.length, device=device, dtype=dtype)) \
            if bias else None
        _init_linear(self.weight, self.bias, in_features)
        self._specs = SpecCache("ColumnParallelLinear", self.shard)
        self.input_share: SharedInput | None = None
        """Set (by `tensorpar.parallelize`) on layers that may read the same input as their
        siblings: they then share one backward all-reduce (see `SharedInput`)."""
        self.sequence: SequenceShards | None = None
        """Set (by `tensorpar.parallelize`) inside a `SequenceGather` module: the input is
        then the whole sequence gathered from the ranks' slices, whose backward
        reduce-scatters this layer's partial input gradient (the layer issues no collective)."""
        if not self.shard.group.is_single:
            mark_sharded_layer(self, self.sharded_dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``x W^T + b`` (all of it with ``gather_output``)."""
        share, g = self.input_share, self.shard.group
        if self.sequence is not None:  # gathered by the parent (see `SequenceGather`)
            y = column_on_gathered(x, self.weight, self.bias, self.sequence)
        elif share is not None and torch.is_grad_enabled() and not g.is_single:
            y = F.linear(share.copy(x, g), self.weight, self.bias)  # one all-reduce for all
        else:
            y = column_linear(x, self.weight, self.bias, g)
        if self.gather_output:
            y = self.shard.unpack(self._specs.gather(y), -1)
        return y

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, group: GroupLike = None,
                   gather_output: bool = False, multiple_of: int | Sequence[int] = 1,
                   blocks: Sequence[int] | None = None) -> ColumnParallelLinear:
        """This rank's shard of ``linear`` (every rank passes the same dense layer)."""
        with rng_kept(linear.weight.device):
            layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                        gather_output=gather_output, multiple_of=multiple_of, blocks=blocks,
                        group=group, device=linear.weight.device, dtype=linear.weight.dtype)
        s = layer.shard
        with torch.no_grad():
            layer.weight.copy_(s.take(linear.weight, 0))
            if layer.bias is not None and linear.bias is not None:
                layer.bias.copy_(s.take(linear.bias, 0))
        keep_frozen(layer, linear)
        return layer

    def to_dense(self, dst: int = 0) -> DenseOrPlaceholders:
        """The dense ``nn.Linear`` on ``dst``; placeholders of its parameters elsewhere."""
        state = self.full_state(dst)
        return _dense_linear(state, self.in_features, self.out_features)

    def extra_repr(self) -> str:
        """The sizes, with this rank's shard."""
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(this rank: {self.shard.length}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(ShardedLayer):
    """``y = x W^T + b`` with ``W``'s input features split across ``group``.

    Each rank multiplies its slice of the input features; the partial results are summed
    across the group (`reduce_from_group`) and the bias, replicated, is
    added once, after the sum.

    Args:
        in_features: size of each (full) input sample.
        out_features: size of each output sample.
        bias: learn an additive bias (replicated on every rank).
        input_is_parallel: the input is already this rank's slice (the output of a
            `ColumnParallelLinear`); otherwise the full input is split here.
        multiple_of: shard boundaries fall on multiples of this (e.g. ``head_dim``).
        reduce_dtype: compute the partial products, their sum and the bias in this dtype
            (e.g. ``torch.float32`` for bfloat16 parameters, so the only rounding to
            bfloat16 is the final one, as in the dense layer), then cast back.
        group: the tensor-parallel group.
        device: the parameters' device.
        dtype: the parameters' dtype.

    Shape:
        input ``(*, shard)`` (or ``(*, in_features)``); output ``(*, out_features)``.

    Example:
        >>> import torch
        >>> from tensorpar.nn import RowParallelLinear
        >>> dense = torch.nn.Linear(6, 4)
        >>> layer = RowParallelLinear.from_dense(dense, input_is_parallel=False)
        >>> x = torch.randn(2, 6)
        >>> torch.allclose(layer(x), dense(x))
        True
        >>> layer.weight.shape  # this rank's columns of the weight: all of them on one rank
        torch.Size([4, 6])
    """

    sharded_dims: ClassVar[dict[str, int]] = {"weight": 1}

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 input_is_parallel: bool = True, multiple_of: int = 1,
                 reduce_dtype: torch.dtype | None = None, group: GroupLike = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.reduce_dtype = reduce_dtype
        self.shard: Shard = shard_of("RowParallelLinear", in_features, group, multiple_of)
        self.weight = nn.Parameter(torch.empty(out_features, self.shard.length, device=device,
                                               dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) \
            if bias else None
        _init_linear(self.weight, self.bias, in_features)
        self._specs = SpecCache("RowParallelLinear", self.shard)
        self.sequence: SequenceShards | None = None
        """Set (by `tensorpar.parallelize`) inside a `SequenceGather` module: the output is
        then reduce-scattered along the sequence instead of all-reduced."""
        if not self.shard.group.is_single:
            mark_sharded_layer(self, self.sharded_dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b``: the partial products summed across the group, then the bias."""
        if not self.input_is_parallel:
            x = self._specs.split(x)
        if self.sequence is not None:
            return sequence_row_output(x, self.weight, self.bias, self.sequence,
                                       self.reduce_dtype)
        return row_output(x, self.weight, self.bias, self.shard.group, self.reduce_dtype)

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, group: GroupLike = None,
                   input_is_parallel: bool = True, multiple_of: int = 1,
                   reduce_dtype: torch.dtype | None = None) -> RowParallelLinear:
        """This rank's shard of ``linear`` (every rank passes the same dense layer)."""
        with rng_kept(linear.weight.device):
            layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                        input_is_parallel=input_is_parallel, multiple_of=multiple_of,
                        reduce_dtype=reduce_dtype, group=group, device=linear.weight.device,
                        dtype=linear.weight.dtype)
        s = layer.shard
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, s.start: s.stop])
            if layer.bias is not None and linear.bias is not None:
                layer.bias.copy_(linear.bias)
        keep_frozen(layer, linear)
        return layer

    def to_dense(self, dst: int = 0) -> DenseOrPlaceholders:
        """The dense ``nn.Linear`` on ``dst``; placeholders of its parameters elsewhere."""
        return _dense_linear(self.full_state(dst), self.in_features, self.out_features)

    def extra_repr(self) -> str:
        """The sizes, with this rank's shard."""
        return (f"in_features={self.in_features} (this rank: {self.shard.length}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}"
                + (f", reduce_dtype={self.reduce_dtype}" if self.reduce_dtype else ""))


def column_shard(fn: str, out_features: int, group: GroupLike,
                 multiple_of: int | Sequence[int], blocks: Sequence[int] | None) -> AnyShard:
    """A column-parallel layer's shard: plain, or packed when the output is made of blocks."""
    if blocks is None:
        if not isinstance(multiple_of, int):
            raise ValueError(f"{fn}: multiple_of={list(multiple_of)} gives one unit per block, "
                             f"but blocks=None; expected an int")
        return shard_of(fn, out_features, group, multiple_of)
    if sum(blocks) != out_features:
        raise ValueError(f"{fn}: blocks={list(blocks)} sum to {sum(blocks)}; expected "
                         f"out_features={out_features}")
    return packed_shard_of(fn, blocks, group, multiple_of)


def _dense_linear(state: dict[str, torch.Tensor | TensorPlaceholder], in_features: int,
                  out_features: int) -> DenseOrPlaceholders:
    weight = state["weight"]
    if not isinstance(weight, torch.Tensor):
        return {k: v for k, v in state.items() if isinstance(v, TensorPlaceholder)}
    dense = nn.Linear(in_features, out_features, bias="bias" in state, device=weight.device,
                      dtype=weight.dtype)
    with torch.no_grad():
        dense.weight.copy_(weight)
        bias = state.get("bias")
        if isinstance(bias, torch.Tensor) and dense.bias is not None:
            dense.bias.copy_(bias)
    return dense
