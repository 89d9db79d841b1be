"""Multi-head latent attention (DeepSeek-V2/V3 and their kin) in `plan_from_transformers`."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from tensorpar.nn.plans.plan import Colwise, MlaKvAProj, Rowwise, Style, match_module

# the projections tensorpar splits by head itself, whatever the model's tp_plan says
_SPLIT = ("q_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
# left whole on every rank: the low-rank down-projections and their norms see the whole
# input, and a sparse-attention indexer reads only replicated tensors (the hidden states and
# the query latent) and returns positions
_WHOLE = ("q_a_proj", "q_a_layernorm", "kv_a_layernorm", "indexer")


def is_mla(config: Any, modules: list[str]) -> bool:
    """DeepSeek-style latent attention: the config's sizes and the modules that use them."""
    sizes = all(isinstance(getattr(config, k, None), int)
                for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    return sizes and bool(_attentions(modules))


def _attentions(modules: list[str]) -> list[str]:
    """The latent attention modules (a hybrid model's other layers hold none).

    Those holding ``kv_a_proj_with_mqa`` and ``kv_b_proj`` beside ``o_proj`` and a query
    projection.
    """
    names = set(modules)
    return sorted(a for a in {n.rpartition(".")[0] for n in modules if n.endswith(".kv_b_proj")}
                  if {f"{a}.kv_a_proj_with_mqa", f"{a}.o_proj"} <= names
                  and {f"{a}.q_proj", f"{a}.q_b_proj"} & names)


def mla_plan(model: nn.Module, config: Any, prefix: str, entries: dict[str, str],
             reduce_dtype: torch.dtype | None) -> tuple[dict[str, Style], dict[str, str]]:
    """Multi-head latent attention, split by head; and the ``tp_plan`` entries left over.

    The up-projections (``q_b_proj`` or ``q_proj``, ``kv_b_proj``) are split by head and
    ``o_proj`` like them; the low-rank down-projections and their norms stay replicated.
    The rotary key, shared by every head, leaves ``kv_a_proj_with_mqa`` without passing a
    split layer: `MlaKvAProj` sums its gradient. Only the modules that hold a latent
    attention are planned (a hybrid model's linear-attention layers also have an
    ``o_proj``). The model's own entries for the split projections are dropped; its
    entries for the attention's other modules (a per-head gate, a norm of the rotary key)
    are kept, and an attention module holding anything else is refused.

    Raises:
        ValueError: a latent attention module holds a module with parameters that neither
            tensorpar nor the model's ``tp_plan`` places.
    """
    modules = [n for n, _ in model.named_modules()]
    attentions = _attentions(modules)
    rest = {p: raw for p, raw in entries.items()
            if not (p.rpartition(".")[2] in _SPLIT
                    and any(match_module(prefix + p, n) for n in modules
                            if n.rpartition(".")[0] in attentions))}
    for attn in attentions:
        extra = [c for c, child in model.get_submodule(attn).named_children()
                 if c not in _SPLIT + _WHOLE and any(True for _ in child.parameters())
                 and not any(match_module(prefix + p, f"{attn}.{c}") for p in rest)]
        if extra:
            raise ValueError(f"plan_from_transformers: {config.model_type}: {attn!r} holds "
                             f"{extra} beside its latent attention, which tensorpar splits "
                             f"by head, and the model's tp_plan does not say how they follow "
                             f"the heads; write a plan by hand (see parallelize)")
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    kv = config.qk_nope_head_dim + config.v_head_dim
    names = set(modules)
    queries = {a: "q_b_proj" if f"{a}.q_b_proj" in names else "q_proj" for a in attentions}
    # one pattern per stack of layers (``model.layers.*.self_attn``) where it names exactly
    # the latent attentions, the attentions' own names otherwise
    wild = {re.sub(r"\.\d+(?=\.|$)", ".*", a[len(prefix):]) for a in attentions}
    matched = {n for n in modules for w in wild if match_module(prefix + w, n)}
    if matched == set(attentions) and len(set(queries.values())) == 1:
        queries = {prefix + w: queries[attentions[0]] for w in sorted(wild)}
    plan: dict[str, Style] = {}
    for attn, q in queries.items():
        plan.update({f"{attn}.{q}": Colwise(multiple_of=qk),
                     f"{attn}.kv_a_proj_with_mqa": MlaKvAProj(rope_dim=config.qk_rope_head_dim),
                     f"{attn}.kv_b_proj": Colwise(multiple_of=kv),
                     f"{attn}.o_proj": Rowwise(multiple_of=config.v_head_dim,
                                               reduce_dtype=reduce_dtype)})
    return plan, rest
