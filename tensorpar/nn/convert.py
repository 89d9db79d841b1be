"""Parallelise an existing dense model from its own weights, following a plan that is data."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import torch
from torch import nn

from tensorpar._group import GroupLike, resolve_group
from tensorpar.functional import broadcast
from tensorpar.nn.embedding import ParallelEmbedding, VocabParallelEmbedding
from tensorpar.nn.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.placeholder import TensorPlaceholder

__all__ = ["Colwise", "EmbeddingDim", "Rowwise", "Vocab", "full_state_dict",
           "load_full_state_dict", "parallelize"]


@dataclass(frozen=True)
class Colwise:
    """Split an ``nn.Linear``'s output features (``ColumnParallelLinear``).

    ``multiple_of`` keeps shard boundaries on multiples of it (e.g. ``head_dim``, so no
    attention head is cut); ``gather_output`` all-gathers the output.
    """

    gather_output: bool = False
    multiple_of: int = 1


@dataclass(frozen=True)
class Rowwise:
    """Split an ``nn.Linear``'s input features (``RowParallelLinear``)."""

    input_is_parallel: bool = True
    multiple_of: int = 1


@dataclass(frozen=True)
class Vocab:
    """Split an ``nn.Embedding``'s rows (``VocabParallelEmbedding``)."""


@dataclass(frozen=True)
class EmbeddingDim:
    """Split an ``nn.Embedding``'s embedding dimension (``ParallelEmbedding``)."""


Style: TypeAlias = Colwise | Rowwise | Vocab | EmbeddingDim
NAMED_STYLES: dict[str, Style] = {"colwise": Colwise(), "rowwise": Rowwise(),
                                  "vocab": Vocab(), "embedding_dim": EmbeddingDim()}


class _Sharded(Protocol):
    def full_state(self, dst: int = 0) -> dict[str, torch.Tensor | TensorPlaceholder]: ...
    def load_full_state(self, state: Mapping[str, Any], src: int = 0) -> None: ...


PARALLEL_TYPES = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                  ParallelEmbedding)


def parallelize(model: nn.Module, plan: Mapping[str, str | Style], *,
                group: GroupLike = None) -> nn.Module:
    """Replace submodules of ``model`` in place with tensor-parallel ones built from their weights.

    The plan maps glob patterns over module names (``"layers.*.attn.q_proj"``) to a style:
    ``"colwise"``, ``"rowwise"``, ``"vocab"``, ``"embedding_dim"`` or a style object with
    options (`Colwise`, `Rowwise`, ...). Only ``nn.Linear`` and ``nn.Embedding``
    submodules are swapped; the model's own forward code is untouched, so it must infer
    per-rank sizes from the tensors (e.g. ``rearrange(q, "b t (h d) -> b h t d", d=64)``).
    Every rank must hold the same dense weights (e.g. the same seed or checkpoint).

    The whole plan is validated first: every pattern must match a module, every matched
    module must be of the type its style splits, and sizes must fit the options. All
    problems are reported together.

    Args:
        model: the dense model (modified in place and returned).
        plan: pattern -> style.
        group: the tensor-parallel group (a ``ProcessGroup`` or 1-D ``DeviceMesh``).

    Returns:
        ``model``.

    Raises:
        ValueError: the plan does not fit the model (every problem listed).

    Example:
        >>> import torch
        >>> import tensorpar
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
        ...                           torch.nn.Linear(8, 4))
        >>> _ = tensorpar.parallelize(mlp, {"0": "colwise", "2": "rowwise"})
        >>> type(mlp[0]).__name__, type(mlp[2]).__name__
        ('ColumnParallelLinear', 'RowParallelLinear')
    """
    size = resolve_group(group, "parallelize").size
    assignments = _validate(model, plan, size)
    for name, style in assignments.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, _build(parent.get_submodule(child), style, group))
    return model


def _validate(model: nn.Module, plan: Mapping[str, str | Style], size: int) -> dict[str, Style]:
    problems: list[str] = []
    assignments: dict[str, Style] = {}
    modules = dict(model.named_modules())
    for pattern, raw in plan.items():
        style = NAMED_STYLES.get(raw) if isinstance(raw, str) else raw
        if style is None or not isinstance(style, (Colwise, Rowwise, Vocab, EmbeddingDim)):
            problems.append(f"{pattern!r}: unknown style {raw!r} (expected one of "
                            f"{sorted(NAMED_STYLES)} or a style object)")
            continue
        matched = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            problems.append(f"{pattern!r} matches no module")
        for name in matched:
            problem = _check(name, modules[name], style, size)
            if problem:
                problems.append(problem)
            elif name in assignments and assignments[name] != style:
                problems.append(f"{name!r} is matched by several patterns with different styles")
            else:
                assignments[name] = style
    if problems:
        raise ValueError("parallelize: the plan does not fit the model:\n  - "
                         + "\n  - ".join(problems))
    return assignments


