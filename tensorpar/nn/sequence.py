"""Sequence parallelism: the activations between the parallel matmuls sharded along the sequence.

With tensor parallelism alone, everything outside the split matmuls (norms, residual adds,
dropout) runs on the whole activation on every rank. Sequence parallelism (Korthikanti et
al., 2022) gives each rank a slice of the sequence there instead, and swaps each all-reduce
for a reduce-scatter and an all-gather of the same bytes:

| where | forward | backward |
|---|---|---|
| entering the region (`SequenceSplit`) | take own slice | all-gather |
| entering attention / MLP (`SequenceGather`) | all-gather | reduce-scatter |
| a row-parallel layer inside it | reduce-scatter (was all-reduce) | all-gather |
| leaving the region (`SequenceParallel(gather_output=True)`) | all-gather | own slice |

Column-parallel layers inside a `SequenceGather` module read the gathered input and
produce a partial input gradient each; the gather's reduce-scatter sums those once (so one
all-gather in forward and one reduce-scatter in backward serve q, k and v together), and the
layers themselves issue no collective. Parameters that every rank holds whole but that see
only its slice of the sequence (the norms) get their gradient summed (`PartialGrad`).

Any sequence length works: the slices are balanced like ``torch.tensor_split`` (a length of
1 on 4 ranks gives slices of 1, 0, 0 and 0). The split records the slice lengths of the
current forward in the model's `SequenceShards`, which the later gathers and
reduce-scatters of that forward read: no size exchange.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.collaborative import CollaborativeTensor
from tensorpar.collectives._split import balanced_sizes
from tensorpar.collectives.functional import all_gather, reduce_scatter
from tensorpar.collectives.regions import gather_from_group, split_to_group
from tensorpar.comm._compiling import compiling
from tensorpar.comm._group import Group
from tensorpar.nn.layers._column_fn import save_linear_inputs, weight_grads
from tensorpar.nn.layers._path import LayerPath, layer_path
from tensorpar.nn.layers._recompute import install_recompute
from tensorpar.nn.layers._row_fn import wide_product

__all__ = ["SEQUENCE_STYLES", "SequenceGather", "SequenceParallel", "SequenceShards",
           "SequenceSplit", "column_on_gathered", "install_sequence_style",
           "sequence_row_output"]


@dataclass(frozen=True)
class SequenceSplit:
    """The module's input is whole on every rank; the module runs on this rank's slice of it.

    Put it on the first block of the sequence-parallel region (a transformer's first
    decoder layer): its input (the first positional argument, or ``hidden_states=``) is split
    along ``dim`` in forward, and the slices' gradients are all-gathered in backward. The
    module's own parameters, if any, get their gradient summed over the group.

    Attributes:
        dim: the sequence dimension (``1`` for ``(batch, sequence, hidden)``).
    """

    dim: int = 1


@dataclass(frozen=True)
class SequenceGather:
    """The module (attention, MLP) runs on the whole sequence, gathered from the slices.

    Its input (the first positional argument, or ``hidden_states=``) is all-gathered along
    ``dim`` in forward and its gradient reduce-scattered in backward. Inside it, the
    column-parallel layers read the gathered input without a collective of their own and the
    row-parallel layers reduce-scatter their output along ``dim`` instead of all-reducing it.
    Every parameter inside must belong to a split layer (`Colwise`, `PackedColwise`,
    `Rowwise`) or be marked `PartialGrad` (a per-head norm): the gradient reaching the
    gathered input must be each rank's partial share, which the reduce-scatter sums.

    Attributes:
        dim: the sequence dimension.
        regather: keep only this rank's slice for the backward and all-gather the input
            again there, for the column layers' weight gradients (Megatron's choice): the
            whole input is not held from forward to backward (less activation memory), for
            one more all-gather per module in backward (more bytes). ``False`` (DTensor's
            choice): the column layers keep the gathered input.
    """

    dim: int = 1
    regather: bool = False


@dataclass(frozen=True)
class SequenceParallel:
    """The module (a norm) runs on this rank's slice of the sequence.

    Its parameters (its own and its children's) stay whole on every rank; their gradient,
    which sees only this rank's slice, is summed over the group in backward. The module must
    work token by token (a norm, dropout, an activation): it never sees the whole sequence.
    With ``gather_output``, the module ends the sequence-parallel region: its output is
    all-gathered along ``dim`` (every rank gets the whole sequence, as after a dense module)
    and the gradient's own slice kept in backward.

    Attributes:
        dim: the sequence dimension.
        gather_output: all-gather the output (the last norm before the LM head).
        recompute: keep only the module's input for backward and run the module again
            there (a norm's normalised output is not held from forward to backward: one
            activation of the slice's size less per norm, for an elementwise pass in
            backward). Applies when the module takes one tensor and autograd records; under
            ``torch.compile`` the compiler decides what to keep.
    """

    dim: int = 1
    gather_output: bool = False
    recompute: bool = True


SEQUENCE_STYLES = (SequenceSplit, SequenceGather, SequenceParallel)


class SequenceShards:
    """One model's sequence layout: the group, the sequence dim, this forward's slice lengths.

    `tensorpar.parallelize` makes one per model whose plan uses sequence-parallel styles and
    hands it to the hooks and layers that need the slice lengths. `split` records them;
    everything after it in the same forward reads them.

    Args:
        group: the tensor-parallel group.
        dim: the sequence dimension.

    Attributes:
        overlap: with ``SequenceGather(regather=True)``, launch the backward's all-gather
            of the input before the column layer's input gradient and wait for it only for
            the weight gradient (the default); ``False``: all-gather synchronously after it.
    """

    def __init__(self, group: Group, dim: int) -> None:
        self.group, self.dim = group, dim
        self.sizes: tuple[int, ...] | None = None
        self.overlap = True
        # id(whole input) -> (the input, held weakly; its record) for each input gathered with
        # ``regather`` that is still alive: an entry leaves when its input is collected
        self._regathered: dict[int, tuple[weakref.ref[torch.Tensor], _Regather]] = {}

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's balanced slice of ``x`` along the sequence; records every rank's length."""
        self.sizes = balanced_sizes(x.shape[self.dim], self.group.size)
        return split_to_group(x, dim=self.dim, group=self.group.handle, sizes=self.sizes)

    def split_sum(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the sum of every rank's partial ``y``; records the lengths."""
        self.sizes = balanced_sizes(y.shape[self.dim], self.group.size)
        return self.reduce_scatter(y)

    def gather(self, x: torch.Tensor, *, partial_grad: bool, regather: bool = False
               ) -> torch.Tensor:
        """The whole sequence from the slices.

        Backward: a reduce-scatter where the consumers' gradients are partial
        (``partial_grad``: column-parallel layers), else this rank's slice of the gradient
        (a replicated consumer). ``regather``: see `SequenceGather`.
        """
        sizes = self._current("gather", x)
        if partial_grad and regather and torch.is_grad_enabled() and not compiling():
            info = _Regather(self, sizes, x.detach())
            whole: torch.Tensor = _GatherRegathered.apply(x, info)  # type: ignore[no-untyped-call]
            self._remember(whole, info)  # for `column_on_gathered`
            return whole
        if partial_grad:
            out: torch.Tensor = all_gather(x, dim=self.dim, group=self.group.handle, sizes=sizes)
            return out
        return gather_from_group(x, dim=self.dim, group=self.group.handle, sizes=sizes)

    def reduce_scatter(self, y: torch.Tensor) -> torch.Tensor:
        """Sum the partial ``y`` over the group and keep this rank's slice of the sequence."""
        sizes = self._current("reduce_scatter", y)
        out: torch.Tensor = reduce_scatter(y, dim=self.dim, group=self.group.handle,
                                           sizes=sizes)
        return out

    def _current(self, what: str, x: torch.Tensor) -> tuple[int, ...]:
        if self.sizes is None:
            raise RuntimeError(
                f"sequence parallelism: a {what} along dim {self.dim} ran before any "
                f"SequenceSplit in this model: nothing told the ranks how the sequence is "
                f"split (tensor of shape {tuple(x.shape)}). Put SequenceSplit on the first "
                f"module of the sequence-parallel region")
        return self.sizes

    def __getstate__(self) -> dict[str, Any]:  # a copy of the model starts with no forward
        return {"group": self.group, "dim": self.dim, "sizes": None, "overlap": self.overlap,
                "_regathered": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"_regathered": {}, **state})  # (also a state saved without it)

    def _remember(self, whole: torch.Tensor, info: _Regather) -> None:
        key, table = id(whole), self._regathered

        def forget(ref: weakref.ref[torch.Tensor]) -> None:
            if key in table and table[key][0] is ref:
                del table[key]
        table[key] = (weakref.ref(whole, forget), info)

    def regathered(self, x: torch.Tensor) -> _Regather | None:
        """The record of ``x``, if `gather` returned ``x`` with ``regather`` (and it lives).

        A tensor computed from it has none: its layer saves what it reads.
        """
        kept = self._regathered.get(id(x))
        return kept[1] if kept is not None and kept[0]() is x else None


class _Regather:
    """One regathered input: the slice it came from, and the whole input during backward.

    The column layers reading the gathered input each save only the slice; the first of
    their backwards all-gathers it again, the others reuse that, the last lets it go. With
    the shards' ``overlap``, that first backward launches the all-gather (`start`) before
    computing its input gradient and waits for it (`take_whole`) only for its weight
    gradient.
    """

    def __init__(self, shards: SequenceShards, sizes: tuple[int, ...], piece: torch.Tensor):
        self.shards, self.sizes, self.piece = shards, sizes, piece
        self.whole: torch.Tensor | None = None
        self.in_flight: CollaborativeTensor | None = None
        self.pending = 0

    def start(self, needed: bool) -> None:
        """Launch the all-gather without waiting, if ``needed`` and not launched yet.

        Every rank's readers need it alike (the same parameters require grad everywhere),
        so every rank launches alike.
        """
        if needed and self.whole is None and self.in_flight is None:
            self.in_flight = all_gather(self.piece, dim=self.shards.dim, async_op=True,
                                        group=self.shards.group.handle, sizes=self.sizes)

    def take_whole(self, needed: bool) -> torch.Tensor | None:
        """One reader's backward is done: the whole input if it is ``needed``, else ``None``.

        The first reader that needs it all-gathers it (or waits for the all-gather it
        started).
        """
        if needed and self.whole is None:
            self.start(needed)
            assert self.in_flight is not None
            self.whole, self.in_flight = self.in_flight.resolve(), None
        whole = self.whole if needed else None
        self.pending -= 1
        if self.pending <= 0:
            self.whole = None
        return whole


class _GatherRegathered(torch.autograd.Function):
    """Forward: all-gather (nothing saved). Backward: reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, info: _Regather) -> torch.Tensor:
        ctx.info = info
        with torch.no_grad():
            return all_gather(x, dim=info.shards.dim, group=info.shards.group.handle,
                              sizes=info.sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        info = ctx.info
        _no_second_order()
        return reduce_scatter(grad.contiguous(), dim=info.shards.dim,
                              group=info.shards.group.handle, sizes=info.sizes), None


def _no_second_order() -> None:
    if torch.is_grad_enabled():
        raise RuntimeError("SequenceGather(regather=True) has no second-order backward "
                           "(create_graph=True); use regather=False")


def column_on_gathered(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       shards: SequenceShards) -> torch.Tensor:
    """A column-parallel layer inside a `SequenceGather` module: ``F.linear``, no collective.

    Where the input was gathered with ``regather``, the layer saves only the slice and gets
    the whole input back in backward (`_ColumnRegathered`).
    """
    info = shards.regathered(x)
    if info is None or not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    info.pending += 1
    out: torch.Tensor = _ColumnRegathered.apply(x, weight, bias, info)  # type: ignore[no-untyped-call]
    return out


class _ColumnRegathered(torch.autograd.Function):
    """Forward: ``x W^T + b``, saving the slice of ``x``. Backward: regathers it for ``dW``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                info: _Regather) -> torch.Tensor:
        ctx.info, ctx.has_bias = info, bias is not None
        ctx.save_for_backward(info.piece, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _no_second_order()
        _, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        info = ctx.info
        if info.shards.overlap:  # in flight while the input gradient is computed
            info.start(need_w)  # a frozen weight needs no regather
        grad_x = grad.matmul(weight) if need_x else None
        grad_w, grad_b = weight_grads(ctx, grad, info.take_whole(need_w))
        return grad_x, grad_w, grad_b, None


def _on_hidden_states(fn: Callable[[torch.Tensor], torch.Tensor], module: nn.Module
                      ) -> Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]:
    """A forward pre-hook applying ``fn`` to the module's input activation."""
    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args and isinstance(args[0], torch.Tensor):
            return (fn(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
        raise TypeError(f"sequence parallelism: {type(module).__name__} was called without a "
                        f"tensor as its first argument or as hidden_states=; cannot tell which "
                        f"input is the sequence")
    return hook


def install_sequence_style(module: nn.Module, style: SequenceSplit | SequenceGather
                           | SequenceParallel, shards: SequenceShards) -> None:
    """Register the hooks of ``style`` on ``module`` (parameters are handled by the caller)."""
    if isinstance(style, SequenceSplit):
        module.register_forward_pre_hook(_on_hidden_states(shards.split, module),
                                         with_kwargs=True)
    elif isinstance(style, SequenceGather):
        regather = style.regather
        module.register_forward_pre_hook(
            _on_hidden_states(lambda x: shards.gather(x, partial_grad=True, regather=regather),
                              module), with_kwargs=True)
    else:
        if style.recompute:
            install_recompute(module)
        if not style.gather_output:
            return
        module.register_forward_hook(
            lambda _m, _a, out: shards.gather(out, partial_grad=False)
            if isinstance(out, torch.Tensor) else _refuse_output(module, out))


def sequence_row_output(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        shards: SequenceShards, wide: torch.dtype | None) -> torch.Tensor:
    """A row-parallel layer's output inside a `SequenceGather` module: reduce-scattered.

    The partial products are summed and sliced along the sequence in one reduce-scatter (in
    ``wide``, a ``reduce_dtype``, where one is given); the bias joins after the sum, on the
    slice (its gradient, from this slice only, is summed over the group by its hook). One
    Function where it can be (`_SequenceRowLinear`: nothing but the input and weight saved),
    else the composition of public collectives (validation mode, autocast, ``wide``, a
    second-order graph).
    """
    widened = wide_product(x, weight, bias, wide)
    if widened is None and layer_path(x, shards.group) is LayerPath.FUSED:
        out: torch.Tensor = _SequenceRowLinear.apply(x, weight, bias, shards)  # type: ignore[no-untyped-call]
        return out
    y, bias, out_dtype = widened if widened is not None else (F.linear(x, weight), bias, None)
    y = shards.reduce_scatter(y)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y if out_dtype is None else y.to(out_dtype)  # None: F.linear's, as dense


class _SequenceRowLinear(torch.autograd.Function):
    """Forward: ``reduce_scatter(x W^T) + b``. Backward: all-gather ``g``, then ``G W``, ``G^T x``.

    Saves only ``x`` and ``W`` (the composition would also keep the reduce-scattered output
    alive for a second-order backward).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                shards: SequenceShards) -> torch.Tensor:
        save_linear_inputs(ctx, x, weight, bias, shards.group)
        ctx.shards, ctx.sizes = shards, shards.sizes
        with torch.no_grad():
            y = shards.reduce_scatter(F.linear(x, weight))
        if bias is None:
            return y
        return y.add_(bias) if bias.dtype == y.dtype else y + bias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        shards = ctx.shards
        whole = all_gather(grad.contiguous(), dim=shards.dim, group=shards.group.handle,
                           sizes=ctx.sizes)
        grad_x = whole.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w, grad_b = weight_grads(ctx, whole, x, grad)  # the bias joined on the slice
        return grad_x, grad_w, grad_b, None


def _refuse_output(module: nn.Module, out: object) -> None:
    raise TypeError(f"SequenceParallel(gather_output=True) on {type(module).__name__}: its "
                    f"output is a {type(out).__name__}; expected a tensor")
