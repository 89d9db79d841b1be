"""Parallelise an existing dense model from its own weights, following a plan that is data."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from tensorpar.collectives.functional import broadcast
from tensorpar.comm._group import GroupLike, resolve_group
from tensorpar.nn.experts import ExpertParallel, ParallelExperts
from tensorpar.nn.hf.checks import check_own_plan, guard_whole_logits
from tensorpar.nn.layers._column_fn import SharedInput
from tensorpar.nn.layers.conv1d import ColumnParallelConv1D, RowParallelConv1D
from tensorpar.nn.layers.embedding import ParallelEmbedding, VocabParallelEmbedding
from tensorpar.nn.layers.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.nn.plans.inplace_styles import INPLACE_STYLES, install
from tensorpar.nn.plans.plan import (
    Builder,
    Colwise,
    PackedColwise,
    Rowwise,
    Style,
    Vocab,
    assign,
    features,
    is_conv1d,
    tied_groups,
)
from tensorpar.nn.plans.sequence_plan import check_sequence, install_sequence
from tensorpar.nn.sequence import SEQUENCE_STYLES
from tensorpar.nn.state._params import tag_model
from tensorpar.nn.state.checkpoint import (
    dense_shapes,
    fsdp_full_state_dict,
    fsdp_load_full_state_dict,
)
from tensorpar.nn.state.replica_check import install_step_hook
from tensorpar.placeholder import TensorPlaceholder
from tensorpar.validation._replica import check_same_weights

__all__ = ["full_state_dict", "load_full_state_dict", "parallelize"]


class _Sharded(Protocol):
    def full_state(self, dst: int = 0) -> dict[str, torch.Tensor | TensorPlaceholder]: ...
    def load_full_state(self, state: Mapping[str, Any], src: int = 0) -> None: ...


PARALLEL_TYPES = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                  ParallelEmbedding, ColumnParallelConv1D, RowParallelConv1D, ParallelExperts)


def parallelize(model: nn.Module, plan: Mapping[str, str | Style], *,
                group: GroupLike = None,
                builders: Mapping[type[nn.Module], Builder] | None = None) -> nn.Module:
    """Replace submodules of ``model`` in place with tensor-parallel ones built from their weights.

    The plan maps patterns over module names (``"layers.*.attn.q_proj"``: each ``*``
    matches one dotted segment, ``**`` any number of them) to a style: ``"colwise"``,
    ``"rowwise"``, ``"vocab"``, ``"embedding_dim"`` or a style object with options
    (`Colwise`, `PackedColwise`, `Rowwise`, ...). ``nn.Linear``, transformers' ``Conv1D``
    and ``nn.Embedding`` submodules (and embeddings that scale their output,
    ``embed_scale``) are swapped, and the classes given in ``builders``; the model's own forward
    code is untouched, so it must infer per-rank sizes from the tensors (e.g.
    ``rearrange(q, "b t (h d) -> b h t d", d=64)``). Every rank must hold the same dense
    weights (e.g. the same seed or checkpoint). This is checked first, on every rank: a hash
    of every parameter and buffer (layers that are already tensor-parallel left out) is
    exchanged as int64s, and a difference raises instead of mixing the ranks' weights.

    The whole plan is validated first, and nothing changes unless all of it fits: every
    pattern must match a module, every matched module must be of the type its style splits,
    sizes must fit the options, the query heads of every attention must sit with their own
    key/value heads (for models whose ``config`` names their heads, as transformers' do),
    and parameters tied in the dense model (an embedding and its LM head) must be split the
    same way: they stay one parameter. All problems are reported together.

    Args:
        model: the dense model (modified in place and returned).
        plan: pattern -> style.
        group: the tensor-parallel group (a ``ProcessGroup`` or 1-D ``DeviceMesh``).
        builders: layer classes tensorpar does not know, each mapped to a function
            ``(dense module, style, group) -> parallel module`` called for every module of
            exactly that class the plan matches (it receives the style as given in the
            plan). tensorpar does not check those modules' sizes; every module is built
            before any is swapped in, so an error in a builder leaves the model unchanged.
            Return tensorpar layers for `full_state_dict` and `sharded_state_dict` to see
            the shards; other modules count as replicated.

    Returns:
        ``model``.

    Raises:
        ValueError: the plan does not fit the model (every problem listed).
        CollectiveArgumentError: the ranks hold different dense weights; names the first
            differing parameter or buffer and which ranks hold which version.

    Example:
        >>> import torch
        >>> import tensorpar
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
        ...                           torch.nn.Linear(8, 4))
        >>> _ = tensorpar.parallelize(mlp, {"0": "colwise", "2": "rowwise"})
        >>> type(mlp[0]).__name__, type(mlp[2]).__name__
        ('ColumnParallelLinear', 'RowParallelLinear')
    """
    builders = dict(builders or {})
    for cls, builder in builders.items():
        if not isinstance(cls, type) or not callable(builder):
            raise TypeError(f"parallelize: builders maps a class to a callable (module, style, "
                            f"group) -> module; got {cls!r}: {builder!r}")
    check_same_weights("parallelize", model, group)  # every rank, before anything changes
    size = resolve_group(group, "parallelize").size
    assignments = assign(model, plan, size, builders)
    by_builder = {n for n in assignments if type(model.get_submodule(n)) in builders}
    problems = check_own_plan(model, {n: s for n, s in assignments.items()
                                      if n not in by_builder}, size)
    if problems:
        raise ValueError("parallelize: the plan contradicts the model's own plan:\n  - "
                         + "\n  - ".join(problems))
    problems = check_sequence(model, assignments)
    if problems:
        raise ValueError("parallelize: the sequence-parallel styles do not fit the model:\n  - "
                         + "\n  - ".join(problems))
    ties = tied_groups(model)
    head = _output_embeddings(model)
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    built = {}
    for name, style in assignments.items():
        module = model.get_submodule(name)
        if isinstance(style, (*INPLACE_STYLES, *SEQUENCE_STYLES)) \
                and type(module) not in builders:
            continue  # stays in place: its parameters get their hooks once all is built
        custom = builders.get(type(module))
        built[name] = custom(module, style, group) if custom else _build(module, style, group)
    for name, new in built.items():
        if not isinstance(new, nn.Module):
            raise TypeError(f"parallelize: the builder for {name!r} "
                            f"({type(model.get_submodule(name)).__name__}) returned "
                            f"{type(new).__name__}; expected an nn.Module")
    for name, new in built.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    _share_inputs(model, built)
    for name, style in assignments.items():
        if isinstance(style, INPLACE_STYLES) and name not in built:
            install(model.get_submodule(name), style, group)
    install_sequence(model, assignments, built, resolve_group(group, "parallelize"))
    for name, style in assignments.items():
        if name == head_name and isinstance(built.get(name), ColumnParallelLinear) \
                and not getattr(style, "gather_output", True):
            guard_whole_logits(model, name)
    for names in ties:  # the checks made sure every name of a tie got the same shard
        owner, _, leaf = names[0].rpartition(".")
        shared = getattr(model.get_submodule(owner), leaf)
        for other in names[1:]:
            owner, _, leaf = other.rpartition(".")
            setattr(model.get_submodule(owner), leaf, shared)
    tag_model(model, resolve_group(group, "parallelize"))  # for clipping and replica checks
    install_step_hook()  # after each optimizer step: replica checks, DCP refusal of shards
    return model


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except NotImplementedError:
        return None
    return head if isinstance(head, nn.Module) else None


def _share_inputs(model: nn.Module, built: dict[str, nn.Module]) -> None:
    """Give the column-parallel siblings of each module one `SharedInput`.

    Siblings such as q/k/v or gate/up projections usually read the same input; sharing
    lets them all-reduce its gradient once. Siblings that read different inputs lose
    nothing: each input gets its own copy. The parent's forward hook clears the share.
    """
    siblings: dict[str, list[ColumnParallelLinear]] = {}
    for name, layer in built.items():
        if isinstance(layer, ColumnParallelLinear):
            siblings.setdefault(name.rpartition(".")[0], []).append(layer)
    for parent, layers in siblings.items():
        if len(layers) > 1:
            share = SharedInput()
            model.get_submodule(parent).register_forward_hook(share.clear, always_call=True)
            for layer in layers:
                layer.input_share = share


def _build(module: nn.Module, style: Style, group: GroupLike) -> nn.Module:
    if isinstance(style, ExpertParallel):
        return ParallelExperts.from_dense(module, group=group, tokens=style.tokens)
    if isinstance(style, (Colwise, PackedColwise)):
        blocks, unit = None, style.multiple_of
        if isinstance(style, PackedColwise):
            blocks = style.block_sizes(features(module)[1])
        if is_conv1d(module):
            return ColumnParallelConv1D.from_dense(module, group=group, blocks=blocks,
                                                   gather_output=style.gather_output,
                                                   multiple_of=unit)
        assert isinstance(module, nn.Linear)
        return ColumnParallelLinear.from_dense(module, group=group, blocks=blocks,
                                               gather_output=style.gather_output,
                                               multiple_of=unit)
    if isinstance(style, Rowwise):
        row = RowParallelConv1D if is_conv1d(module) else RowParallelLinear
        return row.from_dense(module, group=group,  # type: ignore[arg-type]
                              input_is_parallel=style.input_is_parallel,
                              multiple_of=style.multiple_of, reduce_dtype=style.reduce_dtype)
    assert isinstance(module, nn.Embedding)
    cls = VocabParallelEmbedding if isinstance(style, Vocab) else ParallelEmbedding
    return cls.from_dense(module, group=group)


def full_state_dict(model: nn.Module, dst: int = 0, *, group: GroupLike = None
                    ) -> dict[str, Any]:
    """The dense model's state dict, with the dense keys, on ``dst``; placeholders elsewhere.

    Sharded parameters are gathered from the tensor-parallel group they live on; replicated
    parameters and buffers are taken from this rank. ``dst`` is a rank of ``group`` (the
    group the sharded layers use). Every rank must call it. The tensors are copies: the
    model's own storage is never handed out (writing to them leaves the model as it was).
    """
    g = resolve_group(group, "full_state_dict")
    g.check_rank("full_state_dict", "dst", dst)
    if any(hasattr(p, "full_tensor") for p in model.parameters()):  # fully_shard beside TP
        return fsdp_full_state_dict(model, dst, g)
    out: dict[str, Any] = {}
    sharded = _sharded_modules(model)
    for key, value in model.state_dict(keep_vars=False).items():
        owner, _, leaf = key.rpartition(".")
        if owner in sharded:
            continue
        if not isinstance(value, torch.Tensor):  # a module's extra state: its own copy
            out[key] = copy.deepcopy(value)
            continue
        out[key] = value.clone() if g.rank == dst else \
            TensorPlaceholder.like(value, owner=dst, group=g.handle)
    for name, module in sharded.items():
        layer = cast(nn.Module, module)
        own = {t.untyped_storage().data_ptr() for t in layer.state_dict().values()}
        for leaf, value in module.full_state(dst).items():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in own:
                value = value.clone()  # a group of one gathers the shard itself: a copy, as
            out[f"{name}.{leaf}" if name else leaf] = value  # at every other size
    return {k: out[k] for k in model.state_dict() if k in out}


def load_full_state_dict(model: nn.Module, state: Mapping[str, Any] | None, src: int = 0, *,
                         group: GroupLike = None) -> None:
    """Load a dense checkpoint held on ``src`` into a parallelised model.

    On ``src``, ``state`` is the dense state dict; other ranks pass ``None`` (or the
    placeholders `full_state_dict` gave them). Sharded parameters are scattered,
    everything else is broadcast. Every rank must call it. Under ``fully_shard`` (FSDP2
    beside tensor parallelism) ``group`` is the tensor-parallel group: ``src`` of every
    data-parallel replica holds the dense state dict, and each rank keeps the FSDP slice
    its ``DTensor`` holds.

    Raises:
        KeyError: the checkpoint lacks keys of the model (on every rank, naming them on
            ``src``).
        ValueError: it holds keys the model lacks, or a tensor of another shape than the
            dense model's (as ``load_state_dict`` refuses them; on every rank, the model
            left as it was).
    """
    g = resolve_group(group, "load_full_state_dict")
    g.check_rank("load_full_state_dict", "src", src)
    state = state or {}
    sharded = _sharded_modules(model)
    own = model.state_dict(keep_vars=True)
    misfits = _misfits(state, own, dense_shapes(model)) if g.rank == src else ([], [], [])
    # src tells every rank how many problems it found, so every rank raises together
    count = torch.tensor([len(m) for m in misfits], device=g.comm_device()) \
        if g.rank == src else None
    counts = [int(n) for n in broadcast(count, src=src, group=g).tolist()]
    if any(counts):
        _refuse_misfit(misfits, counts, src)
    if any(hasattr(p, "full_tensor") for p in model.parameters()):  # fully_shard beside TP
        fsdp_load_full_state_dict(model, state, src, g)
        return
    for name, module in sharded.items():
        prefix = f"{name}." if name else ""
        module.load_full_state({k[len(prefix):]: v for k, v in state.items()
                                if k.startswith(prefix)}, src)
    extras = []  # a module's extra state (get_extra_state): any picklable object
    with torch.no_grad():
        for key, tensor in own.items():
            if key.rpartition(".")[0] in sharded:
                continue
            if not isinstance(tensor, torch.Tensor):
                extras.append(key)
                continue
            tensor.copy_(broadcast(state.get(key), src=src, group=g))
    if extras:
        values = [state.get(key) for key in extras]
        if not g.is_single:
            dist.broadcast_object_list(values, src=g.global_rank(src), group=g.handle)
        for key, value in zip(extras, values, strict=True):
            model.get_submodule(key.rpartition(".")[0]).set_extra_state(value)


def _misfits(state: Mapping[str, Any], own: Mapping[str, Any],
             shapes: Mapping[str, torch.Size]) -> tuple[list[str], list[str], list[str]]:
    """The keys the checkpoint lacks, those the model lacks, and the shapes that differ."""
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    differ = [f"{k!r}: checkpoint {tuple(v.shape)}, model {tuple(shapes[k])}"
              for k, v in state.items() if k in shapes and isinstance(v, torch.Tensor)
              and tuple(v.shape) != tuple(shapes[k])]
    return missing, unexpected, differ


def _refuse_misfit(misfits: tuple[list[str], list[str], list[str]], counts: list[int],
                   src: int) -> None:
    """Raise what `_misfits` found on ``src`` (named there, counted on the other ranks)."""
    missing, unexpected, differ = misfits
    if not counts[1] and not counts[2]:
        raise KeyError(f"load_full_state_dict: the checkpoint on rank {src} lacks "
                       + (str(missing) if missing else f"{counts[0]} of this model's keys"))
    if not any(misfits):
        raise ValueError(f"load_full_state_dict: the checkpoint on rank {src} does not fit "
                         f"the model ({counts[0]} missing key(s), {counts[1]} unexpected, "
                         f"{counts[2]} of another shape: rank {src}'s error names them)")
    parts = [f"missing keys {missing}"] if missing else []
    parts += [f"unexpected keys {unexpected}"] if unexpected else []
    parts += [f"tensors of another shape than the dense model's: {'; '.join(differ)}"] \
        if differ else []
    raise ValueError(f"load_full_state_dict: the checkpoint on rank {src} does not fit the "
                     f"model: " + "; ".join(parts))


def _sharded_modules(model: nn.Module) -> dict[str, _Sharded]:
    return {n: m for n, m in model.named_modules()
            if isinstance(m, PARALLEL_TYPES)}