def _check(name: str, module: nn.Module, style: Style, size: int) -> str | None:
    linear = isinstance(style, (Colwise, Rowwise))
    wanted = nn.Linear if linear else nn.Embedding
    if type(module) is not wanted:
        return (f"{name!r} is a {type(module).__name__}; style {type(style).__name__} splits "
                f"an nn.{wanted.__name__}")
    if isinstance(style, (Colwise, Rowwise)):
        assert isinstance(module, nn.Linear)
        what, n = (("out_features", module.out_features) if isinstance(style, Colwise)
                   else ("in_features", module.in_features))
        if n % style.multiple_of:
            return (f"{name!r}: {what}={n} is not a multiple of multiple_of="
                    f"{style.multiple_of} ({n} % {style.multiple_of} = {n % style.multiple_of})")
        if n // style.multiple_of < size:
            return (f"{name!r}: {what}={n} gives {n // style.multiple_of} units of "
                    f"{style.multiple_of} for {size} ranks; some ranks would hold nothing")
    return None


def _build(module: nn.Module, style: Style, group: GroupLike) -> nn.Module:
    if isinstance(style, Colwise):
        assert isinstance(module, nn.Linear)
        return ColumnParallelLinear.from_dense(module, group=group,
                                               gather_output=style.gather_output,
                                               multiple_of=style.multiple_of)
    if isinstance(style, Rowwise):
        assert isinstance(module, nn.Linear)
        return RowParallelLinear.from_dense(module, group=group,
                                            input_is_parallel=style.input_is_parallel,
                                            multiple_of=style.multiple_of)
    assert isinstance(module, nn.Embedding)
    cls = VocabParallelEmbedding if isinstance(style, Vocab) else ParallelEmbedding
    return cls.from_dense(module, group=group)


def full_state_dict(model: nn.Module, dst: int = 0, *, group: GroupLike = None
                    ) -> dict[str, torch.Tensor | TensorPlaceholder]:
    """The dense model's state dict, with the dense keys, on ``dst``; placeholders elsewhere.

    Sharded parameters are gathered from the tensor-parallel group they live on; replicated
    parameters and buffers are taken from this rank. ``dst`` is a rank of ``group`` (the
    group the sharded layers use). Every rank must call it.
    """
    g = resolve_group(group, "full_state_dict")
    g.check_rank("full_state_dict", "dst", dst)
    out: dict[str, torch.Tensor | TensorPlaceholder] = {}
    sharded = _sharded_modules(model)
    for key, value in model.state_dict(keep_vars=False).items():
        owner, _, leaf = key.rpartition(".")
        if owner in sharded:
            continue
        out[key] = value.clone() if g.rank == dst else \
            TensorPlaceholder.like(value, owner=dst, group=g.handle)
    for name, module in sharded.items():
        for leaf, value in module.full_state(dst).items():
            out[f"{name}.{leaf}" if name else leaf] = value
    return {k: out[k] for k in model.state_dict() if k in out}


def load_full_state_dict(model: nn.Module, state: Mapping[str, Any] | None, src: int = 0, *,
                         group: GroupLike = None) -> None:
    """Load a dense checkpoint held on ``src`` into a parallelised model.

    On ``src``, ``state`` is the dense state dict; other ranks pass ``None`` (or the
    placeholders `full_state_dict` gave them). Sharded parameters are scattered,
    everything else is broadcast. Every rank must call it.
    """
    g = resolve_group(group, "load_full_state_dict")
    g.check_rank("load_full_state_dict", "src", src)
    state = state or {}
    sharded = _sharded_modules(model)
    own = model.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state] if g.rank == src else []
    # src tells every rank how many keys it lacks, so every rank raises together
    count = torch.tensor([len(missing)], device=g.comm_device()) if g.rank == src else None
    shared = broadcast(count, src=src, group=g)
    n_missing = int(shared.item())
    if n_missing:
        raise KeyError(f"load_full_state_dict: the checkpoint on rank {src} lacks "
                       + (str(missing) if missing else f"{n_missing} of this model's keys"))
    for name, module in sharded.items():
        prefix = f"{name}." if name else ""
        module.load_full_state({k[len(prefix):]: v for k, v in state.items()
                                if k.startswith(prefix)}, src)
    with torch.no_grad():
        for key, tensor in own.items():
            if key.rpartition(".")[0] in sharded:
                continue
            tensor.copy_(broadcast(state.get(key), src=src, group=g))


def _sharded_modules(model: nn.Module) -> dict[str, _Sharded]:
    return {n: m for n, m in model.named_modules()
            if isinstance(m, PARALLEL_TYPES)}
