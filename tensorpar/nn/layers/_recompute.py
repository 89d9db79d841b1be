"""Run a cheap module (a norm) keeping only its input for backward, and run it again there.

A norm saves its input and its normalised output for backward: two activations the size of
its input. Saving only the input and recomputing the norm in backward (an elementwise pass)
halves that; Megatron's fused layer norm keeps the same (input and inverse deviation).
Sequence parallelism's norms use it by default (`SequenceParallel(recompute=True)`).

Unlike ``torch.utils.checkpoint``, the input is saved with ``ctx.save_for_backward``: it is
what ``saved_tensors_hooks`` see (offloading, memory accounting), and nothing else is held.
Under ``torch.compile`` the module runs as written: the compiler's partitioner decides what
to save itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from tensorpar.comm._compiling import compiling

__all__ = ["install_recompute"]


def install_recompute(module: nn.Module) -> None:
    """Make ``module`` save only its input for backward and recompute itself there.

    Applies when the module is called with one tensor argument and returns a tensor, with
    autograd recording; any other call runs the module as written. Random state (dropout) and
    autocast are replayed as they were in forward. A copy of the module (``copy.deepcopy``)
    recomputes itself with its own parameters.
    """
    if not isinstance(module.__dict__.get("forward"), _RecomputedForward):
        module.forward = _RecomputedForward(module)


class _RecomputedForward:
    """The ``forward`` of a recomputed module.

    An object rather than a closure, so that a copy of the module (``copy.deepcopy``,
    pickling) carries one bound to itself.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.previous = module.__dict__.get("forward")  # another wrapper already there

    def plain(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) \
                or not torch.is_grad_enabled() or compiling():
            return self.plain(*args, **kwargs)
        params = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        if not args[0].requires_grad and not params:
            return self.plain(*args)
        return _Recomputed.apply(self.module, self.plain, tuple(params),  # type: ignore[no-untyped-call]
                                 args[0], *params.values())


def _rng_states(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    device = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
    return torch.get_rng_state(), device


class _Recomputed(torch.autograd.Function):
    """Forward: ``fn(x)`` without a graph. Backward: ``fn(x)`` again with one, then its grads."""

    @staticmethod
    def forward(ctx: Any, module: nn.Module, fn: Callable[[torch.Tensor], Any],
                names: tuple[str, ...], x: torch.Tensor, *params: torch.Tensor
                ) -> torch.Tensor:
        ctx.module, ctx.fn, ctx.names, ctx.params = module, fn, names, params
        ctx.rng = _rng_states(x)
        ctx.autocast = (torch.is_autocast_enabled(x.device.type),
                        torch.get_autocast_dtype(x.device.type))
        ctx.save_for_backward(x)
        out = fn(x)  # no graph is recorded inside a Function's forward
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"recomputed module returned a {type(out).__name__}; expected a "
                            f"tensor")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        higher = torch.is_grad_enabled()
        devices = [x.device] if x.is_cuda else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), \
                torch.autocast(x.device.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]):
            torch.set_rng_state(ctx.rng[0])
            if ctx.rng[1] is not None:
                torch.cuda.set_rng_state(ctx.rng[1], x.device)
            # views stand in for the input and the parameters: the gradients stop at them
            # (a gradient hook on a parameter, a partial gradient's all-reduce, must fire
            # once, when the outer backward reaches it) and stay attached to the originals
            # for a second derivative
            leaf = x.view_as(x) if ctx.needs_input_grad[3] else x.detach()
            aliases = [p.view_as(p) for p in ctx.params]
            with _parameters_replaced(ctx.module, dict(zip(ctx.names, aliases, strict=True))):
                out = ctx.fn(leaf)
        wanted = ([leaf] if ctx.needs_input_grad[3] else []) + aliases
        grads = list(torch.autograd.grad(out, wanted, grad, allow_unused=True,
                                         create_graph=higher))
        grad_x = grads.pop(0) if ctx.needs_input_grad[3] else None
        return (None, None, None, grad_x, *grads)


@contextmanager
def _parameters_replaced(module: nn.Module, tensors: dict[str, torch.Tensor]
                         ) -> Iterator[None]:
    """Within: ``module``'s parameters named in ``tensors`` read as those tensors."""
    slots = []
    for name, tensor in tensors.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        slots.append((owner, attr, owner._parameters[attr]))
        owner._parameters[attr] = tensor  # type: ignore[assignment]
    try:
        yield
    finally:
        for owner, attr, original in slots:
            owner._parameters[attr] = original
