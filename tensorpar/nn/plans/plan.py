"""Parallel plans as data: the styles, how patterns match module names, and the checks.

A plan maps module-name patterns to styles. Everything here runs before `parallelize`
changes anything, on every rank with the same inputs, so a plan that cannot be right
raises the same error everywhere before any computation.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import nn

from tensorpar.collectives._split import balanced_sizes
from tensorpar.comm._group import GroupLike
from tensorpar.nn.experts import ExpertParallel, experts_problem
from tensorpar.nn.plans.inplace_styles import INPLACE_STYLES, MlaKvAProj, PartialGrad, check_inplace
from tensorpar.nn.sequence import SEQUENCE_STYLES, SequenceGather, SequenceParallel, SequenceSplit

__all__ = ["Builder", "Colwise", "EmbeddingDim", "MlaKvAProj", "PackedColwise", "PartialGrad",
           "Rowwise", "SequenceGather", "SequenceParallel", "SequenceSplit", "Style", "Vocab",
           "match_module"]


@dataclass(frozen=True)
class Colwise:
    """Split an ``nn.Linear``'s output features (``ColumnParallelLinear``).

    Attributes:
        gather_output: all-gather the output, so every rank gets all features.
        multiple_of: shard boundaries fall on multiples of this. For attention, the query
            projection takes ``group_size * head_dim`` (the query heads of one key/value
            head stay together) and the key and value projections ``head_dim``.
    """

    gather_output: bool = False
    multiple_of: int = 1


@dataclass(frozen=True)
class PackedColwise:
    """Split a fused projection's output block by block (``ColumnParallelLinear(blocks=...)``).

    For projections whose output is blocks that the model slices apart (``[q; k; v]``,
    ``[gate; up]``): every block is split on its own, balanced in its own unit, and a rank's
    output is its slice of each block, block after block. The model must find the blocks
    in the local output from the tensors (``chunk(2)`` of ``[gate_r; up_r]`` works; slicing at
    positions computed from global sizes does not).

    Attributes:
        blocks: the blocks' sizes (summing to ``out_features``), or their number when they
            are all the same size (``2`` for ``[gate; up]``).
        multiple_of: each block's unit (``(group_size * head_dim, head_dim, head_dim)`` for
            ``[q; k; v]`` with grouped-query attention), or one unit for all blocks.
        gather_output: all-gather the output (in the dense order, blocks unpermuted).

    Example:
        >>> PackedColwise(blocks=(32, 8, 8), multiple_of=(16, 4, 4))
        PackedColwise(blocks=(32, 8, 8), multiple_of=(16, 4, 4), gather_output=False)
    """

    blocks: int | tuple[int, ...]
    multiple_of: int | tuple[int, ...] = 1
    gather_output: bool = False

    def block_sizes(self, out_features: int) -> tuple[int, ...]:
        """The blocks' sizes in an output of ``out_features`` (``blocks`` as a tuple)."""
        if isinstance(self.blocks, int):
            return (out_features // self.blocks,) * self.blocks if self.blocks > 0 else ()
        return self.blocks

    def units(self) -> tuple[int, ...]:
        """One unit per block."""
        n = self.blocks if isinstance(self.blocks, int) else len(self.blocks)
        return (self.multiple_of,) * n if isinstance(self.multiple_of, int) \
            else self.multiple_of


@dataclass(frozen=True)
class Rowwise:
    """Split an ``nn.Linear``'s input features (``RowParallelLinear``).

    Attributes:
        input_is_parallel: the input is already this rank's slice.
        multiple_of: shard boundaries fall on multiples of this.
        reduce_dtype: sum the partial products in this dtype (e.g. ``torch.float32`` for a
            bfloat16 model); ``None``: the parameters' dtype.
    """

    input_is_parallel: bool = True
    multiple_of: int = 1
    reduce_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class Vocab:
    """Split an ``nn.Embedding``'s rows (``VocabParallelEmbedding``).

    Attributes:
        sequence_parallel: start the sequence-parallel region here: the partial lookups
            are reduce-scattered along the sequence (``SequenceSplit``'s dim, 1 by default)
            instead of all-reduced, so each rank gets its slice of the embedded sequence
            (for models that read nothing off the embedding's output before the first
            block; transformers models read its length, so their plans split at the first
            layer instead).
    """

    sequence_parallel: bool = False


@dataclass(frozen=True)
class EmbeddingDim:
    """Split an ``nn.Embedding``'s embedding dimension (``ParallelEmbedding``)."""


Style: TypeAlias = Colwise | PackedColwise | Rowwise | Vocab | EmbeddingDim | ExpertParallel \
    | PartialGrad | MlaKvAProj | SequenceSplit | SequenceGather | SequenceParallel
STYLES = (Colwise, PackedColwise, Rowwise, Vocab, EmbeddingDim, ExpertParallel, *INPLACE_STYLES,
          *SEQUENCE_STYLES)
Builder: TypeAlias = Callable[[nn.Module, Style, GroupLike], nn.Module]
"""Builds the parallel module for a layer class tensorpar does not know: ``(dense module,
style, group) -> module``."""
NAMED_STYLES: dict[str, Style] = {"colwise": Colwise(), "rowwise": Rowwise(),
                                  "vocab": Vocab(), "embedding_dim": EmbeddingDim(),
                                  "partial_grad": PartialGrad(),
                                  "replicated_with_grad_allreduce": PartialGrad(),
                                  "sequence_parallel": SequenceParallel()}
Layout: TypeAlias = "tuple[int, tuple[int, ...]] | None"
"""How a parameter is split: ``(dim, sizes per rank)``, or ``None`` for replicated."""


def match_module(pattern: str, name: str) -> bool:
    """Whether a plan pattern matches a dotted module name, one segment at a time.

    Within a segment the shell wildcards apply (``*``, ``?``, ``[qkv]``); ``*`` never
    crosses a dot, as in DTensor's and transformers' plans. A segment ``**`` matches any
    number of segments, zero included.

    Example:
        >>> match_module("layers.*.q_proj", "layers.0.q_proj")
        True
        >>> match_module("layers.*", "layers.0.q_proj")
        False
        >>> match_module("**.q_proj", "model.layers.0.self_attn.q_proj")
        True
    """
    return _match(pattern.split("."), name.split("."))


def _match(pattern: list[str], name: list[str]) -> bool:
    if not pattern:
        return not name
    if pattern[0] == "**":
        return any(_match(pattern[1:], name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatch.fnmatchcase(name[0], pattern[0]) \
        and _match(pattern[1:], name[1:])


def assign(model: nn.Module, plan: Mapping[str, str | Style], size: int,
           custom: Mapping[type, object] | None = None) -> dict[str, Style]:
    """Every planned module's style, after checking the whole plan (every problem listed).

    Modules whose class is in ``custom`` are built by the user's builder: their type and
    sizes are not checked here, and they cannot keep a tie or take part in head pairing.

    Raises:
        ValueError: a pattern matches nothing, a style is unknown or does not fit its module.
    """
    custom = custom or {}
    problems: list[str] = []
    assignments: dict[str, Style] = {}
    modules = dict(model.named_modules())
    for pattern, raw in plan.items():
        style = NAMED_STYLES.get(raw) if isinstance(raw, str) else raw
        if style is None or not isinstance(style, STYLES):
            problems.append(f"{pattern!r}: unknown style {raw!r} (expected one of "
                            f"{sorted(NAMED_STYLES)} or a style object)")
            continue
        matched = [n for n in modules if n and match_module(pattern, n)]
        if not matched and getattr(model, "stage_group", None) is None:  # a pipeline
            # stage holds part of the model: a pattern may match only other stages' modules
            problems.append(f"{pattern!r} matches no module (a '*' matches one dotted "
                            f"segment; '**' matches any depth)")
        for name in matched:
            problem = None if type(modules[name]) in custom else \
                _check(name, modules[name], style, size)
            if problem:
                problems.append(problem)
            elif name in assignments and assignments[name] != style:
                problems.append(f"{name!r} is matched by several patterns with different styles")
            else:
                assignments[name] = style
    problems += check_heads(model, assignments, size, custom)
    if not problems:
        problems += check_ties(model, assignments, size, custom)
    if problems:
        raise ValueError("parallelize: the plan does not fit the model:\n  - "
                         + "\n  - ".join(problems))
    return assignments


def is_scaled_embedding(module: nn.Module) -> bool:
    """An ``nn.Embedding`` or a subclass whose only change is a scale (``embed_scale``)."""
    return type(module) is nn.Embedding or (isinstance(module, nn.Embedding)
                                            and hasattr(module, "embed_scale"))


def conv1d_class() -> type | None:
    """The ``Conv1D`` class if transformers is loaded (no model can hold one otherwise)."""
    utils = sys.modules.get("transformers.pytorch_utils")
    cls = getattr(utils, "Conv1D", None)
    return cls if isinstance(cls, type) else None


def is_conv1d(module: nn.Module) -> bool:
    """A transformers ``Conv1D``: a linear layer with its weight stored ``(in, out)``."""
    cls = conv1d_class()
    return cls is not None and type(module) is cls


def features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(module):
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        return int(weight.shape[0]), int(weight.shape[1])
    assert isinstance(module, nn.Linear)
    return module.in_features, module.out_features


def _check(name: str, module: nn.Module, style: Style, size: int) -> str | None:
    if isinstance(style, ExpertParallel):
        return experts_problem(name, module)
    if isinstance(style, INPLACE_STYLES):
        return check_inplace(name, module, style)
    if isinstance(style, SEQUENCE_STYLES):
        return None  # any module: checked with the whole plan (`check_sequence`)
    if isinstance(style, (Colwise, Rowwise, PackedColwise)):
        if type(module) is not nn.Linear and not is_conv1d(module):
            return (f"{name!r} is a {type(module).__name__}; style {type(style).__name__} "
                    f"splits an nn.Linear or a transformers Conv1D (register a builder for "
                    f"other classes: parallelize(..., builders=...))")
        n_in, n_out = features(module)
        if isinstance(style, PackedColwise):
            return _check_packed(name, n_out, style, size)
        what, n = ("out_features", n_out) if isinstance(style, Colwise) else ("in_features", n_in)
        return _check_units(name, what, n, style.multiple_of, size)
    if not is_scaled_embedding(module):
        return (f"{name!r} is a {type(module).__name__}; style {type(style).__name__} splits "
                f"an nn.Embedding (or a subclass that only scales its output, embed_scale)")
    return None


def _check_units(name: str, what: str, n: int, unit: int, size: int) -> str | None:
    if unit < 1 or n % unit:
        return (f"{name!r}: {what}={n} is not a multiple of multiple_of={unit} "
                f"({n} % {unit} = {n % unit if unit > 0 else 'undefined'})")
    if n // unit < size:
        return (f"{name!r}: {what}={n} gives {n // unit} units of {unit} for {size} "
                f"ranks; some ranks would hold nothing")
    return None


def _check_packed(name: str, n_out: int, style: PackedColwise, size: int) -> str | None:
    blocks, units = style.block_sizes(n_out), style.units()
    if isinstance(style.blocks, int) and (style.blocks < 1 or n_out % style.blocks):
        return (f"{name!r}: out_features={n_out} does not split into blocks={style.blocks} "
                f"equal blocks")
    if sum(blocks) != n_out:
        return (f"{name!r}: blocks={list(blocks)} sum to {sum(blocks)}; expected "
                f"out_features={n_out}")
    if len(units) != len(blocks):
        return (f"{name!r}: multiple_of={list(units)} gives {len(units)} units for "
                f"{len(blocks)} blocks; expected one per block")
    for i, (n, unit) in enumerate(zip(blocks, units, strict=True)):
        problem = _check_units(name, f"block {i} ({n} features)", n, unit, size)
        if problem:
            return problem
    return None


def layout(style: Style | None, module: nn.Module, leaf: str, size: int) -> Layout:
    """How ``style`` splits ``module``'s parameter ``leaf`` across ``size`` ranks.

    Packed splits are described block by block (sizes per block, then per rank).
    """
    if style is None or isinstance(style, (*INPLACE_STYLES, *SEQUENCE_STYLES)):
        return None
    if isinstance(style, ExpertParallel):  # experts split along dim 0 of every parameter
        return 0, balanced_sizes(getattr(module, leaf).shape[0], size)
    if isinstance(style, (Colwise, Rowwise, PackedColwise)):
        n_in, n_out = features(module)
        if isinstance(style, Rowwise) and leaf != "weight":
            return None  # the row-parallel bias is replicated
        if is_conv1d(module) and leaf == "weight":  # Conv1D stores its weight (in, out)
            dim = 0 if isinstance(style, Rowwise) else 1
        elif leaf == "weight":
            dim = 1 if isinstance(style, Rowwise) else 0
        else:
            dim = 0
        if isinstance(style, PackedColwise):
            return dim, tuple(s * unit for n, unit in zip(style.block_sizes(n_out), style.units(),
                                                          strict=True)
                              for s in balanced_sizes(n // unit, size))
        n, unit = (n_in if isinstance(style, Rowwise) else n_out), style.multiple_of
        return dim, tuple(s * unit for s in balanced_sizes(n // unit, size))
    assert isinstance(module, nn.Embedding)
    dim = 0 if isinstance(style, Vocab) else 1
    return dim, balanced_sizes(module.weight.shape[dim], size)


def _describe(style: Style | None, where: Layout) -> str:
    if style is None or where is None:
        return "replicated" if style is None else f"{type(style).__name__} (replicated)"
    return f"{type(style).__name__} (dim {where[0]}, sizes {list(where[1])})"


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Parameters that are one tensor under several names (``tie_word_embeddings``)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def check_ties(model: nn.Module, assignments: Mapping[str, Style], size: int,
               custom: Mapping[type, object] | None = None) -> list[str]:
    """A tie survives only where every name of the parameter gets the same shard."""
    problems = []
    for group in tied_groups(model):
        layouts = []
        for full in group:
            owner, _, leaf = full.rpartition(".")
            style = assignments.get(owner)
            if style is not None and type(model.get_submodule(owner)) in (custom or {}):
                problems.append(f"tied parameter {full!r} belongs to {owner!r}, which a custom "
                                f"builder parallelises: tensorpar cannot keep the tie through "
                                f"it; untie the parameters or leave {owner!r} out of the plan")
                break
            layouts.append((full, style, layout(style, model.get_submodule(owner), leaf, size)))
        else:
            if len({where for _, _, where in layouts}) == 1:
                continue
            problems.append(
                "tied parameters " + " and ".join(repr(n) for n, _, _ in layouts) + " are one "
                "tensor in the dense model but would be split differently: "
                + "; ".join(f"{n.rpartition('.')[0]!r} as {_describe(s, w)}"
                            for n, s, w in layouts)
                + ". Give them the same split (e.g. 'vocab' and 'colwise'), or untie them first")
    return problems


def check_heads(model: nn.Module, assignments: Mapping[str, Style], size: int,
                custom: Mapping[type, object] | None = None) -> list[str]:
    """Every rank's query heads must sit with their own key/value heads (GQA).

    Applies to models that describe their attention in ``model.config`` (transformers'
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``) and name the projections
    ``q_proj``/``k_proj``/``v_proj``/``o_proj``.
    """
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads % kv_heads:
        return []
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # type: ignore[union-attr]
    group = heads // kv_heads
    qkv = ("q_proj", "k_proj", "v_proj")
    problems = []
    for name, module in model.named_modules():
        if not all(type(getattr(module, p, None)) is nn.Linear for p in qkv) or any(
                type(getattr(module, p, None)) in (custom or {}) for p in (*qkv, "o_proj")):
            continue
        styles = [assignments.get(f"{name}.{p}") for p in qkv]
        if all(isinstance(s, Colwise) and s.gather_output for s in styles):
            o_style = assignments.get(f"{name}.o_proj")
            if isinstance(o_style, Rowwise) and o_style.input_is_parallel:
                problems.append(f"{name + '.o_proj'!r}: the attention runs on whole heads "
                                f"(q/k/v projections gather their output), so o_proj must "
                                f"split its input: Rowwise(input_is_parallel=False); got "
                                f"{o_style}")
            continue
        where = [layout(s, getattr(module, p), "weight", size) for s, p in zip(styles, qkv,
                                                                               strict=True)]
        if where == [None, None, None]:
            continue
        q, k, v = (_heads(w, head_dim) for w in where)
        if q is None or k is None or k != v or q != [group * n for n in k]:
            if k is not None and where[1] == where[2]:  # k and v alike: say it once
                split = (f"{_describe_heads('q_proj', where[0], head_dim)}, key/value heads "
                         f"{k} (k_proj and v_proj)")
            else:
                split = ", ".join(_describe_heads(p, w, head_dim)
                                  for p, w in zip(qkv, where, strict=True))
            problems.append(
                f"{name!r}: per rank, query heads and key/value heads do not pair up: {split} "
                f"({heads} query heads, {kv_heads} key/value heads: {group} query heads per "
                f"key/value head; head_dim {head_dim}; {size} ranks). Split q_proj with "
                f"Colwise(multiple_of={group * head_dim}), k_proj and v_proj with "
                f"Colwise(multiple_of={head_dim}) and o_proj with Rowwise(multiple_of="
                f"{group * head_dim}), or use tensorpar.nn.plan_from_transformers(model)")
            continue
        o_proj = getattr(module, "o_proj", None)
        if isinstance(o_proj, nn.Linear):
            o_style = assignments.get(f"{name}.o_proj")
            o_where = layout(o_style, o_proj, "weight", size)
            if not isinstance(o_style, Rowwise) or o_where is None \
                    or o_where[1] != where[0][1]:  # type: ignore[index]
                problems.append(
                    f"{name + '.o_proj'!r} must be split like the query heads, "
                    f"Rowwise(multiple_of={group * head_dim}); got {_describe(o_style, o_where)}")
    return problems


def _describe_heads(proj: str, where: Layout, head_dim: int) -> str:
    """How ``proj`` is split, in heads per rank where it can be (`check_heads`' message)."""
    kind = {"q_proj": "query", "k_proj": "key", "v_proj": "value"}[proj]
    if where is None:
        return f"{proj} replicated (every {kind} head on every rank)"
    if where[0] != 0:
        return f"{proj} split along its input features {list(where[1])}"
    if any(n % head_dim for n in where[1]):
        return f"{proj} split into rows {list(where[1])}, not whole heads of {head_dim}"
    return f"{kind} heads {[n // head_dim for n in where[1]]} ({proj})"


def _heads(where: Layout, head_dim: int) -> list[int] | None:
    """Heads per rank of a column split, or None (replicated, or not on head boundaries)."""
    if where is None or where[0] != 0 or any(s % head_dim for s in where[1]):
        return None
    return [s // head_dim for s in where[1]]
