"""After every optimizer step: replicas that drifted apart, and shards DCP would lose.

One global optimizer step post-hook (torch's ``register_optimizer_step_post_hook``),
installed once per process by `install_step_hook`, which the sharded layers' constructors
and `tensorpar.parallelize` call, does two things:

- at an optimizer's first step it registers a ``state_dict`` post-hook on it, which gives
  the state tensors of sharded parameters the `LocalShard` form (for a ``DTensor`` state,
  under ``fully_shard``, its local tensor): ``optimizer.state_dict()`` stays an ordinary
  state dict (``torch.save`` and ``load_state_dict`` work) and the optimizer's own state is
  left as it is, but ``torch.distributed.checkpoint`` refuses it (it would keep one rank's
  shard) and points to `tensorpar.sharded_optimizer_state_dict`;
- in validation mode, it compares the replicated parameters (every parameter of a
  parallelised model that no layer shards) across their tensor-parallel group with an exact
  fingerprint, and raises on every rank naming the first that differs: a per-rank gradient
  norm (``torch.nn.utils.clip_grad_norm_``) or a replicated parameter left with a partial
  gradient makes them drift from the first step.

Parameters are recognised by their `ParamTag` (set by `tensorpar.parallelize` and by the
layers). Under ``fully_shard`` the parameters are new ``DTensor`` objects: `retag` gives them
their tags back (at the model's first forward), and a replica is compared by its local
FSDP slice, which is the same slice of the same tensor on every rank of its
tensor-parallel group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer

from tensorpar._torch import global_optimizer_post_hooks
from tensorpar.collectives.functional import all_gather
from tensorpar.errors import CollectiveArgumentError
from tensorpar.nn.state._local_shard import LocalShard, mark_shards
from tensorpar.nn.state._params import ParamTag, tag_of
from tensorpar.nn.state.checkpoint import local_of
from tensorpar.validation import validation_enabled

__all__ = ["check_replicas", "install_step_hook", "mark_sharded_layer"]

GUARDED = "_tensorpar_guarded"
CHUNK = 1 << 20  # elements hashed at a time: bounded extra memory


def install_step_hook() -> None:
    """Register the step post-hook with torch once per process (idempotent)."""
    if any(hook is _after_step for hook in global_optimizer_post_hooks()):
        return
    torch_optimizer.register_optimizer_step_post_hook(_after_step)


def mark_sharded_layer(layer: torch.nn.Module, leaves: Iterable[str]) -> None:
    """What a sharded layer's constructor does: `mark_shards` and `install_step_hook`.

    ``leaves``: the sharded parameters' names (with their dims, as `mark_shards` takes).
    """
    install_step_hook()  # the shards' optimizer state: refused by DCP
    mark_shards(layer, leaves)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not getattr(optimizer, GUARDED, False):
        setattr(optimizer, GUARDED, True)  # the hook looks at the tags when it runs
        optimizer.register_state_dict_post_hook(_mark_state_shards)
    if validation_enabled():
        check_replicas(optimizer)


def _is_shard(tag: ParamTag | None) -> bool:
    return tag is not None and tag.shard is not None and not tag.group.is_single


def _mark_state_shards(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    packed = state.get("state", {})
    for index, entry in list(packed.items()):
        if isinstance(index, int) and index < len(params) and _is_shard(tag_of(params[index])):
            # a new entry: ``entry`` is the optimizer's own state of the parameter
            packed[index] = {key: _refusing(value) for key, value in entry.items()}
    return state


def _refusing(value: Any) -> Any:
    """``value`` (shared, not copied) in a form DCP refuses; scalars as they are."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    mesh = getattr(value, "device_mesh", None)
    if mesh is None:
        return value if isinstance(value, LocalShard) else value.detach().as_subclass(LocalShard)
    from torch.distributed.tensor import DTensor

    local = local_of(value).detach()
    return DTensor.from_local(local if isinstance(local, LocalShard) else
                              local.as_subclass(LocalShard), mesh,
                              value.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=value.shape, stride=value.stride())


def check_replicas(optimizer: torch.optim.Optimizer) -> None:
    """Raise on every rank if a replicated parameter differs across its group.

    Args:
        optimizer: an optimizer; its parameters tagged as replicas of a tensor-parallel
            model are checked, one all-gather of a fingerprint per parameter and group.

    Raises:
        CollectiveArgumentError: a replicated parameter differs across the ranks of its
            group (names it, with the ranks that agree).
    """
    by_group: list[tuple[Any, list[tuple[str, torch.Tensor]]]] = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            tag = tag_of(p)
            if tag is None or tag.shard is not None or tag.group.is_single:
                continue
            for group, members in by_group:
                if group == tag.group:
                    members.append((tag.name or "?", p))
                    break
            else:
                by_group.append((tag.group, [(tag.name or "?", p)]))
    for group, members in by_group:
        mine = torch.stack([_fingerprint(local_of(p)) for _, p in members])
        device = group.comm_device(members[0][1].device)
        every = all_gather(mine.to(device).unsqueeze(0), dim=0, group=group).cpu()
        for k, (name, _) in enumerate(members):
            column = every[:, k].tolist()
            if len(set(column)) > 1:
                holders = {v: [r for r, w in enumerate(column) if w == v] for v in column}
                versions = "; ".join(f"ranks {ranks}" for ranks in holders.values())
                raise CollectiveArgumentError(
                    f"optimizer.step: the replicated parameter {name!r} differs across its "
                    f"tensor-parallel group after the step ({len(holders)} versions: "
                    f"{versions} agree). Replicas drift when each rank scales or updates "
                    f"them differently: torch.nn.utils.clip_grad_norm_ computes a per-rank "
                    f"norm on a tensor-parallel model; use tensorpar.nn.clip_grad_norm_(model, "
                    f"max_norm), which uses the dense model's norm on every rank")


def _fingerprint(p: torch.Tensor) -> torch.Tensor:
    """An exact checksum of the bits of ``p`` (int64; wraps, the same on every rank)."""
    flat = p.detach().reshape(-1)
    if flat.dtype.is_floating_point or flat.dtype.is_complex:
        width = flat.element_size()
        flat = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                          8: torch.int64}[width]) if not flat.dtype.is_complex \
            else torch.view_as_real(flat).reshape(-1).view(torch.int64 if width == 16
                                                            else torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    weights = None
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start: start + CHUNK].to(torch.int64)
        if weights is None or weights.numel() != part.numel():
            weights = torch.arange(1, part.numel() + 1, dtype=torch.int64, device=flat.device)
        total += (part * weights).sum()  # position-weighted: a swap changes it too
    return total
