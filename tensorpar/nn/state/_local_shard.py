"""The form a parallel layer's ``state_dict()`` gives its shards: tensors that refuse DCP.

Saved with ``torch.distributed.checkpoint`` as plain tensors under the dense names, the
shards of every rank would be taken for replicas of one tensor and one rank's kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import torch
from torch import nn

from tensorpar._torch import register_state_dict_post_hook
from tensorpar.nn.state._params import TAG, ParamTag, keep_tag

__all__ = ["LocalShard", "mark_shards"]


class LocalShard(torch.Tensor):
    """This rank's shard of a parameter, as a parallel layer's ``state_dict()`` returns it.

    It is an ordinary tensor for everything (``torch.save``, ``load_state_dict``,
    arithmetic) except ``torch.distributed.checkpoint``: DCP would take the shards of every
    rank for replicas of one tensor and keep one of them, so it raises instead, pointing to
    `tensorpar.sharded_state_dict`.
    """

    def __create_write_items__(self, fqn: str, obj: object) -> NoReturn:
        raise _refusal(fqn, "save")

    def __create_chunk_list__(self) -> NoReturn:
        raise _refusal("a tensorpar shard", "load")


def _refusal(fqn: str, verb: str) -> ValueError:
    return ValueError(
        f"torch.distributed.checkpoint cannot {verb} {fqn!r} from a state_dict(): it is "
        f"this rank's shard of a tensor-parallel parameter, and DCP would take every rank's "
        f"shard for the same tensor. Use tensorpar.sharded_state_dict(model), which gives each "
        f"shard its global offset (and tensorpar.load_sharded_state_dict after loading); for "
        f"an optimizer's state, tensorpar.sharded_optimizer_state_dict(model, optimizer)")


def _fsdp_refusal(key: str) -> str:
    return (f"state_dict: {key!r} is this rank's tensor-parallel shard, sliced again by "
            f"fully_shard: as a DTensor it would claim to be the whole tensor and every "
            f"tensor-parallel rank's shard would be saved under the same offsets. Use "
            f"tensorpar.sharded_state_dict(model) (torch.distributed.checkpoint) or "
            f"tensorpar.full_state_dict(model) (the dense tensors); "
            f"model.state_dict(keep_vars=True) still gives the parameters")


def mark_shards(layer: nn.Module, leaves: Iterable[str]) -> None:
    """Make ``layer.state_dict()`` return its sharded parameters as `LocalShard` views."""
    dims = tuple(leaves)
    shard = getattr(layer, "shard", None)
    if isinstance(leaves, Mapping) and shard is not None:  # for lists of parameters (clipping)
        for leaf, dim in leaves.items():
            p = layer._parameters.get(leaf)
            if p is not None:
                setattr(p, TAG, ParamTag(None, shard, dim, shard.group))
                keep_tag(layer, leaf, getattr(p, TAG))

    def hook(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        for leaf in dims:
            key = prefix + leaf
            value = state.get(key)
            if isinstance(value, nn.Parameter):  # keep_vars=True: the parameters themselves
                continue
            if hasattr(value, "device_mesh"):  # fully_shard made the shard a DTensor
                raise ValueError(_fsdp_refusal(key))
            if isinstance(value, torch.Tensor) and not isinstance(value, LocalShard):
                state[key] = value.as_subclass(LocalShard)

    register_state_dict_post_hook(layer, hook)
