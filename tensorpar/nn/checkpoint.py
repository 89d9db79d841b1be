"""Sharded checkpoints of parallelised models with ``torch.distributed.checkpoint`` (DCP).

A parallel layer holds a shard of each dense parameter under the dense name. Saved as a plain
tensor, DCP would take the shards for identical replicas and keep one rank's. Here every shard
travels as a `ShardAtOffset`: the shard, the dense shape and the shard's offset in it (one
per block for a packed layer, whose shard is a slice of every block), through DCP's own
protocol for checkpointable objects, so DCP writes each piece at its place
and can load it back at any tensor-parallel size (uneven shards and the dense model
included). The shards of a parallel layer's own ``state_dict()`` refuse DCP
with a message that points here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tensorpar.nn._shard import Piece
from tensorpar.nn.conv1d import ColumnParallelConv1D, RowParallelConv1D
from tensorpar.nn.embedding import ParallelEmbedding, VocabParallelEmbedding
from tensorpar.nn.experts import ParallelExperts
from tensorpar.nn.linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ShardAtOffset", "load_sharded_state_dict", "sharded_state_dict"]

ParallelLayer = ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding \
    | ParallelEmbedding | ColumnParallelConv1D | RowParallelConv1D | ParallelExperts
PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                   ParallelEmbedding, ColumnParallelConv1D, RowParallelConv1D, ParallelExperts)


def sharded_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's state dict for ``torch.distributed.checkpoint``, every shard at its offset.

    Keys are the dense model's. Sharded parameters become `ShardAtOffset`s that view this
    rank's shard (no copy), so ``torch.distributed.checkpoint.load`` into this dict writes
    straight into the model; replicated parameters and buffers stay plain tensors (DCP
    writes them once). Every rank of the model's groups must call it, in the same order
    (it exchanges shard metadata).

    Args:
        model: a model parallelised by `parallelize` (or built from tensorpar's layers).

    Returns:
        The state dict to pass to ``torch.distributed.checkpoint.save`` or ``load``.

    Example:
        >>> import torch
        >>> import tensorpar
        >>> model = tensorpar.parallelize(torch.nn.Sequential(torch.nn.Linear(4, 6)),
        ...                               {"0": "colwise"})
        >>> sorted(tensorpar.sharded_state_dict(model))   # one rank: plain tensors
        ['0.bias', '0.weight']
    """
    state: dict[str, Any] = {}
    layers = {n: m for n, m in model.named_modules() if isinstance(m, PARALLEL_LAYERS)}
    for key, value in model.state_dict(keep_vars=True).items():
        owner, _, leaf = key.rpartition(".")
        layer = layers.get(owner)
        dim = layer.sharded_dims.get(leaf) if layer is not None else None
        if layer is None or dim is None or layer.shard.group.is_single:
            state[key] = value.detach()
            continue
        state[key] = _sharded(value.detach(), layer, dim)
    return state


def load_sharded_state_dict(model: nn.Module, state: Mapping[str, Any]) -> None:
    """Copy a state dict filled by ``torch.distributed.checkpoint.load`` into ``model``.

    ``state`` is what `sharded_state_dict` returned for this model (then loaded by DCP,
    possibly from a checkpoint saved at another tensor-parallel size). Since its shards view
    the parameters, DCP has usually written them already; this copies whatever does not
    share storage, so it is always safe to call.

    Args:
        model: the parallelised model.
        state: its sharded state dict, loaded.

    Raises:
        KeyError: ``state`` lacks one of the model's keys.
    """
    own = model.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state]
    if missing:
        raise KeyError(f"load_sharded_state_dict: the state lacks {missing}")
    with torch.no_grad():
        for key, tensor in own.items():
            value = state[key]
            if isinstance(value, ShardAtOffset):
                value = value.local
            if value.data_ptr() != tensor.data_ptr():
                tensor.copy_(value)


