"""Which parameters of a model are sharded, along which dim and over which group.

A tensor-parallel layer (any module with a ``shard`` and a ``sharded_dims`` map, as every
tensorpar layer has) holds a shard of each parameter named in ``sharded_dims``; every other
parameter of a parallelised model is a replica, the same on every rank of the
tensor-parallel group. Clipping, optimizer checkpoints and the drift check all start here.

Parameters also carry a `ParamTag` (set by the layers for their shards and by
`tensorpar.parallelize` for every parameter), so that an optimizer's or a user's list of
parameters can be classified without the model. A module walk is preferred where the model
is at hand: it survives wrappers that replace parameter objects (``fully_shard``).

The module that owns a parameter keeps its tag too (under `TAGS`, by attribute name), so
that `retag` can give the tags back to the parameters a wrapper put in place: FSDP2's
``fully_shard`` replaces every parameter with a new ``DTensor`` parameter (and, while a
module runs, with its unsharded twin). `tensorpar.parallelize` retags at the model's first
forward (FSDP2 is applied by then), and the functions that take the model retag as they go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tensorpar._torch import fsdp_managed_params
from tensorpar.comm._group import Group

__all__ = ["ParamInfo", "ParamTag", "TAG", "TAGS", "parameter_infos", "retag", "sharded_layers",
           "tag_model"]

TAG = "_tensorpar_tag"
"""The attribute a parameter's `ParamTag` is stored under."""
TAGS = "_tensorpar_tags"
"""The attribute of a module holding ``{parameter attribute name: ParamTag}``."""
RETAG_HOOK = "_tensorpar_retag_hook"


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

    Also installs a forward pre-hook that calls `retag` once, at the first forward that is
    not compiled.
    """
    tags: dict[int, ParamTag] = {}
    for info in parameter_infos(model):
        group_of = info.shard.group if info.shard is not None else group
        tags[id(info.param)] = ParamTag(info.name, info.shard, info.dim, group_of)
        setattr(info.param, TAG, tags[id(info.param)])
    for module in model.modules():  # every owner of a tied parameter keeps its tag
        for leaf, p in module._parameters.items():
            if p is not None and id(p) in tags:
                keep_tag(module, leaf, tags[id(p)])
    if RETAG_HOOK not in vars(model):
        vars(model)[RETAG_HOOK] = model.register_forward_pre_hook(_retag_once)


def keep_tag(module: nn.Module, leaf: str, tag: ParamTag) -> None:
    """Record ``tag`` on ``module`` for its parameter ``leaf`` (for `retag`)."""
    vars(module).setdefault(TAGS, {})[leaf] = tag


def retag(model: nn.Module) -> None:
    """Give the parameters that replaced tagged ones their tags back (``fully_shard``'s).

    Under FSDP2 the tags go on the sharded ``DTensor`` parameters, the ones an optimizer
    holds, even while a module holds its unsharded twin (in a forward). No communication.
    """
    managed: set[tuple[int, str]] = set()
    for module in model.modules():
        for param, owner, leaf in _fsdp_params(module):
            tag = vars(owner).get(TAGS, {}).get(leaf)
            if tag is not None and getattr(param, TAG, None) is not tag:
                setattr(param, TAG, tag)
            managed.add((id(owner), leaf))
    for module in model.modules():
        for leaf, tag in vars(module).get(TAGS, {}).items():
            p = module._parameters.get(leaf)
            if p is not None and (id(module), leaf) not in managed \
                    and getattr(p, TAG, None) is not tag:
                setattr(p, TAG, tag)


def _retag_once(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return
    retag(module)
    handle = vars(module).pop(RETAG_HOOK, None)
    if handle is not None:
        handle.remove()


def _fsdp_params(module: nn.Module) -> list[tuple[torch.Tensor, nn.Module, str]]:
    """``(sharded parameter, owner, attribute name)`` of every parameter FSDP2 manages here."""
    return fsdp_managed_params(module)


def tag_of(param: torch.Tensor) -> ParamTag | None:
    """The parameter's `ParamTag`, if it has one."""
    tag = getattr(param, TAG, None)
    return tag if isinstance(tag, ParamTag) else None
