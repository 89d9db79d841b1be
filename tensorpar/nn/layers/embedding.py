"""Embeddings split across a group: by vocabulary rows or by embedding dimension."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.collectives.functional import gather, scatter
from tensorpar.collectives.regions import enter_region, gather_from_group, reduce_from_group
from tensorpar.comm._group import GroupLike
from tensorpar.nn.layers._path import validating
from tensorpar.nn.layers.random import rng_kept
from tensorpar.nn.sequence import SequenceShards
from tensorpar.nn.state._shards import Shard, keep_frozen, shard_of
from tensorpar.nn.state.replica_check import mark_sharded_layer
from tensorpar.placeholder import TensorPlaceholder

__all__ = ["ParallelEmbedding", "VocabParallelEmbedding"]


class _ShardedEmbedding(nn.Module):
    """Shared parts: a sharded ``weight``, dense conversion and full-state gather/scatter."""

    shard_dim: ClassVar[int]
    sharded_dims: ClassVar[dict[str, int]]
    weight: nn.Parameter
    shard: Shard
    embed_scale: torch.Tensor | None

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: int | None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"{type(self).__name__}: padding_idx={padding_idx} is out of range "
                             f"for num_embeddings={num_embeddings}")
        self.padding_idx = None if padding_idx is None else padding_idx % num_embeddings
        # a dense embedding that scales its output (e.g. Gemma's by sqrt(hidden)) keeps it
        self.register_buffer("embed_scale", None, persistent=False)

    def _checked(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``; in validation mode compared across the group first (they must agree)."""
        if not validating() or self.shard.group.is_single:
            return ids
        return enter_region(ids, self.shard.group, f"the token ids of {type(self).__name__}")

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.embed_scale is None else out * self.embed_scale.to(out.dtype)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, *, group: GroupLike = None
                   ) -> _ShardedEmbedding:
        """This rank's shard of ``embedding`` (every rank passes the same dense layer).

        An embedding subclass that multiplies its output by an ``embed_scale`` tensor
        (transformers' scaled word embeddings) keeps that scale.
        """
        with rng_kept(embedding.weight.device):
            layer = cls(embedding.num_embeddings,  # type: ignore[call-arg]
                        embedding.embedding_dim, embedding.padding_idx, group=group,
                        device=embedding.weight.device, dtype=embedding.weight.dtype)
        s = layer.shard
        with torch.no_grad():
            layer.weight.copy_(embedding.weight.narrow(layer.shard_dim, s.start, s.length))
        scale = getattr(embedding, "embed_scale", None)
        if isinstance(scale, torch.Tensor):
            layer.embed_scale = scale.detach().clone()
        keep_frozen(layer, embedding)
        return layer

    def full_state(self, dst: int = 0) -> dict[str, torch.Tensor | TensorPlaceholder]:
        """The dense weight, gathered on ``dst`` (a placeholder elsewhere)."""
        return {"weight": gather(self.weight.detach(), dim=self.shard_dim, dst=dst,
                                 group=self.shard.group, sizes=self.shard.sizes)}

    def load_full_state(self, state: Mapping[str, Any], src: int = 0) -> None:
        """Load the dense weight held on ``src`` (``None``/placeholder elsewhere)."""
        with torch.no_grad():
            self.weight.copy_(scatter(state.get("weight"), dim=self.shard_dim, src=src,
                                      group=self.shard.group, sizes=self.shard.sizes))

    def to_dense(self, dst: int = 0) -> nn.Embedding | dict[str, TensorPlaceholder]:
        """The dense ``nn.Embedding`` on ``dst``; a placeholder of its weight elsewhere."""
        weight = self.full_state(dst)["weight"]
        if isinstance(weight, TensorPlaceholder):
            return {"weight": weight}
        dense: nn.Embedding = nn.Embedding.from_pretrained(weight.clone(), freeze=False,
                                                           padding_idx=self.padding_idx)
        return dense

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (this rank: "
                f"{tuple(self.weight.shape)}), padding_idx={self.padding_idx}")


