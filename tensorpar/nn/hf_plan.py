"""Plans for Hugging Face transformers models, read off the model's own config and ``tp_plan``."""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from torch import nn

from tensorpar.nn.plan import Colwise, Rowwise, Style, Vocab

__all__ = ["plan_from_transformers"]

LMHead = Literal["vocab_parallel", "gathered"]

# transformers' tp_plan styles that tensorpar cannot honour yet, with what the model needs
_UNSUPPORTED = {
    "colwise_gather_output": "fused projections (e.g. Phi-3's qkv_proj and gate_up_proj) need "
                             "a packed layout, which tensorpar does not provide yet",
    "rowwise_split_input": "fused projections (e.g. Phi-3's qkv_proj and gate_up_proj) need "
                           "a packed layout, which tensorpar does not provide yet",
}
_LEFT_REPLICATED = ("packed_colwise", "moe_tp_experts", "ep_router", "grouped_gemm",
                    "local_colwise", "local_rowwise", "local_packed_rowwise", "gather")


def plan_from_transformers(model: nn.Module, *, lm_head: LMHead = "vocab_parallel",
                           reduce_dtype: torch.dtype | None = None) -> dict[str, Style]:
    """A tensor-parallel plan for a transformers model, from its config and ``tp_plan``.

    The attention projections are split by head so that every rank's query heads sit with
    their own key/value heads (grouped-query attention: ``q_proj`` in units of
    ``group_size * head_dim``, ``k_proj``/``v_proj`` in units of ``head_dim``, ``o_proj``
    like ``q_proj``); key/value heads may be uneven across ranks but there must be at least
    one per rank. The MLP follows the model's ``tp_plan``; mixture-of-experts blocks are left
    replicated (with a warning). The input embedding is split by vocabulary, and so is the
    LM head: tied weights stay tied.

    Args:
        model: a transformers model (``LlamaForCausalLM``, ``MistralModel``, ...).
        lm_head: ``"vocab_parallel"``: each rank keeps its slice of the logits, for
            training with `vocab_parallel_cross_entropy`; ``"gathered"``: every rank gets
            the full logits, for ``generate()`` and ``model(ids, labels=...)``.
        reduce_dtype: the row-parallel layers' `Rowwise.reduce_dtype` (e.g.
            ``torch.float32`` for a bfloat16 model).

    Returns:
        A plan for `parallelize` (module pattern -> style).

    Raises:
        TypeError: ``model`` has no transformers config.
        ValueError: an architecture or layer that tensorpar cannot parallelise (named), or
            an unknown ``lm_head``.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                      num_hidden_layers=1, num_attention_heads=4,
        ...                      num_key_value_heads=2, head_dim=4)
        >>> plan = plan_from_transformers(LlamaForCausalLM(config))
        >>> plan["model.layers.*.self_attn.q_proj"], plan["model.layers.*.self_attn.k_proj"]
        (Colwise(gather_output=False, multiple_of=8), Colwise(gather_output=False, multiple_of=4))
    """
    fn = "plan_from_transformers"
    if lm_head not in ("vocab_parallel", "gathered"):
        raise ValueError(f"{fn}: lm_head={lm_head!r}; expected 'vocab_parallel' or 'gathered'")
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise TypeError(f"{fn}: expected a transformers model with a .config, got "
                        f"{type(model).__name__}")
    arch = config.model_type
    base_plan: dict[str, str] | None = getattr(config, "base_model_tp_plan", None)
    if not base_plan:
        raise ValueError(f"{fn}: no tensor-parallel plan is known for model_type {arch!r} "
                         f"({type(model).__name__}); write one by hand (see parallelize)")
    heads, kv_heads, head_dim = _heads(config)
    group = heads // kv_heads
    prefix = _base_prefix(model)
    plan: dict[str, Style] = {}
    replicated = []
    for pattern, raw in base_plan.items():
        leaf = pattern.rpartition(".")[2]
        if raw in _UNSUPPORTED:
            raise ValueError(f"{fn}: {arch} cannot be parallelised yet: {pattern!r} is "
                             f"{raw!r}: {_UNSUPPORTED[raw]}")
        if raw in _LEFT_REPLICATED or ".experts" in pattern:
            replicated.append(pattern)
            continue
        if raw not in ("colwise", "rowwise"):
            raise ValueError(f"{fn}: {arch}'s tp_plan entry {pattern!r}: {raw!r} is a style "
                             f"tensorpar does not know")
        if leaf in ("query_key_value", "c_attn", "qkv_proj", "Wqkv"):
            raise ValueError(f"{fn}: {arch}'s {leaf} is a fused query/key/value projection; "
                             f"it needs a packed layout, which tensorpar does not provide yet")
        plan[prefix + pattern] = _style(leaf, raw, group, head_dim, reduce_dtype)
    if replicated:
        warnings.warn(f"{fn}: {arch}: {replicated} are left replicated (mixture-of-experts "
                      f"layers are not split by tensorpar yet); they compute the dense result "
                      f"on every rank", stacklevel=2)
    names = {id(m): n for n, m in model.named_modules()}
    embed = _embeddings(model, "get_input_embeddings")
    if embed is not None:
        plan[names[id(embed)]] = Vocab()
    head = _embeddings(model, "get_output_embeddings")
    if isinstance(head, nn.Linear) and id(head) in names:
        plan[names[id(head)]] = Colwise(gather_output=lm_head == "gathered")
    return plan


def _heads(config: Any) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % kv_heads:
        raise ValueError(f"plan_from_transformers: {heads} query heads do not divide into "
                         f"{kv_heads} key/value heads")
    return heads, kv_heads, head_dim


def _style(leaf: str, raw: str, group: int, head_dim: int, reduce_dtype: torch.dtype | None
           ) -> Style:
    if leaf == "q_proj":
        return Colwise(multiple_of=group * head_dim)
    if leaf in ("k_proj", "v_proj"):
        return Colwise(multiple_of=head_dim)
    if leaf == "o_proj":
        return Rowwise(multiple_of=group * head_dim, reduce_dtype=reduce_dtype)
    return Colwise() if raw == "colwise" else Rowwise(reduce_dtype=reduce_dtype)


def _base_prefix(model: nn.Module) -> str:
    """``"model."`` for a task model (``LlamaForCausalLM.model``), ``""`` for the base model."""
    name = getattr(model, "base_model_prefix", "")
    inner = getattr(model, name, None) if name else None
    return f"{name}." if isinstance(inner, nn.Module) and inner is not model else ""


def _embeddings(model: nn.Module, getter: str) -> nn.Module | None:
    get = getattr(model, getter, None)
    if get is None:
        return None
    try:
        module = get()
    except NotImplementedError:
        return None
    return module if isinstance(module, nn.Module) else None
