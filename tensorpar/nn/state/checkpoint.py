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

from tensorpar._torch import DISABLED_TORCH_FUNCTION, local_offsets
from tensorpar.collectives.functional import broadcast
from tensorpar.comm._group import Group
from tensorpar.ddp.reducer import settle_buffers
from tensorpar.nn.state._params import retag, sharded_layers
from tensorpar.nn.state._shards import Piece, gather_shards, scatter_shards
from tensorpar.placeholder import TensorPlaceholder

__all__ = ["ShardAtOffset", "load_sharded_state_dict", "sharded_state_dict"]

Chunk = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""``(offsets in the local shard, offsets in the dense tensor, sizes)`` of one chunk."""


def sharded_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's state dict for ``torch.distributed.checkpoint``, every shard at its offset.

    Keys are the dense model's. Sharded parameters become `ShardAtOffset`s that view this
    rank's shard (no copy), so ``torch.distributed.checkpoint.load`` into this dict writes
    straight into the model; replicated parameters and buffers stay plain tensors (DCP
    writes them once). Under ``fully_shard`` (FSDP2 beside tensor parallelism) a replica
    stays the ``DTensor`` it is, and a shard's FSDP slice becomes a `ShardAtOffset` of the
    pieces it holds, at their dense offsets. Every offset comes from the layers' own sizes.
    Under a data-parallel reducer (the DDP wrapper, `BucketedAllReduce`) whose next
    training forward would broadcast the buffers, they are broadcast from rank 0 now (one
    collective over its group): the replicas' BatchNorm statistics differ until then, and
    DCP writes each replicated key from a rank of its choosing. Call it on every rank, as
    DCP's ``save`` and ``load``.

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
    retag(model)  # under fully_shard: optimizer.state_dict() of this model refuses DCP
    settle_buffers(model)
    state: dict[str, Any] = {}
    layers = sharded_layers(model)
    for key, value in model.state_dict(keep_vars=True).items():
        owner, _, leaf = key.rpartition(".")
        layer = layers.get(owner)
        dim = layer.sharded_dims.get(leaf) if layer is not None else None
        shard = layer.shard if layer is not None and dim is not None else None
        state[key] = dcp_value(value.detach(), shard, dim)
    return state


def dense_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """The shape each tensor of ``model``'s state dict has in the dense model."""
    layers = sharded_layers(model)
    shapes = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue
        owner, _, leaf = key.rpartition(".")
        layer = layers.get(owner)
        dim = layer.sharded_dims.get(leaf) if layer is not None else None
        shape = list(value.shape)
        if layer is not None and dim is not None and not layer.shard.group.is_single:
            shape[dim] = layer.shard.total
        shapes[key] = torch.Size(shape)
    return shapes


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
            copy_into(tensor, state[key])


def fsdp_full_state_dict(model: nn.Module, dst: int, group: Group
                         ) -> dict[str, torch.Tensor | TensorPlaceholder]:
    """`tensorpar.full_state_dict` of a model with ``fully_shard`` beside tensor parallelism.

    Every ``DTensor`` is all-gathered over its mesh first (the tensor-parallel shard or the
    replica), then the shards are gathered over their group on ``dst``, in state-dict order
    on every rank.
    """
    layers = sharded_layers(model)
    out: dict[str, torch.Tensor | TensorPlaceholder] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        owner, _, leaf = key.rpartition(".")
        layer = layers.get(owner)
        dim = layer.sharded_dims.get(leaf) if layer is not None else None
        local = value.detach()
        full_tensor = getattr(local, "full_tensor", None)
        if callable(full_tensor):
            local = full_tensor()
        if layer is not None and dim is not None and not layer.shard.group.is_single:
            out[key] = gather_shards(local, layer.shard, dim, dst)
        else:
            out[key] = local.clone() if group.rank == dst else \
                TensorPlaceholder.like(local, owner=dst, group=group.handle)
    return out


def fsdp_load_full_state_dict(model: nn.Module, state: Mapping[str, Any], src: int,
                              group: Group) -> None:
    """`tensorpar.load_full_state_dict` into a model with ``fully_shard`` beside TP.

    In state-dict order on every rank, a tensor-parallel shard is scattered over its group
    from ``src`` and anything else is broadcast over ``group``; each rank then copies the
    FSDP slice its ``DTensor`` holds (the whole tensor for a plain buffer).
    """
    layers = sharded_layers(model)
    with torch.no_grad():
        for key, value in model.state_dict(keep_vars=True).items():
            owner, _, leaf = key.rpartition(".")
            layer = layers.get(owner)
            dim = layer.sharded_dims.get(leaf) if layer is not None else None
            if layer is not None and dim is not None and not layer.shard.group.is_single:
                whole = scatter_shards(state.get(key), layer.shard, dim, src)
            else:
                whole = broadcast(state.get(key), src=src, group=group)
            local, offsets = _slice_of(value)
            for d, (at, n) in enumerate(zip(offsets, local.shape, strict=True)):
                whole = whole.narrow(d, at, n)
            local.copy_(whole)


def copy_into(tensor: torch.Tensor, value: Any) -> None:
    """Copy a loaded value into ``tensor`` unless it already shares its storage."""
    target, source = local_of(tensor), local_of(value)
    if source.data_ptr() != target.data_ptr():
        target.copy_(source)