class VocabParallelEmbedding(_ShardedEmbedding):
    """An embedding whose vocabulary rows are split across ``group``.

    Each rank looks up the ids that fall in its rows (zeros for the others); the results
    are summed across the group, so every rank gets the full embedding.

    Shape:
        input: ids of any shape; output ``(*, embedding_dim)``.

    Example:
        >>> import torch
        >>> from tensorpar.nn import VocabParallelEmbedding
        >>> dense = torch.nn.Embedding(10, 3)
        >>> embed = VocabParallelEmbedding.from_dense(dense)
        >>> ids = torch.tensor([[1, 9], [0, 4]])
        >>> embed(ids).shape
        torch.Size([2, 2, 3])
        >>> torch.equal(embed(ids), dense(ids))
        True
    """

    shard_dim = 0
    sharded_dims: ClassVar[dict[str, int]] = {"weight": 0}

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: int | None = None, *, group: GroupLike = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.shard = shard_of("VocabParallelEmbedding", num_embeddings, group)
        self.weight = nn.Parameter(torch.empty(self.shard.length, embedding_dim, device=device,
                                               dtype=dtype))
        with torch.no_grad():
            self.weight.normal_()
            if self.padding_idx is not None and self.shard.start <= self.padding_idx \
                    < self.shard.stop:
                self.weight[self.padding_idx - self.shard.start].zero_()
        self.sequence: SequenceShards | None = None
        """Set (by `tensorpar.parallelize`) for ``Vocab(sequence_parallel=True)``: the output
        is reduce-scattered along the sequence instead of all-reduced."""
        if not self.shard.group.is_single:
            mark_sharded_layer(self, self.sharded_dims)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embed ``ids``: this rank's rows, zeros elsewhere, summed across the group."""
        s = self.shard
        ids = self._checked(ids)
        outside = (ids < s.start) | (ids >= s.stop)
        local = (ids - s.start).masked_fill(outside, 0)
        pad = None
        if self.padding_idx is not None and s.start <= self.padding_idx < s.stop:
            pad = self.padding_idx - s.start
        out = F.embedding(local, self.weight, padding_idx=pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence is not None:  # the sum lands sliced along the sequence
            return self._scaled(self.sequence.split_sum(out))
        return self._scaled(reduce_from_group(out, group=s.group))


class ParallelEmbedding(_ShardedEmbedding):
    """An embedding whose embedding dimension is split across ``group``.

    Each rank looks up its slice of every vector; the slices are all-gathered, so every
    rank gets the full embedding.

    Shape:
        input: ids of any shape; output ``(*, embedding_dim)``.

    Example:
        >>> import torch
        >>> from tensorpar.nn import ParallelEmbedding
        >>> embed = ParallelEmbedding(10, 4, padding_idx=0)
        >>> embed(torch.tensor([0, 3])).shape
        torch.Size([2, 4])
        >>> embed.weight[0].abs().sum().item()  # the padding row starts at zero
        0.0
    """

    shard_dim = 1
    sharded_dims: ClassVar[dict[str, int]] = {"weight": 1}

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: int | None = None, *, group: GroupLike = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.shard = shard_of("ParallelEmbedding", embedding_dim, group)
        self.weight = nn.Parameter(torch.empty(num_embeddings, self.shard.length, device=device,
                                               dtype=dtype))
        with torch.no_grad():
            self.weight.normal_()
            if self.padding_idx is not None:
                self.weight[self.padding_idx].zero_()
        if not self.shard.group.is_single:
            mark_sharded_layer(self, self.sharded_dims)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embed ``ids``: this rank's slice of every vector, all-gathered."""
        out = F.embedding(self._checked(ids), self.weight, padding_idx=self.padding_idx)
        return self._scaled(gather_from_group(out, dim=-1, group=self.shard.group,
                                              sizes=self.shard.sizes))
