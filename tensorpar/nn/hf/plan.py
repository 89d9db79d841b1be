"""Plans for Hugging Face transformers models, read off the model's own config and ``tp_plan``."""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from torch import nn

from tensorpar.nn.hf.experts import ExpertsMode, check_experts_mode, expert_parallel_plan
from tensorpar.nn.hf.mla import is_mla, mla_plan
from tensorpar.nn.hf.sequence import sequence_parallel_plan
from tensorpar.nn.plans.plan import (
    Colwise,
    EmbeddingDim,
    PackedColwise,
    PartialGrad,
    Rowwise,
    Style,
    Vocab,
    match_module,
    tied_groups,
)

__all__ = ["plan_from_transformers"]

LMHead = Literal["vocab_parallel", "gathered"]

_LEFT_REPLICATED = ("packed_colwise", "moe_tp_experts", "ep_router", "grouped_gemm",
                    "local_colwise", "local_rowwise", "local_packed_rowwise", "gather")


def plan_from_transformers(model: nn.Module, *, lm_head: LMHead = "vocab_parallel",
                           reduce_dtype: torch.dtype | None = None,
                           experts: ExpertsMode = "replicated",
                           sequence_parallel: bool | Literal["regather"] = False
                           ) -> dict[str, Style]:
    """A tensor-parallel plan for a transformers model, from its config and ``tp_plan``.

    The attention projections are split by head so that every rank's query heads sit with
    their own key/value heads (grouped-query attention: ``q_proj`` in units of
    ``group_size * head_dim``, ``k_proj``/``v_proj`` in units of ``head_dim``, ``o_proj``
    like ``q_proj``); key/value heads may be uneven across ranks but there must be at least
    one per rank. The MLP follows the model's ``tp_plan``; mixture-of-experts blocks are left
    replicated (with a warning). The input embedding is split by vocabulary, and so is the
    LM head: tied weights stay tied (an LM head whose bias is tied to another parameter,
    as in BERT's masked-LM head, stays replicated with its embedding).

    Fused projections: GPT-NeoX's ``query_key_value`` (``[q, k, v]`` per head) is split by
    whole heads; Phi-3's ``gate_up_proj`` is split block by block (`PackedColwise`).
    Where the model's forward slices a fused output at positions computed from global
    sizes (Phi-3's ``qkv_proj``, GPT-2's ``c_attn``), the projection's output is gathered and
    the output projection splits its input, as transformers' own plans do: the weights are
    split, the attention itself runs whole on every rank. BERT has no ``tp_plan``; tensorpar
    splits its self-attention by head and its MLP.

    Args:
        model: a transformers model (``LlamaForCausalLM``, ``MistralModel``, ...).
        lm_head: ``"vocab_parallel"``: each rank keeps its slice of the logits, for
            training with `vocab_parallel_cross_entropy`; ``"gathered"``: every rank gets
            the full logits, for ``generate()`` and ``model(ids, labels=...)``.
        reduce_dtype: the row-parallel layers' `Rowwise.reduce_dtype` (e.g.
            ``torch.float32`` for a bfloat16 model).
        experts: ``"replicated"``: mixture-of-experts layers stay whole on every rank;
            ``"expert_parallel"``: each rank holds a block of the experts (`ExpertParallel`)
            and the shared experts are split like an MLP (see `expert_parallel_plan`).
        sequence_parallel: also shard the activations between the split layers along the
            sequence (see `tensorpar.nn.sequence`): from the first decoder layer's input to
            the last norm's output, norms and residual adds run on this rank's slice, and
            each all-reduce becomes a reduce-scatter and an all-gather. Any sequence length.
            ``"regather"``: the same, and the attention and MLP keep only the slice of
            their input for backward, where they all-gather it again (less memory, one
            more all-gather each; `SequenceGather`'s ``regather``).

    Returns:
        A plan for `parallelize` (module pattern -> style).

    Raises:
        TypeError: ``model`` has no transformers config.
        ValueError: an architecture or layer that tensorpar cannot parallelise (named), an
            unknown ``lm_head``, or ``sequence_parallel`` on a model it does not cover
            (encoder-decoder, mixture-of-experts, latent or whole-head attention).

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
    check_experts_mode(fn, experts)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise TypeError(f"{fn}: expected a transformers model with a .config, got "
                        f"{type(model).__name__}")
    arch = config.model_type
    base_plan: dict[str, str] | None = getattr(config, "base_model_tp_plan", None)
    if arch in ("t5", "mt5"):
        if sequence_parallel:
            sequence_parallel_plan(model, {}, "")  # refuses encoder-decoder models
        _warn_of_shared_masks(fn, config, sequence_parallel)
        return _with_embeddings(model, _t5(model, reduce_dtype), lm_head)
    if not base_plan and arch not in _OWN_PLANS:
        raise ValueError(f"{fn}: no tensor-parallel plan is known for model_type {arch!r} "
                         f"({type(model).__name__}); write one by hand (see parallelize)")
    try:
        heads, kv_heads, head_dim = _heads(config)
    except Exception as e:  # e.g. a config whose sizes vary per layer refuses the reads
        raise ValueError(f"{fn}: {arch}: the config gives no single head count and head "
                         f"size ({type(e).__name__}: {e}); tensorpar plans models whose layers "
                         f"share them") from e
    group = heads // kv_heads
    prefix = _base_prefix(model)
    plan: dict[str, Style] = {}
    replicated = []
    own = _OWN_PLANS.get(arch)
    if own is not None:
        plan = {prefix + k: v for k, v in own(config, head_dim, reduce_dtype).items()}
    entries = dict({} if own is not None else base_plan or {})
    local = [p for p, raw in entries.items() if raw == "local_params"]
    if local:
        raise ValueError(f"{fn}: {arch}'s tp_plan splits bare per-head parameters of "
                         f"{local} (style 'local_params', e.g. attention sinks); tensorpar "
                         f"cannot split a parameter that is not a layer's weight yet")
    named = dict(model.named_modules())
    modules = list(named)
    if is_mla(config, modules):  # multi-head latent attention: tensorpar's own split
        mla, entries = mla_plan(model, config, prefix, entries, reduce_dtype)
        plan.update(mla)
    whole = _whole_feature_mlps(model)
    for pattern, raw in entries.items():
        leaf = pattern.rpartition(".")[2]
        matched = {n: m for n, m in named.items() if match_module(prefix + pattern, n)}
        if not matched:
            continue  # e.g. the dense MLP's entries in a model whose every layer is MoE
        if raw in _LEFT_REPLICATED or ".experts" in pattern:
            replicated.append(pattern)
            continue
        if raw not in _TP_STYLES:
            raise ValueError(f"{fn}: {arch}'s tp_plan entry {pattern!r}: {raw!r} is a style "
                             f"tensorpar does not know")
        if leaf in ("query_key_value", "c_attn", "qkv_proj", "Wqkv") and raw == "colwise":
            raise ValueError(f"{fn}: {arch}'s {leaf} is a fused query/key/value projection "
                             f"whose layout tensorpar does not know; write a plan by hand "
                             f"with PackedColwise, or Colwise(gather_output=True) and the "
                             f"output projection Rowwise(input_is_parallel=False)")
        if leaf == "q_proj" and raw == "colwise":
            widths = {m.out_features for m in matched.values() if isinstance(m, nn.Linear)}
            if widths and widths != {heads * head_dim}:
                raise ValueError(f"{fn}: {arch}'s q_proj has {sorted(widths)} output features, "
                                 f"not {heads} heads of {head_dim} (a query fused with a gate, "
                                 f"or head counts that vary per layer): tensorpar does not "
                                 f"know how to split it by head; write a plan by hand")
        style = _style(leaf, raw, group, head_dim, reduce_dtype)
        beside_q = entries.get(pattern.rpartition(".")[0] + ".q_proj") == "colwise"
        if beside_q and leaf not in ("q_proj", "k_proj", "v_proj"):
            style = _per_head(list(matched.values()), style, heads, group, head_dim)
        if isinstance(style, PartialGrad) and not any(
                any(True for _ in m.parameters(recurse=False)) for m in matched.values()):
            continue  # e.g. Gemma3n's v_norm, a norm without a scale: no gradient to sum
        if style is None:
            continue
        kept = [n for n in matched if n.rpartition(".")[0] not in whole]
        if len(kept) == len(matched):
            plan[prefix + pattern] = style
        else:  # the layers' own names, without the MLPs left whole
            plan.update(dict.fromkeys(kept, style))
    plan.update(_partial_grad_gaps(model, plan, head_dim))
    if experts == "expert_parallel":
        plan = expert_parallel_plan(model, plan, reduce_dtype=reduce_dtype)
    elif replicated:
        warnings.warn(f"{fn}: {arch}: {replicated} are left replicated (experts="
                      f"'replicated', the default): they compute the dense result on every "
                      f"rank; pass experts='expert_parallel' to spread the experts over the "
                      f"ranks", stacklevel=2)
    plan = _with_embeddings(model, plan, lm_head)
    if sequence_parallel not in (False, True, "regather"):
        raise ValueError(f"{fn}: sequence_parallel={sequence_parallel!r}; expected True, False "
                         f"or 'regather'")
    if sequence_parallel:
        plan = sequence_parallel_plan(model, plan, prefix,
                                      regather=sequence_parallel == "regather")
    _warn_of_shared_masks(fn, config, sequence_parallel)  # (a plan made: nothing refused)
    return plan


def _with_embeddings(model: nn.Module, plan: dict[str, Style], lm_head: LMHead
                     ) -> dict[str, Style]:
    """The plan, with the input embedding (and its tied copies) and the LM head split."""
    names = {id(m): n for n, m in model.named_modules()}
    embed = _embeddings(model, "get_input_embeddings")
    if embed is not None:
        plan[names[id(embed)]] = Vocab()
        for name, module in model.named_modules():  # T5: the stacks' embed_tokens are tied
            if isinstance(module, nn.Embedding) and module is not embed \
                    and module.weight is embed.weight:
                plan[name] = Vocab()
    head = _embeddings(model, "get_output_embeddings")
    if isinstance(head, nn.Linear) and id(head) in names:
        bias_tied = any(names[id(head)] + ".bias" in tie for tie in tied_groups(model))
        if not bias_tied:
            plan[names[id(head)]] = Colwise(gather_output=lm_head == "gathered")
        elif embed is not None and head.weight is embed.weight:
            for name in [n for n, s in plan.items() if isinstance(s, Vocab)]:
                del plan[name]  # the head stays replicated, so must its tied embeddings
    return plan


def _heads(config: Any) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % kv_heads:
        raise ValueError(f"plan_from_transformers: {heads} query heads do not divide into "
                         f"{kv_heads} key/value heads")
    return heads, kv_heads, head_dim


_TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
              "replicated_with_grad_allreduce", "embedding_rowwise", "embedding_colwise",
              "replicate")


def _style(leaf: str, raw: str, group: int, head_dim: int, reduce_dtype: torch.dtype | None
           ) -> Style | None:
    if raw == "replicate":
        return None
    if raw == "embedding_rowwise":
        return Vocab()
    if raw == "embedding_colwise":
        return EmbeddingDim()
    if raw == "replicated_with_grad_allreduce":  # per-head norms: a partial gradient
        return PartialGrad()
    if raw == "colwise_gather_output":  # the model slices the output with global sizes
        return Colwise(gather_output=True)
    if raw == "rowwise_split_input":
        return Rowwise(input_is_parallel=False, reduce_dtype=reduce_dtype)
    if leaf == "q_proj":
        return Colwise(multiple_of=group * head_dim)
    if leaf in ("k_proj", "v_proj"):
        return Colwise(multiple_of=head_dim)
    if leaf == "o_proj":
        return Rowwise(multiple_of=group * head_dim, reduce_dtype=reduce_dtype)
    return Colwise() if raw == "colwise" else Rowwise(reduce_dtype=reduce_dtype)


def _whole_feature_mlps(model: nn.Module) -> set[str]:
    """MLPs whose forward takes statistics over all their features: left replicated.

    Gemma3n's activation sparsity (the first 10 layers of 35 in its checkpoints) cuts
    ``gate_proj``'s output at its mean plus a multiple of its standard deviation over the
    features, which a column split would compute on each rank's slice.
    """
    return {n for n, m in model.named_modules()
            if isinstance(a := getattr(m, "activation_sparsity", None), float) and a > 0.0}


def _per_head(layers: list[nn.Module], style: Style | None, heads: int, group: int,
              head_dim: int) -> Style | None:
    """A layer beside a head-split ``q_proj`` that works per head: split in query-head groups.

    A gate of one value per head (Laguna's ``g_proj``) or per head feature, and the output
    projection under any name (Phi's ``dense``), split like ``q_proj``.
    """
    sizes = {(m.in_features, m.out_features) for m in layers if isinstance(m, nn.Linear)}
    if len(sizes) != 1:
        return style
    ((fan_in, fan_out),) = sizes
    if style == Colwise():
        if fan_out == heads:
            return Colwise(multiple_of=group)
        if fan_out == heads * head_dim:
            return Colwise(multiple_of=group * head_dim)
    if isinstance(style, Rowwise) and style.input_is_parallel and fan_in == heads * head_dim:
        return Rowwise(multiple_of=group * head_dim, reduce_dtype=style.reduce_dtype)
    return style


def _partial_grad_gaps(model: nn.Module, plan: dict[str, Style], head_dim: int
                       ) -> dict[str, Style]:
    """Parameters some transformers plans forget, whose gradient a split makes partial.

    A per-head ``q_norm``/``k_norm`` (weight of ``head_dim``) beside a split ``q_proj`` or
    ``k_proj`` (SarvamMoE's plan omits it), and an activation with parameters of its own
    (Apertus's xIELU ``act_fn``) beside a split up projection: both see this rank's slice.
    """
    styles = {n: st for pattern, st in plan.items() for n, _ in model.named_modules()
              if n and match_module(pattern, n)}
    split = {n.rpartition(".")[0] for n, st in styles.items()
             if isinstance(st, (Colwise, PackedColwise)) and not st.gather_output}
    gaps: dict[str, Style] = {}
    for parent in sorted(split):
        bare = [n for n, _ in model.get_submodule(parent).named_parameters(recurse=False)]
        if bare:  # Doge's per-head A: a bare parameter the rank's heads index
            raise ValueError(f"plan_from_transformers: {parent!r} holds bare parameters "
                             f"{bare} beside its split projections; tensorpar cannot tell "
                             f"whether they are per head and does not split bare parameters")
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        own = [p for _, p in module.named_parameters(recurse=False)]
        if name in styles or parent not in split or not own:
            continue
        per_head = leaf in ("q_norm", "k_norm") and all(p.numel() == head_dim for p in own)
        if per_head or (leaf == "act_fn" and isinstance(module, nn.Module)):
            gaps[name] = PartialGrad()
    return gaps


def _phi3(config: Any, head_dim: int, reduce_dtype: torch.dtype | None) -> dict[str, Style]:
    # the attention slices qkv at config.num_attention_heads * head_dim: gather it, and let
    # o_proj split its (replicated) input; the MLP chunk(2)s [gate; up], which a block-wise
    # split keeps as [gate_r; up_r]
    return {"layers.*.self_attn.qkv_proj": Colwise(gather_output=True),
            "layers.*.self_attn.o_proj": Rowwise(input_is_parallel=False,
                                                 reduce_dtype=reduce_dtype),
            "layers.*.mlp.gate_up_proj": PackedColwise(blocks=2),
            "layers.*.mlp.down_proj": Rowwise(reduce_dtype=reduce_dtype)}


def _gpt2(config: Any, head_dim: int, reduce_dtype: torch.dtype | None) -> dict[str, Style]:
    if getattr(config, "add_cross_attention", False):
        raise ValueError("plan_from_transformers: GPT-2 with add_cross_attention=True is not "
                         "supported (its cross-attention projections have no plan); write "
                         "one by hand")
    # c_attn's output is split at self.split_size (the full width): gather it
    return {"h.*.attn.c_attn": Colwise(gather_output=True),
            "h.*.attn.c_proj": Rowwise(input_is_parallel=False, reduce_dtype=reduce_dtype),
            "h.*.mlp.c_fc": Colwise(),
            "h.*.mlp.c_proj": Rowwise(reduce_dtype=reduce_dtype)}


def _gpt_neox(config: Any, head_dim: int, reduce_dtype: torch.dtype | None
              ) -> dict[str, Style]:
    # query_key_value is [q, k, v] per head, and the forward reads heads off the tensor:
    # whole heads per rank keep every head's q, k and v together
    return {"layers.*.attention.query_key_value": Colwise(multiple_of=3 * head_dim),
            "layers.*.attention.dense": Rowwise(multiple_of=head_dim, reduce_dtype=reduce_dtype),
            "layers.*.mlp.dense_h_to_4h": Colwise(),
            "layers.*.mlp.dense_4h_to_h": Rowwise(reduce_dtype=reduce_dtype)}


def _bert(config: Any, head_dim: int, reduce_dtype: torch.dtype | None) -> dict[str, Style]:
    # the self-attention reads heads off the tensors (view(..., -1, head_size))
    layer = "encoder.layer.*."
    return {layer + "attention.self.query": Colwise(multiple_of=head_dim),
            layer + "attention.self.key": Colwise(multiple_of=head_dim),
            layer + "attention.self.value": Colwise(multiple_of=head_dim),
            layer + "attention.output.dense": Rowwise(multiple_of=head_dim,
                                                      reduce_dtype=reduce_dtype),
            layer + "intermediate.dense": Colwise(),
            layer + "output.dense": Rowwise(reduce_dtype=reduce_dtype)}


def _t5(model: nn.Module, reduce_dtype: torch.dtype | None) -> dict[str, Style]:
    # T5's attention views its projections with the global head count (view(b, -1, n_heads,
    # d)), which a head split would silently fold into the sequence: the projections are
    # gathered and the output projection splits its input, as Phi-3's. The MLP is split.
    leaves = {n.rpartition(".")[2] for n, _ in model.named_modules()}
    plan: dict[str, Style] = {}
    for attn in ("SelfAttention", "EncDecAttention"):
        if attn in leaves:
            plan[f"**.{attn}.[qkv]"] = Colwise(gather_output=True)
            plan[f"**.{attn}.o"] = Rowwise(input_is_parallel=False, reduce_dtype=reduce_dtype)
    for proj in ("wi", "wi_0", "wi_1"):
        if any(n.endswith(f"DenseReluDense.{proj}") for n, _ in model.named_modules()):
            plan[f"**.DenseReluDense.{proj}"] = Colwise()
    plan["**.DenseReluDense.wo"] = Rowwise(reduce_dtype=reduce_dtype)
    return plan


# the config fields of dropout over the split heads, and over the sequence's slices
_HEAD_DROPOUT = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "dropout_rate")
# (not the embeddings': the sequence is split after them, in the first decoder layer)
_HIDDEN_DROPOUT = ("hidden_dropout", "resid_pdrop", "hidden_dropout_prob")


def _warn_of_shared_masks(fn: str, config: Any, sequence_parallel: object) -> None:
    """Warn where dropout would draw the same masks on every rank's part of a tensor.

    Every rank of the group holds the same random state (it must: a replicated tensor's
    mask has to agree), so dropout over a split tensor gives each rank's part the masks of
    every other rank's part: correlated, where the dense model's are independent.
    """
    fields = _HEAD_DROPOUT + (_HIDDEN_DROPOUT if sequence_parallel else ())
    rates = {f: v for f in fields if isinstance(v := getattr(config, f, None), (int, float))
             and v > 0}
    if rates:
        warnings.warn(f"{fn}: {config.model_type}: dropout over a tensor split across the ranks "
                      f"({', '.join(f'{f}={v}' for f, v in rates.items())}) draws the same "
                      f"masks on every rank's part (the heads, or the sequence's slices): "
                      f"correlated where the dense model's are independent. Train with these "
                      f"rates at 0, or accept the correlation (eval and inference are "
                      f"unaffected)", stacklevel=3)


_OWN_PLANS = {"phi3": _phi3, "gpt2": _gpt2, "gpt_neox": _gpt_neox, "bert": _bert}


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
