"""Cutting a dense model into contiguous stages, and running one stage.

Three kinds of model are understood:

- an ``nn.Sequential``: stage ``k`` runs a contiguous run of its blocks;
- a transformers causal LM of the Llama family (`HF_MODEL_TYPES`: Llama, Mistral, Qwen2,
  Qwen3): stage ``k`` runs a contiguous run of the decoder layers; the first stage also
  embeds the tokens, the last one also applies the final norm and the LM head;
- a model that lists its own blocks (`has_blocks`): ``model.pipeline_blocks()`` returns
  them in order, each a pair ``(names, fn)``: the dense names of the modules and
  parameters the block holds, and the function that runs it (``x = fn(x)``). The first
  block takes the batch (an embedding), the last gives the output ``loss_fn`` takes.

Every rank builds the same dense model; `prune` deletes the modules of the stages other
ranks run, so that the model keeps its dense names (``"3.weight"``,
``"model.layers.5.mlp.up_proj.weight"``) for the parameters this rank holds.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from tensorpar.errors import CollectiveArgumentError, CollectiveTypeError

__all__ = ["HF_MODEL_TYPES", "Decoder", "StageSpec", "balanced", "decoder_of", "has_blocks",
           "prune", "run_stage", "stage_specs", "tied_parameters"]

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""transformers ``model_type``\\ s whose decoder this module runs stage by stage: those
whose model forward is the embedding, one causal mask per attention kind, the rotary
embedding, the layers, the final norm and the LM head, with nothing scaled in between
(checked against each family's forward; each is tested against dense with its sliding
window reached)."""

_SLIDING_EVERY_LAYER = ("mistral",)
"""Families whose every layer takes the sliding-window mask when ``config.sliding_window``
is set; the others name each layer's kind in ``config.layer_types``."""


class Decoder(NamedTuple):
    """Where a transformers causal LM keeps its parts: its config, decoder and head names."""

    config: Any
    prefix: str  # the decoder's name ("model")
    head: str  # the LM head's name ("lm_head")


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
    if not isinstance(inner, nn.Module) or not hasattr(inner, "layers"):
        raise CollectiveTypeError(
            f"pipeline: the transformers model {type(model).__name__} has no decoder "
            f"'{prefix}.layers'; expected a causal LM such as LlamaForCausalLM")
    return inner


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
                f"pipeline: transformers model_type {model_type!r} is not supported; "
                f"supported: {HF_MODEL_TYPES}")
        inner: Any = _decoder(model)
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
                base = model.base_model_prefix
                extra = ((f"{base}.embed_tokens",) if first else ()) + (
                    (f"{base}.norm", decoder_of(model).head) if last else ())
            specs.append(StageSpec(k, blocks, first, last, blocks + extra))
        start += n
    return specs


def decoder_of(model: nn.Module) -> Decoder:
    """The config, decoder name and LM head name of a transformers causal LM."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    name = next((n for n, c in model._modules.items() if c is head), None)
    if name is None:
        raise CollectiveTypeError(f"pipeline: {type(model).__name__} has no LM head among its "
                                  f"top-level modules; expected a causal LM")
    return Decoder(model.config, str(model.base_model_prefix), name)


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
        spec = next((s for s in specs for h in s.holds
                     if name == h or name.startswith(h + ".")), None)
        if spec is not None:
            holders.setdefault(id(p), {}).setdefault(spec.index % ranks, name)
    tied = {key: sorted(where.items()) for key, where in holders.items() if len(where) > 1}
    for where in tied.values():
        if len(where) > 2:
            raise CollectiveArgumentError(
                f"pipeline: the parameter {where[0][1]!r} is shared by stages on ranks "
                f"{[r for r, _ in where]}; sharing between two ranks is supported")
    return tied


def _mask(config: Any, hidden: torch.Tensor, positions: torch.Tensor, sliding: bool) -> Any:
    from transformers import masking_utils

    create = masking_utils.create_sliding_window_causal_mask if sliding \
        else masking_utils.create_causal_mask
    params = inspect.signature(create).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": None,
                              "position_ids": positions}
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = hidden
    for name in ("cache", "past_key_values"):
        if name in params:
            kwargs[name] = None
    if "cache_position" in params:
        kwargs["cache_position"] = positions[0]
    return create(**kwargs)


def _layer_masks(config: Any, hidden: torch.Tensor, positions: torch.Tensor,
                 layers: Sequence[str]) -> list[Any]:
    """The attention mask of each of ``layers``, as the family's own forward builds it.

    ``layers``: dense names ending in the layer's index. Each mask is full causal or
    sliding-window causal; each kind is built once.
    """
    if config.model_type in _SLIDING_EVERY_LAYER:
        sliding = [getattr(config, "sliding_window", None) is not None] * len(layers)
    else:
        kinds = getattr(config, "layer_types", None)
        sliding = [kinds is not None and kinds[int(name.rsplit(".", 1)[1])] ==
                   "sliding_attention" for name in layers]
    built = {kind: _mask(config, hidden, positions, kind) for kind in set(sliding)}
    return [built[kind] for kind in sliding]


def run_stage(root: nn.Module, spec: StageSpec, x: torch.Tensor, decoder: Decoder | None
              ) -> torch.Tensor:
    """Stage ``spec``'s forward on ``x``, looking its modules up in ``root`` by dense name.

    Looked up at every call, so modules that `tensorpar.parallelize` replaced after the
    pipeline was built are the ones that run (a model that lists its own blocks runs the
    functions it gave). ``decoder`` is ``None`` for an ``nn.Sequential``. The last
    transformers stage returns the logits.
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
    inner: Any = root.get_submodule(decoder.prefix)
    hidden = inner.embed_tokens(x) if spec.first else x  # (B, T, D)
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # (1, T)
    masks = _layer_masks(decoder.config, hidden, positions, spec.blocks)
    rotary = inner.rotary_emb(hidden, position_ids=positions)
    for name, mask in zip(spec.blocks, masks, strict=True):
        layer: Any = root.get_submodule(name)
        out = layer(hidden, attention_mask=mask, position_ids=positions,
                    position_embeddings=rotary)
        hidden = out[0] if isinstance(out, tuple) else out
    if spec.last:
        head: Any = root.get_submodule(decoder.head)
        logits: torch.Tensor = head(inner.norm(hidden))
        return logits  # (B, T, vocab)
    return hidden