def local_of(value: Any) -> torch.Tensor:
    """The plain tensor under a `ShardAtOffset` or a ``DTensor`` (``value`` otherwise)."""
    if isinstance(value, ShardAtOffset):
        return value.local
    to_local = getattr(value, "to_local", None)
    out: torch.Tensor = to_local() if callable(to_local) else value
    return out


def dcp_value(value: torch.Tensor, shard: Any, dim: int | None) -> Any:
    """``value`` (a parameter or a tensor of its shape) as DCP must see it.

    A replica stays as it is (a plain tensor, or the ``DTensor`` ``fully_shard`` made of
    it); a tensor-parallel shard becomes a `ShardAtOffset`, and so does a ``DTensor``
    slice of one (FSDP beside tensor parallelism): its chunks are the pieces of the
    tensor-parallel shard that the slice holds, at their dense offsets.
    """
    if shard is None or dim is None or shard.group.is_single:
        return value
    local, offsets = _slice_of(value)
    full = list(value.shape)
    full[dim] = shard.total
    chunks = []
    for start, at, n in shard.pieces:
        lo, hi = max(at, offsets[dim]), min(at + n, offsets[dim] + local.shape[dim])
        if hi <= lo or 0 in local.shape:
            continue
        local_off, dense_off, sizes = [0] * local.dim(), list(offsets), list(local.shape)
        local_off[dim], dense_off[dim], sizes[dim] = lo - offsets[dim], start + lo - at, hi - lo
        chunks.append((tuple(local_off), tuple(dense_off), tuple(sizes)))
    return ShardAtOffset.of_chunks(local, torch.Size(full), tuple(chunks))


def _slice_of(value: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The plain local tensor and its offsets in the tensor-parallel shard."""
    mesh = getattr(value, "device_mesh", None)
    if mesh is None:
        return value.detach(), [0] * value.dim()
    return value.to_local().detach(), local_offsets(value)  # type: ignore[attr-defined]


class ShardAtOffset(torch.Tensor):
    """This rank's shard of a dense tensor, and where it sits in it, for DCP.

    Implements ``torch.distributed.checkpoint``'s protocol for checkpointable tensors
    (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``, and
    ``size()`` giving the dense shape), the protocol DTensor implements, for shards at any
    offset (DTensor's placements cannot describe tensorpar's balanced uneven shards). The
    shard may be several chunks of the dense tensor (a packed layer's slice of each block,
    or an FSDP slice of them): each is one chunk of the checkpoint, written at its own
    offset. Its data is the shard, shared with the parameter, so DCP loads straight into
    the model. Operations on it give plain tensors.

    Attributes:
        global_size: the dense tensor's shape.
        chunks: ``(local offsets, dense offsets, sizes)`` of every chunk.
    """

    global_size: torch.Size
    chunks: tuple[Chunk, ...]
    __torch_function__ = DISABLED_TORCH_FUNCTION

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
        chunks = []
        for start, at, n in pieces:
            local_off, dense_off, sizes = [0] * local.dim(), [0] * local.dim(), list(local.shape)
            local_off[dim], dense_off[dim], sizes[dim] = at, start, n
            chunks.append((tuple(local_off), tuple(dense_off), tuple(sizes)))
        return ShardAtOffset.of_chunks(local, global_size, tuple(chunks))

    @staticmethod
    def of_chunks(local: torch.Tensor, global_size: torch.Size,
                  chunks: tuple[Chunk, ...]) -> ShardAtOffset:
        """``local`` (shared) as ``chunks``: ``(local offsets, dense offsets, sizes)`` each."""
        shard = local.as_subclass(ShardAtOffset)
        shard.global_size, shard.chunks = torch.Size(global_size), chunks
        return shard

    @property
    def local(self) -> torch.Tensor:
        """The shard as a plain tensor (a view of the parameter)."""
        return self.as_subclass(torch.Tensor)

    def _view(self, chunk: Chunk) -> torch.Tensor:
        view = self.local
        for d, (at, n) in enumerate(zip(chunk[0], chunk[2], strict=True)):
            if at != 0 or n != view.shape[d]:
                view = view.narrow(d, at, n)
        return view

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
        for chunk in self.chunks:
            view, offsets = self._view(chunk), torch.Size(chunk[1])
            items.append(WriteItem(
                index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.shape),
                    properties=TensorProperties.create_from_tensor(view),
                    size=self.global_size)))
        return items

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(c[1]), sizes=torch.Size(c[2]))
                for c in self.chunks]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        if index.offset is None and len(self.chunks) == 1:
            return self._view(self.chunks[0])
        for chunk in self.chunks:
            if index.offset is not None and torch.Size(chunk[1]) == torch.Size(index.offset):
                return self._view(chunk)
        raise ValueError(f"ShardAtOffset: no chunk of {index.fqn!r} starts at offset "
                         f"{index.offset}; this rank holds {[c[1] for c in self.chunks]}")

    def __repr__(self) -> str:  # type: ignore[override]
        where = ", ".join(f"{c[2]} at {c[1]}" for c in self.chunks)
        return f"ShardAtOffset({tuple(self.local.shape)}: {where} of {tuple(self.global_size)})"
