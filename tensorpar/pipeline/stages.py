"""Cutting a dense model into contiguous stages, and running one stage.

Three kinds of model are understood:

- an ``nn.Sequential``: stage ``k`` runs a contiguous run of its blocks;
- a transformers causal LM of a family listed in `HF_MODEL_TYPES`: stage ``k`` runs a
  contiguous run of the decoder layers; the first stage also embeds the tokens, the last one
  also applies the final norm and the LM head (`tensorpar.pipeline.decoder` runs them);
- a model that lists its own blocks (`has_blocks`): ``model.pipeline_blocks()`` returns
  them in order, each a pair ``(names, fn)``: the dense names of the modules and
  parameters the block holds, and the function that runs it (``x = fn(x)``). The first
  block takes the batch (an embedding), the last gives the output ``loss_fn`` takes.

Every rank builds the same dense model; `prune` deletes the modules of the stages other
ranks run, so that the model keeps its dense names (``"3.weight"``,
``"model.layers.5.mlp.up_proj.weight"``) for the parameters this rank holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tensorpar.errors import CollectiveArgumentError, CollectiveTypeError
from tensorpar.pipeline.decoder import (
    HF_MODEL_TYPES,
    LAYER_OUTPUTS,
    Decoder,
    Elsewhere,
    run_decoder_stage,
)

__all__ = ["HF_MODEL_TYPES", "Decoder", "StageSpec", "balanced", "decoder_of", "ends",
           "has_blocks", "prune", "run_stage", "stage_specs", "tied_parameters"]

@dataclass(frozen=True)
class StageSpec:
    """What stage ``index`` runs: the dense names of its blocks (or decoder layers).

    Attributes:
        index: the global (virtual) stage index.
        blocks: the dense module names it runs in order (``"3"``, ``"model.layers.5"``).
        first: it embeds the tokens (transformers) / takes the batch.
        last: it applies the head (transformers) and the loss.
        holds: every dense name (module or parameter) that lives with this stage: its
            blocks, and the embedding / norm and head of a transformers model.
        calls: the functions it runs in order, for a model that lists its own blocks
            (``None``: the blocks are looked up by name).
    """

    index: int
    blocks: tuple[str, ...]
    first: bool
    last: bool
    holds: tuple[str, ...] = ()
    calls: tuple[Callable[[torch.Tensor], torch.Tensor], ...] | None = field(
        default=None, compare=False, repr=False)


def balanced(total: int, parts: int) -> list[int]:
    """Sizes of ``torch.tensor_split(range(total), parts)`` (the first ones one longer).

    Example:
        >>> balanced(7, 3)
        [3, 2, 2]
    """
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def is_transformers(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (checked without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def has_blocks(model: nn.Module) -> bool:
    """``model`` lists its own pipeline blocks (a ``pipeline_blocks`` method)."""
    return callable(getattr(model, "pipeline_blocks", None))


def _own_blocks(model: nn.Module) -> list[tuple[tuple[str, ...], Callable[..., Any]]]:
    """``model.pipeline_blocks()``, checked: ``(names, fn)`` pairs, names that exist."""
    blocks = list(model.pipeline_blocks())  # type: ignore[operator]
    known = {n for n, _ in model.named_modules(remove_duplicate=False)} | \
        {n for n, _ in model.named_parameters(remove_duplicate=False)} | \
        {n for n, _ in model.named_buffers(remove_duplicate=False)}
    out = []
    for i, block in enumerate(blocks):
        ok = isinstance(block, tuple) and len(block) == 2 and callable(block[1])
        names = (block[0],) if ok and isinstance(block[0], str) else block[0] if ok else None
        if not ok or not isinstance(names, (tuple, list)) or not all(
                isinstance(n, str) and n in known for n in names):
            raise CollectiveTypeError(
                f"pipeline: {type(model).__name__}.pipeline_blocks() item {i} is {block!r}; "
                f"expected (names, fn): names of the model's modules or parameters, and a "
                f"function of the block's input")
        out.append((tuple(names), block[1]))
    return out


def _decoder(model: nn.Module) -> nn.Module:
    prefix = getattr(model, "base_model_prefix", "model")
    inner = getattr(model, prefix, None)
    if not isinstance(inner, nn.Module) or not isinstance(getattr(inner, "layers", None),
                                                           nn.ModuleList):
        raise CollectiveTypeError(
            f"pipeline: the transformers model {type(model).__name__} has no decoder "
            f"'{prefix}.layers'; expected a causal LM such as LlamaForCausalLM")
    return inner


def ends(model: nn.Module) -> tuple[str, tuple[str, ...]]:
    """A transformers causal LM's embedding (first stage) and what the last stage holds.

    The last stage holds every module with parameters that is neither the embedding nor a
    decoder layer (the final norm, the LM head), and the decoder's and model's own
    parameters. Modules without parameters (rotary tables) stay with every stage: each
    stage's forward builds its own.
    """
    inner = _decoder(model)
    base = str(model.base_model_prefix)
    embedding = model.get_input_embeddings()  # type: ignore[operator]
    opening = next((n for n, m in model.named_modules() if m is embedding), None)
    if opening is None:
        raise CollectiveTypeError(f"pipeline: {type(model).__name__} has no input embedding "
                                  f"among its modules; expected a causal LM")
    closing = [f"{base}.{n}" for n, m in inner.named_children()
               if n != "layers" and m is not embedding and any(True for _ in m.parameters())]
    closing += [n for n, m in model.named_children()
                if m is not inner and any(True for _ in m.parameters())]
    closing += [f"{base}.{n}" for n in inner._parameters] + list(model._parameters)
    return opening, tuple(closing)


def stage_specs(model: nn.Module, stages: int, split: Sequence[int] | None) -> list[StageSpec]:
    """The blocks of each of ``stages`` stages (``split``: blocks per stage, or balanced).

    Raises:
        CollectiveTypeError: ``model`` is neither an ``nn.Sequential`` nor a supported
            transformers causal LM.
        CollectiveArgumentError: ``split`` has the wrong length or total, or a stage would
            get no block.
    """
    own = None
    if isinstance(model, nn.Sequential):
        names = list(model._modules)
        what = "blocks of the nn.Sequential"
        prefix = ""
    elif has_blocks(model):
        own = _own_blocks(model)
        names = [str(i) for i in range(len(own))]
        what = f"blocks of {type(model).__name__}.pipeline_blocks()"
        prefix = ""
    elif is_transformers(model):
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in HF_MODEL_TYPES:
            raise CollectiveTypeError(
                f"pipeline: transformers model_type {model_type!r} is not among the families "
                f"tested stage by stage (tensorpar.pipeline.stages.HF_MODEL_TYPES); give the "
                f"model a pipeline_blocks() method to cut it yourself")
        inner: Any = _decoder(model)
        opening, closing = ends(model)
        names = list(inner.layers._modules)
        what = "decoder layers"
        prefix = f"{model.base_model_prefix}.layers."
    else:
        raise CollectiveTypeError(
            f"pipeline: model must be an nn.Sequential, a transformers causal LM or a model "
            f"with pipeline_blocks(), got {type(model).__name__}")
    if split is None:
        if len(names) < stages:
            raise CollectiveArgumentError(
                f"pipeline: {len(names)} {what} cannot fill {stages} stages "
                f"(pipeline ranks x virtual_stages); each stage needs at least one")
        sizes = balanced(len(names), stages)
    else:
        sizes = list(split)
        if len(sizes) != stages or sum(sizes) != len(names) or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise CollectiveArgumentError(
                f"pipeline: split={list(split)} must give {stages} stage sizes >= 1 that add up "
                f"to the {len(names)} {what}")
    specs, start = [], 0
    for k, n in enumerate(sizes):
        first, last = k == 0, k == stages - 1
        if own is not None:
            mine = own[start:start + n]
            held = tuple(name for block_names, _ in mine for name in block_names)
            specs.append(StageSpec(k, held, first, last, held, tuple(fn for _, fn in mine)))
        else:
            blocks = tuple(prefix + name for name in names[start:start + n])
            extra: tuple[str, ...] = ()
            if prefix:  # transformers: the embedding, the final norm and the LM head
                extra = ((opening,) if first else ()) + (closing if last else ())
            specs.append(StageSpec(k, blocks, first, last, blocks + extra))
        start += n
    return specs


def decoder_of(model: nn.Module) -> Decoder:
    """What running the stages of a transformers causal LM needs (before `prune`)."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    name = next((n for n, c in model._modules.items() if c is head), None)
    if name is None:
        raise CollectiveTypeError(f"pipeline: {type(model).__name__} has no LM head among its "
                                  f"top-level modules; expected a causal LM")
    embedding: Any = model.get_input_embeddings()  # type: ignore[operator]
    layers: Any = _decoder(model).layers
    outputs = LAYER_OUTPUTS.get(str(getattr(model.config, "model_type", "")), 1)
    return Decoder(model, str(model.base_model_prefix), name, int(embedding.weight.shape[-1]),
                   tuple(Elsewhere(layer, outputs) for layer in layers), {})


