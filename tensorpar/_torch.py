"""The one room that touches torch's private internals (tested on torch 2.13).

Everything tensorpar reads from torch beyond its public API is named here, once.
``tests/test_torch_internals.py`` checks each name on the installed torch, so an upgrade that
moves one fails that test by name instead of silently taking another path. Where a missing
internal only costs speed (the direct ``Function.apply``, the direct process-group calls),
the caller falls back to the public way; where it would cost correctness (FSDP2's parameter
layout), the accessor raises.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.optim.optimizer as torch_optimizer
from torch import nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.utils._pytree import tree_map

__all__ = [
    "C10D_FUNCTIONAL",
    "C10D_WORLD",
    "CPU_FLASH_ATTENTION",
    "CPU_FLASH_ATTENTION_BACKWARD",
    "DISABLED_TORCH_FUNCTION",
    "FUNCTORCH_ACTIVE",
    "UNWRAP_IF_DEAD",
    "current_graph_task_id",
    "foreach_norm",
    "foreach_supported",
    "fsdp_managed_params",
    "get_eval_frame_callback",
    "default_group_timeout",
    "global_optimizer_hooks_hidden",
    "global_optimizer_post_hooks",
    "gradient_is_captured",
    "has_post_accumulate_hooks",
    "local_offsets",
    "queue_engine_callback",
    "register_state_dict_post_hook",
    "reset_compiler",
    "saved_tensors_hooks_active",
    "store_of",
    "tree_map",
]

# Function.apply's own steps, called directly by collectives._autograd.direct_apply (speed only)
FUNCTORCH_ACTIVE: Callable[[], bool] | None = getattr(
    torch._C, "_are_functorch_transforms_active", None)
UNWRAP_IF_DEAD: Callable[[torch.Tensor], torch.Tensor] | None = getattr(
    getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)

# A tensor subclass whose operations give plain tensors (nn.state.checkpoint.ShardAtOffset)
DISABLED_TORCH_FUNCTION: Any = torch._C._disabled_torch_function_impl

# The traced collectives (tensorpar.collectives._traced._prims): torch's functional collective ops
C10D_FUNCTIONAL: Any = torch.ops._c10d_functional

# Attention blocks on CPU with their log-sum-exp (tensorpar.context._blocks): torch's fused
# kernel, forward and backward
CPU_FLASH_ATTENTION: Any = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
CPU_FLASH_ATTENTION_BACKWARD: Any = \
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# The process groups torch knows: their stores and names (speed and diagnosis only)
C10D_WORLD: Any = getattr(dist.distributed_c10d, "_world", None) if dist.is_available() else None


def reset_compiler() -> None:
    """Forget every compiled graph (a benchmark compiles each model afresh)."""
    torch._dynamo.reset()


def current_graph_task_id() -> int:
    """The running backward pass's id, or -1 outside one."""
    task: int = torch._C._current_graph_task_id()
    return task


def saved_tensors_hooks_active() -> bool:
    """Whether saved-tensor hooks are on (activation checkpointing's, ``save_on_cpu``'s)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def gradient_is_captured(leaf: torch.Tensor) -> bool:
    """Whether the running backward pass hands ``leaf``'s gradient back to its caller.

    True under ``torch.autograd.grad`` with ``leaf`` among its inputs (nothing is added to
    ``.grad``); False where the gradient is accumulated into ``.grad`` (``backward()``).
    Call it from a hook on ``leaf`` while its gradient is computed. torch says so only by
    refusing the question for a captured leaf, with an error that names ``autograd.grad()``.
    """
    node = torch.autograd.graph.get_gradient_edge(leaf).node
    try:
        torch._C._will_engine_execute_node(node)
    except RuntimeError as exc:
        if "autograd.grad()" in str(exc):
            return True
        raise
    return False


def has_post_accumulate_hooks(param: torch.Tensor) -> bool:
    """Whether ``param`` has hooks that run once its gradient is accumulated into ``.grad``."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    return bool(hooks)


