"""Replicated parameters with a partial gradient: summed over the group once per backward.

Some parameters are held whole by every rank but only see the rank's part of the data:
Qwen3's and Gemma3's per-head ``q_norm``/``k_norm`` (applied to the rank's heads only), or
the norms of a sequence-parallel model (applied to the rank's slice of the sequence). Each
rank's gradient of such a parameter is a partial sum; the dense gradient is the sum over the
tensor-parallel group. Left alone, the replicas' gradients differ and the copies drift apart.

How the sum is made: a gradient hook on the parameter itself (``Tensor.register_hook``).
For a leaf, autograd first adds up the gradients of every use of the tensor in the graph
and then calls the hook once, with that backward pass's gradient, before it is accumulated
into ``.grad``. The hook all-reduces it (`tensorpar.collectives.functional.all_reduce`, so
validation mode fingerprints it) and returns the sum. Hence:

- one all-reduce per parameter per backward, however many times the forward used it;
- gradient accumulation is exact: each backward adds its own reduced gradient to ``.grad``
  (a hook after accumulation would re-reduce the earlier micro-batches);
- ``torch.autograd.grad`` sees the summed gradient too, and a data-parallel reducer hooked
  after accumulation sees the tensor-parallel sum.

The alternative, an autograd Function on the parameter's use inside the module's forward,
would need the module's forward rewritten and reduces once per use. Every rank must run the
backward through the parameter (it does: a rank with no heads or an empty sequence shard
still applies the module, to an empty tensor, and gets a zero gradient).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch
from torch import nn

from tensorpar.collectives.functional import all_reduce
from tensorpar.comm._group import Group, GroupLike, resolve_group

__all__ = ["install_partial_grad", "partial_grad_group", "partial_grad_parameters"]

_MARK = "_tensorpar_partial_grad"


def install_partial_grad(module: nn.Module, group: GroupLike = None,
                         names: Collection[str] | None = None) -> list[str]:
    """Sum the gradients of ``module``'s own parameters over ``group`` in every backward.

    The parameters stay replicated and unchanged; each one gets a gradient hook (see the
    module docstring). Parameters already summed over a group are left as they are, so
    calling this twice does not sum twice.

    Args:
        module: the module whose direct parameters (not its children's) have a partial
            gradient.
        group: the tensor-parallel group.
        names: only these of the module's own parameters (``None``: all of them).

    Returns:
        The names of the parameters hooked by this call.

    Raises:
        ValueError: a parameter is already summed over a different group.

    Example:
        >>> import torch
        >>> norm = torch.nn.LayerNorm(4)
        >>> install_partial_grad(norm)  # one rank: the sum is the gradient itself
        ['weight', 'bias']
        >>> install_partial_grad(norm)
        []
    """
    g = resolve_group(group, "install_partial_grad")
    hooked = []
    for name, p in module.named_parameters(recurse=False):
        if names is not None and name not in names:
            continue
        current = partial_grad_group(p)
        if current is not None:
            if current != g:
                raise ValueError(f"install_partial_grad: parameter {name!r} of "
                                 f"{type(module).__name__} already has its gradient summed over "
                                 f"a group of {current.size} ranks; got a group of {g.size}")
            continue
        _hook(p, g)
        hooked.append(name)
    if hooked:
        _follow_replacements(module, hooked, g)
    return hooked


def _hook(p: torch.Tensor, g: Group) -> None:
    setattr(p, _MARK, g)
    if p.requires_grad and not g.is_single:
        p.register_hook(_summer(g))


_FOLLOWED = "_tensorpar_partial_grad_names"


def _follow_replacements(module: nn.Module, names: list[str], g: Group) -> None:
    """Hook the parameters that replace these ones too, before each forward.

    ``fully_shard`` (FSDP2) swaps a module's parameters for sharded ones and, around each
    forward and backward, for an unsharded twin made once at the first all-gather: the
    computation reads the twin, so the hook must be on it. A forward pre-hook of the
    module (it runs after FSDP2's own, which is on an enclosing module) hooks any
    parameter it has not seen, once. Under ``torch.compile`` an unseen twin breaks the
    graph there and is hooked eagerly; with ``fullgraph=True`` it is refused (run one
    forward without compiling first).
    """
    followed = vars(module).get(_FOLLOWED)
    if followed is None:
        followed = {}
        module.__dict__[_FOLLOWED] = followed
        module.register_forward_pre_hook(_rehook)
    followed.update(dict.fromkeys(names, g))


def _rehook(module: nn.Module, args: object) -> None:
    for name, g in vars(module)[_FOLLOWED].items():
        p = module._parameters.get(name)
        if p is None or getattr(p, _MARK, None) is not None:
            continue
        if torch.compiler.is_compiling():
            raise RuntimeError(f"install_partial_grad: {type(module).__name__}.{name} was "
                               f"replaced (by fully_shard?) and its new tensor has no gradient "
                               f"sum yet; run one forward without torch.compile first")
        _hook(p, g)


def _summer(group: Group):  # type: ignore[no-untyped-def]
    def hook(grad: torch.Tensor) -> torch.Tensor:
        # the summed gradient is replicated: its consumers count it once (identity adjoint)
        return all_reduce(grad.contiguous(), backward="identity", group=group)
    return hook


def partial_grad_group(param: torch.Tensor) -> Group | None:
    """The group ``param``'s gradient is summed over, or ``None`` (an ordinary parameter)."""
    g = getattr(param, _MARK, None)
    return g if isinstance(g, Group) else None


def partial_grad_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters of ``model`` whose gradient is summed over a group, with their names."""
    for name, p in model.named_parameters():
        if partial_grad_group(p) is not None:
            yield name, p
