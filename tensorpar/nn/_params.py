"""Which parameters of a model are sharded, along which dim and over which group.

A tensor-parallel layer (any module with a ``shard`` and a ``sharded_dims`` map, as every
tensorpar layer has) holds a shard of each parameter named in ``sharded_dims``; every other
parameter of a parallelised model is a replica, the same on every rank of the
tensor-parallel group. Clipping, optimizer checkpoints and the drift check all start here.

Parameters also carry a `ParamTag` (set by the layers for their shards and by
`tensorpar.parallelize` for every parameter), so that an optimizer's or a user's list of
parameters can be classified without the model. A module walk is preferred where the model
is at hand: it survives wrappers that replace parameter objects (``fully_shard``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tensorpar._group import Group

__all__ = ["ParamInfo", "ParamTag", "TAG", "parameter_infos", "sharded_layers", "tag_model"]

TAG = "_tensorpar_tag"
"""The attribute a parameter's `ParamTag` is stored under."""


@dataclass(frozen=True)
class ParamTag:
    """What a parameter is in a tensor-parallel model.

    Attributes:
        name: its name in the model (``None``: tagged by a layer, name unknown).
        shard: the layer's shard (``None``: a replica).
        dim: the dim the shard is split along (``None``: a replica).
        group: the tensor-parallel group the parameter is sharded or replicated over.
    """

    name: str | None
    shard: Any
    dim: int | None
    group: Group

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # a pickled parameter (torch.save, another process) drops the tag: its group is local
        return _untagged, ()


def _untagged() -> None:
    return None


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of a model: its (first) name, itself, and its shard if any."""

    name: str
    param: torch.Tensor
    shard: Any = None
    dim: int | None = None

    @property
    def sharded(self) -> bool:
        """True when the parameter is a shard over a group of more than one rank."""
        return self.shard is not None and not self.shard.group.is_single


def sharded_layers(model: nn.Module) -> dict[str, Any]:
    """Every submodule that holds shards: a ``shard`` and a ``sharded_dims`` dict."""
    return {n: m for n, m in model.named_modules()
            if isinstance(getattr(m, "sharded_dims", None), dict) and hasattr(m, "shard")}


def parameter_infos(model: nn.Module) -> list[ParamInfo]:
    """Every parameter of ``model`` once (``named_parameters`` order), with its shard."""
    owners: dict[int, tuple[Any, int]] = {}
    for layer in sharded_layers(model).values():
        for leaf, dim in layer.sharded_dims.items():
            p = layer._parameters.get(leaf)
            if p is not None:
                owners[id(p)] = (layer.shard, dim)
    out = []
    for name, p in model.named_parameters():
        shard, dim = owners.get(id(p), (None, None))
        out.append(ParamInfo(name, p, shard, dim))
    return out


def tag_model(model: nn.Module, group: Group) -> None:
    """Tag every parameter of ``model`` with its name, shard and ``group`` (`ParamTag`).

    Also installs the optimizer step hook that checks the replicas (validation mode).
    """
    from tensorpar.nn.replica_check import install

    install()
    for info in parameter_infos(model):
        group_of = info.shard.group if info.shard is not None else group
        setattr(info.param, TAG, ParamTag(info.name, info.shard, info.dim, group_of))


def tag_of(param: torch.Tensor) -> ParamTag | None:
    """The parameter's `ParamTag`, if it has one."""
    tag = getattr(param, TAG, None)
    return tag if isinstance(tag, ParamTag) else None