def queue_engine_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward pass has finished its work."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def global_optimizer_post_hooks() -> list[Callable[..., Any]]:
    """The step post-hooks registered for every optimizer."""
    return list(torch_optimizer._global_optimizer_post_hooks.values())


def default_group_timeout() -> datetime.timedelta | None:
    """The timeout the default process group was created with (``None``: not readable).

    ``torch.distributed.new_group`` gives a new group torch's default timeout (30 minutes
    for gloo), not the one the job passed to ``init_process_group``.
    """
    pg = dist.distributed_c10d._get_default_group()
    for device in getattr(pg, "_device_types", ()):
        options = getattr(pg._get_backend(device), "options", None)
        timeout = getattr(options, "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


@contextlib.contextmanager
def global_optimizer_hooks_hidden() -> Iterator[None]:
    """Hide the step hooks registered for every optimizer for the duration.

    They are put back after it, in their order, their handles still valid: for a throwaway
    optimizer's step, which is not a step of the run.
    """
    hooks: tuple[dict[int, Any], ...] = (torch_optimizer._global_optimizer_pre_hooks,
                                         torch_optimizer._global_optimizer_post_hooks)
    saved = [dict(h) for h in hooks]
    for h in hooks:
        h.clear()
    try:
        yield
    finally:
        for h, kept in zip(hooks, saved, strict=True):
            added = dict(h)  # registered meanwhile: after the others
            h.clear()
            h.update(kept)
            h.update(added)


def foreach_norm(tensors: list[torch.Tensor], p: float) -> list[torch.Tensor]:
    """Each tensor's ``p``-norm in one foreach kernel (where `foreach_supported`)."""
    return list(torch._foreach_norm(tensors, p))


def foreach_supported(device: torch.device) -> bool:
    """Whether torch's foreach kernels run on ``device``'s tensors."""
    supported: bool = torch.utils._foreach_utils._device_has_foreach_support(device)
    return supported


def local_offsets(value: Any) -> list[int]:
    """A ``DTensor``'s local shard's offsets in the global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh,
                                                       value.placements)
    return list(offsets)


def register_state_dict_post_hook(module: nn.Module, hook: Callable[..., Any]) -> None:
    """``module.register_state_dict_post_hook`` (public from torch 2.5; private before)."""
    register = getattr(module, "register_state_dict_post_hook", None) \
        or module._register_state_dict_hook
    register(hook)


def store_of(group: dist.ProcessGroup) -> Any:
    """The rendezvous store of a process group, or None where torch does not say."""
    entry = C10D_WORLD.pg_map.get(group) if C10D_WORLD is not None else None
    return entry[1] if entry is not None else None


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) manages ``module``."""
    return callable(getattr(module, "_get_fsdp_state", None))


def fsdp_managed_params(module: nn.Module) -> list[tuple[torch.Tensor, nn.Module, str]]:
    """``(sharded parameter, owner, attribute name)`` of every parameter FSDP2 manages here.

    Empty for a module that is not an ``FSDPModule``.

    Raises:
        RuntimeError: ``module`` is an ``FSDPModule`` whose state is laid out in a way this
            torch's tensorpar cannot read (tensorpar would otherwise save and clip FSDP2
            models wrongly).
    """
    if not is_fsdp_module(module):
        return []
    state_of: Any = getattr(module, "_get_fsdp_state")  # noqa: B009 (an nn.Module attribute)
    try:
        state = state_of()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            one = getattr(state, "_fsdp_param_group", None)
            groups = [one] if one is not None else []
        out: list[tuple[torch.Tensor, nn.Module, str]] = []
        for group in groups:
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                owners = [(info.module, info.param_name),
                          *zip(info.shared_modules, info.shared_param_names, strict=True)]
                out.extend((fsdp_param.sharded_param, owner, leaf) for owner, leaf in owners)
        return out
    except (AttributeError, TypeError) as e:
        raise RuntimeError(f"tensorpar cannot read fully_shard's parameter layout on torch "
                           f"{torch.__version__} ({type(e).__name__}: {e}); it needs it to tag "
                           f"FSDP2's sharded parameters for checkpoints and clipping. tensorpar "
                           f"is tested on torch 2.13") from e
