"""Styles that keep the module and its weights as they are and change only the backward.

`PartialGrad` sums the gradients of a module's own parameters over the group (per-head norms);
`MlaKvAProj` sums the gradient of the part of a multi-head latent attention's compressed
key/value projection that goes straight to every head (DeepSeek-V2/V3). Neither replaces the
module: `install` adds hooks once the whole plan has been checked and built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tensorpar.collectives.regions import copy_to_group
from tensorpar.comm._group import GroupLike, resolve_group
from tensorpar.nn.state.partial_grad import install_partial_grad

__all__ = ["MlaKvAProj", "PartialGrad", "check_inplace", "install"]


@dataclass(frozen=True)
class PartialGrad:
    """Keep a module's own parameters whole on every rank and sum their gradients.

    For parameters that see only the rank's part of the data, so that each rank's gradient
    is a partial sum: per-head norms between a column- and a row-parallel layer (Qwen3's
    ``q_norm``/``k_norm``; transformers calls the style ``replicated_with_grad_allreduce``)
    and the norms of a sequence-parallel model. The module is not replaced; its direct
    parameters get their gradient all-reduced over the group once per backward pass (see
    `tensorpar.nn.state.partial_grad`).
    """


@dataclass(frozen=True)
class MlaKvAProj:
    """The compressed key/value projection of multi-head latent attention (DeepSeek-V2/V3).

    The projection stays replicated. Its output is ``[kv_latent; k_rope]``: the latent goes
    through a norm into the column-parallel ``kv_b_proj`` (whose input gradient is summed
    over the group already), but ``k_rope``, one rotary key shared by every head, goes
    straight into the rank's heads, so its gradient is partial. This style sums the
    gradient of the last ``rope_dim`` output features over the group (`copy_to_group` on
    that slice), as transformers' ``mla_kv_a_proj`` does.

    Attributes:
        rope_dim: the width of the rotary part (``config.qk_rope_head_dim``).
    """

    rope_dim: int


INPLACE_STYLES = (PartialGrad, MlaKvAProj)


def check_inplace(name: str, module: nn.Module, style: PartialGrad | MlaKvAProj) -> str | None:
    """What keeps ``style`` from applying to ``module`` (``None``: it applies)."""
    if isinstance(style, PartialGrad):
        if not any(True for _ in module.parameters(recurse=False)):
            return (f"{name!r} is a {type(module).__name__} with no parameters of its own; "
                    f"style PartialGrad sums the gradients of a module's own parameters")
        return None
    width = getattr(module, "out_features", None)
    if type(module) is not nn.Linear or not isinstance(width, int):
        return (f"{name!r} is a {type(module).__name__}; style MlaKvAProj takes the nn.Linear "
                f"that makes [kv_latent; k_rope]")
    if not 0 < style.rope_dim <= width:
        return (f"{name!r}: MlaKvAProj(rope_dim={style.rope_dim}) does not fit out_features="
                f"{width}; expected 0 < rope_dim <= {width}")
    return None


def install(module: nn.Module, style: PartialGrad | MlaKvAProj, group: GroupLike) -> None:
    """Add ``style``'s hooks to ``module`` (checked beforehand with `check_inplace`)."""
    if isinstance(style, PartialGrad):
        install_partial_grad(module, group)
        return
    g = resolve_group(group, "parallelize")
    if g.is_single:
        return
    rope = style.rope_dim

    def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        latent, k_rope = out.split([out.shape[-1] - rope, rope], dim=-1)
        return torch.cat([latent, copy_to_group(k_rope, group=g)], dim=-1)

    module.register_forward_hook(hook)