def _sharded(local: torch.Tensor, layer: ParallelLayer, dim: int) -> ShardAtOffset:
    full = list(local.shape)
    full[dim] = layer.shard.total
    return ShardAtOffset.of(local, torch.Size(full), dim=dim, pieces=layer.shard.pieces)


class ShardAtOffset(torch.Tensor):
    """This rank's shard of a dense tensor, and where it sits in it, for DCP.

    Implements ``torch.distributed.checkpoint``'s protocol for checkpointable tensors
    (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``, and
    ``size()`` giving the dense shape), the protocol DTensor implements, for shards at any
    offset (DTensor's placements cannot describe tensorpar's balanced uneven shards). The
    shard may be several pieces of the dense tensor along one dim (a packed layer's slice of
    each block): each is one chunk of the checkpoint, written at its own offset. Its data is
    the shard, shared with the parameter, so DCP loads straight into the model. Operations
    on it give plain tensors.

    Attributes:
        global_size: the dense tensor's shape.
        split_dim: the dim the shard is split along.
        pieces: ``(dense start, local start, length)`` along ``dim`` for every piece.
    """

    global_size: torch.Size
    split_dim: int
    pieces: tuple[Piece, ...]
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def of(local: torch.Tensor, global_size: torch.Size, *, dim: int,
           pieces: tuple[Piece, ...]) -> ShardAtOffset:
        """``local`` (shared, not copied) as the given pieces of a tensor of ``global_size``.

        Raises:
            ValueError: the pieces do not tile ``local`` along ``dim``.
        """
        local_starts = sorted((at, n) for _, at, n in pieces)
        expected = 0
        for at, n in local_starts:
            if at != expected:
                break
            expected += n
        if expected != local.shape[dim] or len(local_starts) != len(pieces):
            raise ValueError(f"ShardAtOffset.of: pieces={list(pieces)} do not tile the local "
                             f"shard of shape {tuple(local.shape)} along dim {dim}")
        shard = local.as_subclass(ShardAtOffset)
        shard.global_size, shard.split_dim, shard.pieces = global_size, dim, pieces
        return shard

    @property
    def local(self) -> torch.Tensor:
        """The shard as a plain tensor (a view of the parameter)."""
        return self.as_subclass(torch.Tensor)

    def _offsets(self, piece: Piece) -> torch.Size:
        offsets = [0] * len(self.global_size)
        offsets[self.split_dim] = piece[0]
        return torch.Size(offsets)

    def _view(self, piece: Piece) -> torch.Tensor:
        return self.local.narrow(self.split_dim, piece[1], piece[2])

    def size(self, dim: int | None = None) -> Any:
        """The dense tensor's shape (what DCP compares with the checkpoint's)."""
        return self.global_size if dim is None else self.global_size[dim]

    def __create_write_items__(self, fqn: str, obj: object) -> list[Any]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        items = []
        for piece in self.pieces:
            view, offsets = self._view(piece), self._offsets(piece)
            items.append(WriteItem(
                index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.shape),
                    properties=TensorProperties.create_from_tensor(view),
                    size=self.global_size)))
        return items

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=self._offsets(p), sizes=self._view(p).shape)
                for p in self.pieces]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        if index.offset is None and len(self.pieces) == 1:
            return self._view(self.pieces[0])
        for piece in self.pieces:
            if index.offset is not None and self._offsets(piece) == torch.Size(index.offset):
                return self._view(piece)
        raise ValueError(f"ShardAtOffset: no piece of {index.fqn!r} starts at offset "
                         f"{index.offset}; this rank holds "
                         f"{[tuple(self._offsets(p)) for p in self.pieces]}")

    def __repr__(self) -> str:  # type: ignore[override]
        where = ", ".join(f"{n} at {tuple(self._offsets((s, a, n)))}" for s, a, n in self.pieces)
        return (f"ShardAtOffset({tuple(self.local.shape)}: {where} along dim {self.split_dim} "
                f"of {tuple(self.global_size)})")
