"""Column- and row-parallel versions of transformers' ``Conv1D`` (GPT-2's linear layer).

``Conv1D`` is a linear layer that stores its weight transposed: ``(in_features,
out_features)``, ``y = x W + b``. The parallel versions keep that layout, so a rank's weight
is a slice of the dense one along the same dims, and dense checkpoints load as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from tensorpar.collectives.regions import gather_from_group
from tensorpar.comm._group import GroupLike
from tensorpar.nn.layers._column_fn import column_linear
from tensorpar.nn.layers._spec_cache import SpecCache
from tensorpar.nn.layers.linear import ShardedLayer, column_shard, row_output
from tensorpar.nn.layers.random import rng_kept
from tensorpar.nn.state._shards import AnyShard, Shard, keep_frozen, shard_of
from tensorpar.nn.state.replica_check import mark_sharded_layer

__all__ = ["ColumnParallelConv1D", "RowParallelConv1D"]


def _dense_params(conv: nn.Module) -> tuple[int, int, torch.Tensor, torch.Tensor | None]:
    """``(in_features, out_features, weight, bias)`` of a ``Conv1D`` (weight ``(in, out)``)."""
    weight = conv.weight
    bias = getattr(conv, "bias", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise TypeError(f"from_dense: expected a Conv1D with a 2-D weight (in_features, "
                        f"out_features), got {type(conv).__name__}")
    return weight.shape[0], weight.shape[1], weight, bias if isinstance(bias, torch.Tensor) \
        else None


class ColumnParallelConv1D(ShardedLayer):
    """``y = x W + b`` (``W``: ``(in_features, out_features)``), output features split.

    The column-parallel layer of `ColumnParallelLinear` in ``Conv1D``'s layout: each rank
    holds ``W[:, shard]`` and ``b[shard]`` and computes that slice of ``y``.

    Args:
        in_features: size of each input sample.
        out_features: size of each (full) output sample.
        bias: learn an additive bias (sharded like the output).
        gather_output: all-gather the output, so every rank gets the full ``y``.
        multiple_of: shard boundaries fall on multiples of this (one per block with
            ``blocks``).
        blocks: the output is made of blocks of these sizes, each split on its own (see
            `ColumnParallelLinear`).
        group: the tensor-parallel group.
        device: the parameters' device.
        dtype: the parameters' dtype.

    Shape:
        input ``(*, in_features)``; output ``(*, out_features)`` with ``gather_output``,
        else ``(*, shard)``.

    Raises:
        ValueError: sizes that do not fit ``multiple_of`` or ``blocks``.
    """

    sharded_dims: ClassVar[dict[str, int]] = {"weight": 1, "bias": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, multiple_of: int | Sequence[int] = 1,
                 blocks: Sequence[int] | None = None, group: GroupLike = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.shard: AnyShard = column_shard("ColumnParallelConv1D", out_features, group,
                                            multiple_of, blocks)
        self.weight = nn.Parameter(torch.empty(in_features, self.shard.length, device=device,
                                               dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.shard.length, device=device, dtype=dtype)) \
            if bias else None
        with torch.no_grad():
            self.weight.normal_(0.0, 0.02)  # Conv1D's own initialisation
        if not self.shard.group.is_single:
            mark_sharded_layer(self, self.sharded_dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``x W + b`` (all of it with ``gather_output``)."""
        y = column_linear(x, self.weight.t(), self.bias, self.shard.group)
        if self.gather_output:
            y = gather_from_group(y, dim=-1, group=self.shard.group, sizes=self.shard.sizes)
            y = self.shard.unpack(y, -1)
        return y

    @classmethod
    def from_dense(cls, conv: nn.Module, *, group: GroupLike = None, gather_output: bool = False,
                   multiple_of: int | Sequence[int] = 1, blocks: Sequence[int] | None = None
                   ) -> ColumnParallelConv1D:
        """This rank's shard of a ``Conv1D`` (every rank passes the same dense layer)."""
        n_in, n_out, weight, bias = _dense_params(conv)
        with rng_kept(weight.device):
            layer = cls(n_in, n_out, bias is not None, gather_output=gather_output,
                        multiple_of=multiple_of, blocks=blocks, group=group,
                        device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(layer.shard.take(weight, 1))
            if layer.bias is not None and bias is not None:
                layer.bias.copy_(layer.shard.take(bias, 0))
        keep_frozen(layer, conv)
        return layer

    def extra_repr(self) -> str:
        """The sizes, with this rank's shard."""
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(this rank: {self.shard.length}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}")


class RowParallelConv1D(ShardedLayer):
    """``y = x W + b`` (``W``: ``(in_features, out_features)``), input features split.

    Each rank multiplies its slice of the input by ``W[shard, :]``; the partial results are
    summed across the group and the replicated bias is added once, after the sum.

    Args:
        in_features: size of each (full) input sample.
        out_features: size of each output sample.
        bias: learn an additive bias (replicated).
        input_is_parallel: the input is already this rank's slice; otherwise the full input
            is split here.
        multiple_of: shard boundaries fall on multiples of this.
        reduce_dtype: compute the partial products, their sum and the bias in this dtype,
            then cast back (see `RowParallelLinear`).
        group: the tensor-parallel group.
        device: the parameters' device.
        dtype: the parameters' dtype.

    Shape:
        input ``(*, shard)`` (or ``(*, in_features)``); output ``(*, out_features)``.

    Raises:
        ValueError: ``in_features`` is not a multiple of ``multiple_of``.
    """

    sharded_dims: ClassVar[dict[str, int]] = {"weight": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 input_is_parallel: bool = True, multiple_of: int = 1,
                 reduce_dtype: torch.dtype | None = None, group: GroupLike = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.reduce_dtype = input_is_parallel, reduce_dtype
        self.shard: Shard = shard_of("RowParallelConv1D", in_features, group, multiple_of)
        self.weight = nn.Parameter(torch.empty(self.shard.length, out_features, device=device,
                                               dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) \
            if bias else None
        with torch.no_grad():
            self.weight.normal_(0.0, 0.02)
        self._specs = SpecCache("RowParallelConv1D", self.shard)
        if not self.shard.group.is_single:
            mark_sharded_layer(self, self.sharded_dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W + b``: the partial products summed across the group, then the bias.

        The arithmetic of `RowParallelLinear` (its one-Function path, autocast and
        ``reduce_dtype`` included) on the transposed weight.
        """
        if not self.input_is_parallel:
            x = self._specs.split(x)
        return row_output(x, self.weight.t(), self.bias, self.shard.group, self.reduce_dtype)

    @classmethod
    def from_dense(cls, conv: nn.Module, *, group: GroupLike = None,
                   input_is_parallel: bool = True, multiple_of: int = 1,
                   reduce_dtype: torch.dtype | None = None) -> RowParallelConv1D:
        """This rank's shard of a ``Conv1D`` (every rank passes the same dense layer)."""
        n_in, n_out, weight, bias = _dense_params(conv)
        with rng_kept(weight.device):
            layer = cls(n_in, n_out, bias is not None, input_is_parallel=input_is_parallel,
                        multiple_of=multiple_of, reduce_dtype=reduce_dtype, group=group,
                        device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(layer.shard.take(weight, 0))
            if layer.bias is not None and bias is not None:
                layer.bias.copy_(bias)
        keep_frozen(layer, conv)
        return layer

    def extra_repr(self) -> str:
        """The sizes, with this rank's shard."""
        return (f"in_features={self.in_features} (this rank: {self.shard.length}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}"
                + (f", reduce_dtype={self.reduce_dtype}" if self.reduce_dtype else ""))