def prune(model: nn.Module, kept: Sequence[StageSpec], specs: Sequence[StageSpec]) -> None:
    """Delete, in place, what the stages not in ``kept`` hold (and no kept stage holds)."""
    keep = {name for spec in kept for name in spec.holds}
    for name in dict.fromkeys(n for spec in specs for n in spec.holds):
        if name in keep:
            continue
        parent, _, leaf = name.rpartition(".")
        try:
            owner = model.get_submodule(parent)
        except AttributeError:  # inside something deleted already
            continue
        for table in (owner._modules, owner._parameters, owner._buffers):
            table.pop(leaf, None)


def tied_parameters(model: nn.Module, specs: Sequence[StageSpec], ranks: int
                    ) -> dict[int, list[tuple[int, str]]]:
    """Parameters held by stages on different ranks (a tied embedding and LM head).

    Returns, for each such parameter (by ``id``), the ``(rank, dense name)`` of each
    holder, lowest rank first.

    Raises:
        CollectiveArgumentError: a parameter shared by stages on more than two ranks.
    """
    holders: dict[int, dict[int, str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        for spec in specs:  # every stage that holds it: one name may be listed twice
            if any(name == h or name.startswith(h + ".") for h in spec.holds):
                holders.setdefault(id(p), {}).setdefault(spec.index % ranks, name)
    tied = {key: sorted(where.items()) for key, where in holders.items() if len(where) > 1}
    for where in tied.values():
        if len(where) > 2:
            raise CollectiveArgumentError(
                f"pipeline: the parameter {where[0][1]!r} is shared by stages on ranks "
                f"{[r for r, _ in where]}; sharing between two ranks is supported")
    return tied


def run_stage(root: nn.Module, spec: StageSpec, x: torch.Tensor, decoder: Decoder | None,
              model_inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Stage ``spec``'s forward on ``x``, looking its modules up in ``root`` by dense name.

    Looked up at every call, so modules that `tensorpar.parallelize` replaced after the
    pipeline was built are the ones that run (a model that lists its own blocks runs the
    functions it gave). ``decoder`` is ``None`` for an ``nn.Sequential``. The last
    transformers stage returns the logits; ``model_inputs`` (an attention mask, positions)
    go to a transformers model's forward.
    """
    if spec.calls is not None:
        for fn in spec.calls:
            x = fn(x)
        return x
    if decoder is None:
        for name in spec.blocks:
            block: Any = root.get_submodule(name)
            x = block(x)
        return x
    return run_decoder_stage(root, spec.blocks, spec.first, spec.last, x, decoder,
                             model_inputs or {})
