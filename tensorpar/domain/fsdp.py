"""FSDP2 beside domain parallelism: parameters sharded over the replicas.

torch's ``fully_shard`` on a 2-D mesh (hybrid sharding) reduce-scatters each gradient over
the mesh's second dim and all-reduces it over the first. With the domain as the first dim
and the replicas as the second, that one reduction is exactly what a domain-parallel model
needs: the tiles' partial gradients summed, the replicas' averaged (the divide factor is
set to the number of replicas, not the mesh's size). ``fully_shard`` replaces the
parameters, so the domain's own end-of-backward sum never runs beside it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tensorpar.domain.parallelize import domain_context

__all__ = ["fully_shard_domain"]


def fully_shard_domain(model: nn.Module, *, mesh: Any, **fsdp_kwargs: Any) -> nn.Module:
    """``fully_shard`` a domain-parallel model over the replica dim of a 2-D mesh.

    Args:
        model: a model converted by `parallelize_domain` with ``group=mesh[0]`` (one split
            dim; the mesh's first dim is the domain).
        mesh: a 2-D ``DeviceMesh``: dim 0 the domain (tiles), dim 1 the replicas (each
            replica its own batch; the parameters are sharded over them).
        **fsdp_kwargs: passed to ``torch.distributed.fsdp.fully_shard`` (``reshard_after_forward``,
            ``mp_policy``, ...).

    Returns:
        The model, now also an ``FSDPModule``. After ``backward()`` each parameter's
        (sharded) gradient is the dense gradient averaged over the replicas.

    Raises:
        ValueError: the model is not domain-parallel, splits more than one dim, the mesh is
            not 2-D, or the model's domain group is not the mesh's first dim.

    A module that runs after a global pooling (on replicated features) computes its
    parameters' whole gradient on every tile; it enters FSDP2's sum over the domain as an
    equal share from each tile (the gradient at the module's output is divided by the
    number of tiles, and multiplied back at its inputs).
    """
    from torch.distributed.fsdp import fully_shard

    fn = "fully_shard_domain"
    ctx = domain_context(model)
    if getattr(mesh, "ndim", None) != 2:
        raise ValueError(f"{fn}: mesh must be a 2-D DeviceMesh (domain, replicas), got "
                         f"{mesh!r}")
    if len(ctx.groups) != 1:
        raise ValueError(f"{fn}: the model splits {len(ctx.groups)} dims; FSDP2 beside "
                         f"domain parallelism supports strips (one split dim)")
    domain_ranks = ctx.groups[0].global_ranks()
    mesh_ranks = tuple(mesh.mesh.select(1, mesh.get_coordinate()[1]).tolist())
    if sorted(domain_ranks) != sorted(mesh_ranks):
        raise ValueError(f"{fn}: the model's domain group has ranks {list(domain_ranks)}, but "
                         f"the mesh's first dim here has {list(mesh_ranks)}: convert with "
                         f"parallelize_domain(..., group=<the mesh's first dim>)")
    ctx.hand_over()  # the sums ride on FSDP2's reduction; whole gradients are refused
    ctx.fsdp = True
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    model.set_gradient_divide_factor(float(mesh.size(1)))  # type: ignore[operator]
    return model
