"""Gradient clipping for tensor-parallel (and FSDP2 x tensor-parallel) models.

``torch.nn.utils.clip_grad_norm_`` on a tensor-parallel model takes each rank's shards for
whole parameters: every rank computes another norm and scales its gradients by another
factor, and the replicated parameters drift apart. Here the norm is the dense model's:

- a parameter sharded by a tensorpar layer contributes its shards, reduced once over the
  layer's group;
- a gradient that is a ``DTensor`` (``fully_shard``) contributes its local shard, reduced
  over every mesh dim it is sharded on;
- a replicated parameter (a norm's weight, a row-parallel bias, a data-parallel replica
  whose gradient is already averaged) counts once, as it is.

Per parameter, the reduced quantity is the one torch's norm of that parameter sums or takes
the maximum of (``|g|^p``, the count of non-zeros for ``p = 0``, ``max |g|`` for ``inf``);
the total is then torch's norm of the per-parameter norms. Every rank gets the same total
and scales by the same factor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn

from tensorpar._torch import foreach_norm, foreach_supported
from tensorpar.collectives.functional import all_reduce
from tensorpar.nn.state._params import parameter_infos, retag, tag_of

__all__ = ["clip_grad_norm_", "grad_norm"]

Parameters = nn.Module | torch.Tensor | Iterable[torch.Tensor]


def grad_norm(model_or_parameters: Parameters, norm_type: float | str = 2.0, *,
              error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """The dense model's gradient norm, the same on every rank (nothing is scaled).

    Every rank of the model's groups must call it (it issues one all-reduce per group that
    holds shards, none on a model that is not parallelised). For a pipeline
    (`tensorpar.nn.pipeline`), pass the pipeline itself: every stage's norm joins the
    total (one more all-reduce, over the pipeline group).

    Args:
        model_or_parameters: the model, or its parameters (tensorpar's layers tag their
            shards, so a list is classified too). Under ``fully_shard``, which replaces
            the parameter objects, a list is classified once the model has run its first
            forward (`tensorpar.parallelize` tags FSDP2's parameters then); the model
            always works.
        norm_type: the p of the p-norm, as for ``torch.nn.utils.clip_grad_norm_``
            (``inf``, ``0`` and fractional included).
        error_if_nonfinite: raise if the total norm is ``nan`` or ``inf`` (on every rank).
        foreach: use torch's ``_foreach_norm`` (``None``: where the device supports it).

    Returns:
        The total norm (a 0-d tensor on the first gradient's device).

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.
        ValueError: a ``DTensor`` gradient with a ``Partial`` placement (not reduced yet).

    Example:
        >>> import torch
        >>> from tensorpar.nn import grad_norm
        >>> layer = torch.nn.Linear(3, 1)
        >>> layer(torch.ones(2, 3)).sum().backward()
        >>> float(grad_norm(layer))  # one process: torch's norm
        4.0
    """
    p = float(norm_type)
    entries = _entries(model_or_parameters)
    locals_ = [_local(grad) for _, grad, _ in entries]
    norms = _norms([t for t in locals_ if t is not None], p, foreach)
    it = iter(norms)
    per_param: list[torch.Tensor | None] = [next(it) if t is not None else None
                                            for t in locals_]
    _reduce(per_param, [groups for _, _, groups in entries], locals_, p,
            [param.dtype for param, _, _ in entries])
    present = [n for n in per_param if n is not None]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(
        [n.to(present[0].device) for n in present]), p) if present else \
        _no_gradient(model_or_parameters, p)
    total = _across_stages(total, model_or_parameters, p, bool(present))
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(f"grad_norm: the total norm of order {p} of the gradients is "
                           f"{float(total)}; it cannot be clipped (error_if_nonfinite=True). "
                           f"Pass error_if_nonfinite=False to scale by it anyway")
    return total


def clip_grad_norm_(model_or_parameters: Parameters, max_norm: float,
                    norm_type: float | str = 2.0, *, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Scale the gradients so that the dense model's norm is at most ``max_norm``.

    ``torch.nn.utils.clip_grad_norm_`` with its meaning kept for tensor-parallel models: the
    norm is the dense model's (`grad_norm`), the same tensor on every rank, and every rank
    multiplies its gradients by the same ``min(1, max_norm / (norm + 1e-6))``, so the
    replicated parameters stay identical. Works with tensorpar's data-parallel wrappers
    (gradients already averaged) and with ``fully_shard`` (``DTensor`` gradients).

    Args:
        model_or_parameters: the model or its parameters (see `grad_norm`).
        max_norm: the largest norm allowed.
        norm_type: the p of the p-norm (``inf``, ``0`` and fractional included).
        error_if_nonfinite: raise if the total norm is ``nan`` or ``inf`` (on every rank).
        foreach: use torch's foreach kernels (``None``: where the device supports them).

    Returns:
        The total norm before clipping (a 0-d tensor), the same on every rank.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.

    Example:
        >>> import torch
        >>> from tensorpar.nn import clip_grad_norm_
        >>> layer = torch.nn.Linear(3, 1)
        >>> layer(torch.ones(2, 3)).sum().backward()
        >>> float(clip_grad_norm_(layer, max_norm=1.0))
        4.0
        >>> round(float(torch.cat([p.grad.flatten() for p in layer.parameters()]).norm()), 4)
        1.0
    """
    params = _parameter_list(model_or_parameters)
    total = grad_norm(params if not isinstance(model_or_parameters, nn.Module)
                      else model_or_parameters, norm_type,
                      error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


def _no_gradient(model: Parameters, p: float) -> torch.Tensor:
    """The norm of no gradient: torch's 0, in the parameters' dtype (float32 without any)."""
    params = _parameter_list(model)
    dtype = next((q.dtype for q in params if q.is_floating_point()), torch.float32)
    return torch.zeros((), dtype=dtype, device=params[0].device if params else None)


_STAGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes a pipeline's stages tell each other, narrowest first."""


def _across_stages(total: torch.Tensor, model: Parameters, p: float,
                   had_gradient: bool) -> torch.Tensor:
    """Combine the stages' norms of a pipeline (`tensorpar.nn.pipeline`) over its group.

    Each rank of a pipeline holds other parameters: the total is the norm of the stages'
    norms (for ``p = 0``, the sum of their counts), computed by one all-reduce of this
    rank's norm over the pipeline group, in float64. Beside it travel flags: whether the
    stage had a gradient (a stage without one is left out: torch's norm of no gradient is
    0), whether its norm is nan (a maximum or minimum would drop it) and its parameters'
    dtype. Every rank returns the norm in the promotion of the stages' dtypes (as torch's
    stack of the per-parameter norms), so every rank holds the same tensor and
    ``error_if_nonfinite`` decides alike. Any other model is returned as it is.
    """
    group = getattr(model, "stage_group", None) if isinstance(model, nn.Module) else None
    if group is None or group.is_single:
        return total
    param = next(iter(model.parameters()), None)  # type: ignore[union-attr]
    device = group.comm_device(param.device if param is not None else None)
    op = _combining_op(p)
    if had_gradient:
        norm = total.to(device, torch.float64)
        if math.isfinite(p) and p != 0:
            norm = norm ** p
    else:  # left out: the identity of the combination
        norm = torch.tensor(math.inf if op == "min" else 0.0, dtype=torch.float64,
                            device=device)
    flags = [param is not None and total.dtype == d for d in _STAGE_DTYPES]
    flags += [had_gradient, had_gradient and bool(total.isnan())]
    out, raised = _reduce_flagged(norm.reshape(1), torch.tensor(flags, device=device), op,
                                  group)
    got = raised.tolist()
    seen, anyone, nan = got[:len(_STAGE_DTYPES)], got[-2], got[-1]
    dtype = functools.reduce(torch.promote_types, [
        d for d, s in zip(_STAGE_DTYPES, seen, strict=True) if s], torch.float16) \
        if any(seen) else torch.float32
    if not anyone:  # no stage had a gradient
        return torch.zeros((), dtype=dtype, device=total.device)
    if nan:
        return torch.full((), math.nan, dtype=dtype, device=total.device)
    reduced = out[0] ** (1.0 / p) if math.isfinite(p) and p != 0 else out[0]
    return reduced.to(total.device, dtype)


def _combining_op(p: float) -> Literal["sum", "max", "min"]:
    """How norms of order ``p`` combine across ranks: powers summed, or a max or min."""
    return "max" if p == math.inf else "min" if p == -math.inf else "sum"


def _reduce_flagged(values: torch.Tensor, flags: torch.Tensor, op: Literal["sum", "max", "min"],
                    group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` reduced by ``op`` over ``group``, and whether any rank raised each flag.

    One all-reduce: the flags travel beside the values (negated for a minimum). A maximum
    or minimum drops a nan (gloo's), so callers pass ``isnan`` among their flags.
    """
    sign = -1.0 if op == "min" else 1.0
    both = all_reduce(torch.cat([values, flags.to(values.dtype) * sign]), op=op, group=group)
    return both[:values.numel()], both[values.numel():] != 0


def _parameter_list(model_or_parameters: Parameters) -> list[torch.Tensor]:
    if isinstance(model_or_parameters, nn.Module):
        return [info.param for info in parameter_infos(model_or_parameters)]
    if isinstance(model_or_parameters, torch.Tensor):
        return [model_or_parameters]
    return list(model_or_parameters)


def _entries(model_or_parameters: Parameters) -> list[tuple[torch.Tensor, Any, list[Any]]]:
    """``(parameter, gradient, groups to reduce its norm over)`` for every parameter."""
    if isinstance(model_or_parameters, nn.Module):
        infos = parameter_infos(model_or_parameters)
        if any(tag_of(info.param) is None for info in infos):
            retag(model_or_parameters)  # fully_shard applied after the first forward
        # a pipeline's tied copy (the LM head tied to the embedding of another stage) is
        # counted on the stage that holds the original
        copies = getattr(model_or_parameters, "tied_copies", None)
        skip = {id(p) for p in copies()} if callable(copies) else set()
        pairs = [(info.param, info.shard.group if info.sharded else None) for info in infos
                 if id(info.param) not in skip]
    else:
        pairs = []
        for param in _parameter_list(model_or_parameters):
            tag = tag_of(param)
            sharded = tag is not None and tag.shard is not None and not tag.group.is_single
            pairs.append((param, tag.group if sharded and tag is not None else None))
    out = []
    for param, tp_group in pairs:
        grad = param.grad
        groups = _mesh_groups(grad) if grad is not None else _mesh_groups(param)
        if tp_group is not None:
            groups.append(tp_group.handle)
        out.append((param, grad, groups))
    return out


def _mesh_groups(tensor: torch.Tensor) -> list[Any]:
    """The groups of the mesh dims a ``DTensor`` is sharded on (none for a plain tensor)."""
    placements = getattr(tensor, "placements", None)
    mesh = getattr(tensor, "device_mesh", None)
    if placements is None or mesh is None:
        return []
    groups = []
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            raise ValueError(f"grad_norm: a gradient is a DTensor with placements "
                             f"{tuple(placements)}; a Partial placement holds an unreduced "
                             f"sum: reduce it first (expected Shard or Replicate)")
        if placement.is_shard() and mesh.size(dim) > 1:
            groups.append(mesh.get_group(dim))
    return groups


def _local(grad: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None:
        return None
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


def _norms(tensors: list[torch.Tensor], p: float, foreach: bool | None) -> list[torch.Tensor]:
    """Each tensor's p-norm, grouped by device and dtype as torch's clipping does."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    for (device, _), idx in groups.items():
        batch = [tensors[i] for i in idx]
        fast = foreach_supported(device)
        if foreach and not fast:
            raise RuntimeError(f"grad_norm: foreach=True was passed, but the foreach kernels "
                               f"do not support {device.type} tensors")
        norms = foreach_norm(batch, p) if (foreach is None and fast) or foreach \
            else [torch.linalg.vector_norm(t, p) for t in batch]
        for i, n in zip(idx, norms, strict=True):
            out[i] = n
    return [n for n in out if n is not None]


def _reduce(per_param: list[torch.Tensor | None], groups: list[list[Any]],
            locals_: list[torch.Tensor | None], p: float, dtypes: list[torch.dtype]) -> None:
    """Turn the local norms of sharded gradients into the dense parameters' norms, in place.

    One all-reduce per group, in the order the groups first appear (the same on every rank:
    every rank walks the same model). A rank without a gradient (an empty shard: a rank
    holding no expert) contributes nothing, and gets the dense norm as every rank does
    (``dtypes``: the parameters', for the norms this rank had none of).
    """
    order: list[Any] = []
    for gs in groups:
        for g in gs:
            if not any(g is o for o in order):
                order.append(g)
    if not order:
        return
    op = _combining_op(p)
    finite = math.isfinite(p) and p != 0
    empty = math.inf if op == "min" else 0.0
    device = next((t.device for t in locals_ if t is not None), torch.device("cpu"))
    stats: dict[int, torch.Tensor] = {}
    for i, n in enumerate(per_param):
        local = locals_[i]
        if groups[i]:
            wide = torch.promote_types(local.dtype, torch.float32) \
                if local is not None else torch.float32
            if n is None:
                stats[i] = torch.tensor(empty, dtype=wide, device=device)
            else:
                stats[i] = (n.to(device, wide) ** p) if finite else n.to(device, wide)
    for g in order:
        idx = [i for i, gs in enumerate(groups) if any(g is x for x in gs)]
        values = torch.stack([stats[i] for i in idx])
        values, nan = _reduce_flagged(values, values.isnan(), op, g)
        values = torch.where(nan, math.nan, values)
        for k, i in enumerate(idx):
            stats[i] = values[k]
    for i, value in stats.items():
        dense = value ** (1.0 / p) if finite else value
        before = per_param[i]
        per_param[i] = dense.to(before.dtype if before is not None else dtypes[i])
