"""FSDP2 beside domain parallelism: parameters sharded over the replicas.

torch's ``fully_shard`` on a 2-D mesh (hybrid sharding) reduce-scatters each gradient over
the mesh's second dim and all-reduces it over the first. With the domain as the first dim
and the replicas as the second, that one reduction is exactly what a domain-parallel model
needs: the tiles' partial gradients summed, the replicas' averaged (the divide factor is
set to the number of replicas, not the mesh's size). ``fully_shard`` replaces the
parameters, so the domain's own end-of-backward sum never runs beside it. Tiles (several
split dims) use a mesh with one dim per split dim before the replicas' dim: its domain dims
are flattened into one for the hybrid sharding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from tensorpar._torch import is_fsdp_module
from tensorpar.domain.parallelize import domain_context

__all__ = ["fully_shard_domain"]


def fully_shard_domain(model: nn.Module, *, mesh: Any, blocks: Sequence[nn.Module] = (),
                       **fsdp_kwargs: Any) -> nn.Module:
    """``fully_shard`` a domain-parallel model over the replica dim of a mesh.

    Args:
        model: a model converted by `parallelize_domain` with ``group=`` the mesh's domain
            dims (``mesh["domain"]`` for strips; ``mesh["h", "w"]`` for tiles), not yet
            under ``fully_shard`` (nor any of its submodules).
        mesh: a ``DeviceMesh`` whose last dim is the replicas (each replica its own batch;
            the parameters are sharded over them) and whose other dims are the domain's,
            one per split dim of the model, in the same order.
        blocks: submodules to shard each on its own first (as ``fully_shard`` on each
            transformer block: their parameters gathered one block at a time), with the
            same mesh and gradient divisor as the model; the model shards the rest.
        **fsdp_kwargs: passed to ``torch.distributed.fsdp.fully_shard`` (``reshard_after_forward``,
            ``mp_policy``, ...).

    Returns:
        The model, now also an ``FSDPModule``. After ``backward()`` each parameter's
        (sharded) gradient is the dense gradient averaged over the replicas.

    Raises:
        ValueError: the model is not domain-parallel, the mesh does not have one dim per
            split dim plus the replicas', the model's domain groups are not the mesh's
            domain dims, (tiles) the mesh does not cover every rank, a block is not a
            submodule of the model, or the model or a submodule is already under
            ``fully_shard`` (sharded on its own, its gradients would be divided by every
            rank of the mesh, or never summed over the tiles: pass it in ``blocks``).

    A parameter used after a global pooling (on replicated features) gets its whole
    gradient on every tile; each such use gives a share (its gradient divided by the number
    of tiles), so FSDP2's sum over the domain counts it once.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    fn = "fully_shard_domain"
    ctx = domain_context(model)
    split = len(ctx.groups)
    if getattr(mesh, "ndim", None) != split + 1:
        raise ValueError(f"{fn}: the model splits {split} dim(s), so the mesh needs {split + 1} "
                         f"dims (the domain's, then the replicas'), got {mesh!r}")
    replicas = mesh.size(split)
    here = mesh.get_coordinate()
    if here is None:
        raise ValueError(f"{fn}: this rank is not in the mesh {mesh!r}")
    for i, g in enumerate(ctx.groups):
        line = mesh.mesh[tuple(slice(None) if d == i else here[d] for d in range(split + 1))]
        if sorted(g.global_ranks()) != sorted(line.tolist()):
            raise ValueError(f"{fn}: the model's domain group {i} has ranks "
                             f"{list(g.global_ranks())}, but the mesh's dim {i} here has "
                             f"{line.tolist()}: convert with parallelize_domain(..., group=<the "
                             f"mesh's domain dims>)")
    if split > 1:  # one domain dim for the hybrid sharding: every tile of this replica
        if mesh.mesh.numel() != dist.get_world_size():
            # a new mesh makes its groups with every rank of the world, which a slice of a
            # larger mesh would not all call
            raise ValueError(f"{fn}: tiles need a mesh over every rank (domain dims, then "
                             f"the replicas'), got one over {mesh.mesh.numel()} of "
                             f"{dist.get_world_size()} ranks")
        mesh = DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, replicas),
                          mesh_dim_names=("domain", "replicas"))
    if ctx.fsdp:
        raise ValueError(f"{fn}: the model is already sharded by {fn}")
    order = _blocks_deepest_first(model, blocks, fn)
    for module in (*order, model):  # (FSDP2 shards a module's children before it)
        fully_shard(module, mesh=mesh, **fsdp_kwargs)
        module.set_gradient_divide_factor(float(replicas))  # type: ignore[operator]
    ctx.hand_over()  # the sums ride on FSDP2's reduction; whole gradients enter as shares
    ctx.fsdp = True
    return model


def _blocks_deepest_first(model: nn.Module, blocks: Sequence[nn.Module], fn: str
                          ) -> list[nn.Module]:
    """``blocks``, checked (submodules of ``model``; nothing under FSDP2 yet), deepest first."""
    sharded = [name or "the model" for name, m in model.named_modules() if is_fsdp_module(m)]
    if sharded:
        raise ValueError(f"{fn}: {sharded[0]} is already under fully_shard; sharded on its "
                         f"own its gradients would be divided by every rank of the mesh (or, "
                         f"on the replicas alone, never summed over the tiles): pass the "
                         f"blocks to {fn}(model, mesh=mesh, blocks=[...]) instead")
    depth = {id(m): name.count(".") for name, m in model.named_modules() if name}
    for b in blocks:
        if b is model:
            raise ValueError(f"{fn}: the model itself is not one of its blocks (it is sharded "
                             f"after them, with what they leave)")
        if id(b) not in depth:
            raise ValueError(f"{fn}: a block ({type(b).__name__}) is not a submodule of the "
                             f"model")
    unique = list({id(b): b for b in blocks}.values())
    return sorted(unique, key=lambda b: -depth[id(b)])
