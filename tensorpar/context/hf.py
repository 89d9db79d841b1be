"""``context_parallel``: a transformers decoder LM that holds one share of the sequence per rank.

Every rank calls the model with the whole ``input_ids`` (and ``labels``). Hooks make it keep
only this rank's share of the positions from the embedding on:

- a forward pre-hook on the model computes the layout for the sequence length (`zigzag_layout`:
  an early and a late chunk per rank), passes the global ``position_ids`` of the rank's rows
  (so rotary tables follow global positions), switches the cache off and takes ``labels``
  aside; one all-gather first compares every rank's call (shapes, and a hash of the
  tokens, labels, mask and positions), so a rank given another batch is refused on every
  rank instead of computing its share of it;
- a forward hook on the input embedding keeps the rank's rows of its output;
- packed rows (``position_ids`` that restart, no attention mask, no cache: where
  transformers' own masks keep each document to itself) become per-position document
  ids, computed from the whole ``position_ids`` every rank holds; a padding
  ``attention_mask`` (the whole of it on every rank) hides its padded keys from every query;
- the layout and the documents or padding travel to the attention layers as one keyword
  argument of the forward (`Call`), so that an activation checkpoint's recompute gets its
  own call's;
- the attention layers run `tensorpar`'s ring attention (a transformers attention
  implementation registered under ``"tensorpar_ring"``); it reads the layer's causality,
  scaling and sliding window as the model passes them, so masks follow global positions and
  no ``(T, T)`` mask is ever built; or, with ``attention="ulysses"``, two all-to-alls
  around SDPA over the whole sequence of a share of the heads;
- a forward hook on the model computes the loss of the rank's rows with the model's own loss
  function, normalised by the whole batch's token count, and sums it over the group, so
  ``out.loss`` is the dense loss on every rank (``out.logits`` holds the rank's rows); an
  MoE family's load-balancing loss (``output_router_logits``) is computed by the family's
  own function over every rank's router logits, gathered in the dense order;
- every parameter is replicated over the group but sees only the rank's rows: a gradient
  hook sums its gradient over the group once per backward.
"""

from __future__ import annotations

import copy
import inspect
import json
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tensorpar.collectives.functional import all_gather, all_reduce
from tensorpar.collectives.regions import gather_from_group
from tensorpar.comm._group import Group, GroupLike, resolve_group
from tensorpar.context._autocast import as_sdpa_under_autocast
from tensorpar.context._blocks import Documents, Padding, Visible
from tensorpar.context._ring import RingSpec, ring_apply
from tensorpar.context.attention import digest
from tensorpar.context.layout import Layout, positions, zigzag_layout
from tensorpar.context.ulysses import ulysses_apply
from tensorpar.errors import CollectiveArgumentError

__all__ = ["CALL", "CONTEXT_MODEL_TYPES", "Call", "context_parallel"]

_FN = "context_parallel"
IMPLEMENTATION = "tensorpar_ring"
_STATE = "_tensorpar_context"
_SUMMED = "_tensorpar_context_grad"


CONTEXT_MODEL_TYPES = (
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "beam", "cohere",
    "cohere2", "cohere2_moe", "cohere_compass_text", "cwm", "deepseek_v2", "deepseek_v3",
    "dory", "dots1", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe",
    "flex_olmo", "flint", "gemma", "gemma3_text", "gemma4_unified_text", "glm", "glm4",
    "glm4_moe", "glm4_moe_lite", "gpt_neox", "gpt_oss", "gptj", "granite", "granite_swa",
    "granitemoe", "granitemoe_swa", "granitemoeshared", "helium", "hrm_text",
    "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3",
    "iquestcoder", "jais2", "kolibri1", "laguna", "lfm2", "llama", "mellum",
    "mimo_v2_flash", "minicpm3", "minimax_m2", "minimax_m3_vl_text", "ministral",
    "ministral3", "mistral", "mixtral", "nanochat", "olmo", "olmo2", "olmo3", "olmoe",
    "phi", "phi3", "phi4_multimodal", "qwen2", "qwen3", "qwen3_moe", "sarvam_mla",
    "sarvam_moe", "seed_oss", "smollm3", "solar_open", "starcoder2", "youtu",
)
"""transformers ``model_type``\\ s that `context_parallel` runs: each family's causal LM
equals its dense self (loss and every gradient, float64, two ranks, sliding windows and
chunks smaller than the sequence) with the transformers the tests pin (5.24), in
``tests/test_context_families.py``."""

_ATTENTION_LAYERS = ("full_attention", "sliding_attention")

PACKED_ACROSS = ("afmoe", "gpt_oss")
"""Listed families whose transformers masks do not keep packed documents apart (their mask
builders are not given ``position_ids``): dense attends across the documents, and so does
`context_parallel` (measured: their dense logits do not change when transformers' packed
sequence detection is switched off; every other listed family's do)."""

_INPUTS = frozenset({"labels", "position_ids", "use_cache", "return_dict",
                     "output_hidden_states", "output_attentions", "output_router_logits"})
"""Keyword inputs besides ``input_ids``, ``attention_mask`` (``(B, T)`` of 0 and 1) and
``num_items_in_batch`` that `context_parallel` takes; any other is refused."""

CALL = "tensorpar_context"
"""The keyword under which a forward's `Call` travels to the attention layers."""


@dataclass
class _State:
    """The group and the attention kind; the rest is set during a forward.

    This rank's positions, the labels, the layout and the attention mask (for a
    load-balancing loss).
    """

    group: Group
    attention: str = "ring"
    index: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    count: Any = None  # num_items_in_batch, where the caller gives it
    layout: Layout | None = None
    mask: torch.Tensor | None = None  # the whole attention mask, for a load-balancing loss
    routes: bool = False  # output_router_logits, given or the config's
    model: int = 0  # a digest of the model's config and parameters' names (`_model_digest`)


@dataclass(frozen=True)
class Call:
    """What one forward's attention needs: the layout, and the packed documents or padding.

    It travels with the forward's keyword arguments (transformers hands them down to the
    attention), so an activation checkpoint's recompute gets its own call's, whatever
    forwards ran in between.
    """

    layout: Layout
    visible: Visible | None
    order: torch.Tensor | None = None  # Ulysses: the ranks' rows end to end, their positions


ATTENTIONS = ("ring", "ulysses")


def context_parallel(model: nn.Module, *, group: GroupLike = None,
                     attention: str = "ring") -> nn.Module:
    """Split a transformers decoder LM's sequence over ``group`` (ring attention), in place.

    Every rank calls the model with the whole ``input_ids`` and ``labels``; the model keeps
    only this rank's share of the activations (an early and a late chunk of the sequence,
    any length of at least one position per rank), attention runs across the ranks,
    ``out.loss`` is the dense loss on every rank and every parameter's gradient is the
    dense gradient (summed over ``group``).
    ``out.logits`` holds this rank's positions, in the order of
    `tensorpar.context.layout.zigzag_layout`.

    Packed rows (several documents, ``position_ids`` restarting at each) keep each
    document to itself where transformers' own masks do: called without an
    ``attention_mask`` and without a cache (``use_cache=False``, or the config's, or
    gradient checkpointing in training). With a cache transformers attends across the
    documents, and so does this. A padding ``attention_mask`` (``(B, T)``, 0 at padding,
    the whole of it on every rank) hides padded keys from every query, as transformers'
    sdpa mask does: a query with no key left (left padding) gets a zero attention output.

    Runs the families listed in `CONTEXT_MODEL_TYPES` (measured equal to dense: every
    gradient, at two ranks, with sliding windows that cross the chunks), whose layers are
    attention layers (``config.layer_types`` of full or sliding attention only); attention
    sinks (gpt-oss) included. Others are refused by name: a mamba, convolution or
    linear-attention layer, a chunked or indexed attention, or a per-layer input computed
    from the token ids would see only this rank's share of the sequence, silently. Apply
    it after `tensorpar.parallelize` (tensor parallelism over another group).

    Args:
        model: a transformers ``PreTrainedModel`` for causal LM (``...ForCausalLM``).
        group: the context-parallel group (``None``: the default group, resolved now).
        attention: ``"ring"`` (`ring_attention`: key/value chunks travel the ring, no rank
            holds the whole sequence) or ``"ulysses"`` (`ulysses_attention`: two
            all-to-alls trade the sequence split for a head split around SDPA; each rank
            briefly holds the whole sequence of ``H / W`` heads and a ``(T, T)`` mask where
            a window, documents or padding mask it; no attention sinks).

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` has no input embedding or no transformers config.
        ValueError: the model is already context parallel, of a family not in
            `CONTEXT_MODEL_TYPES`, has layers other than attention layers, or uses attention
            logit soft-capping; ``attention`` not one of ``"ring"``, ``"ulysses"``; at
            the call: a sequence shorter than the group, or inputs it does not take.
        CollectiveArgumentError: at the call, on every rank: the ranks' calls differ (every
            rank must pass the same ``input_ids``, ``labels``, mask, positions and
            ``num_items_in_batch`` to the same model, its config and parameters' shapes
            and dtypes alike, in the same train/eval mode; one all-gather per forward
            compares shapes and hashes), or another rank refused its inputs.

    Example:
        >>> import torch, transformers
        >>> from tensorpar.nn import context_parallel
        >>> config = transformers.LlamaConfig(vocab_size=11, hidden_size=8, intermediate_size=8,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
        >>> model = context_parallel(transformers.LlamaForCausalLM(config))
        >>> ids = torch.tensor([[1, 2, 3, 4]])
        >>> model(ids, labels=ids).logits.shape  # one rank: the whole sequence
        torch.Size([1, 4, 11])
    """
    g = resolve_group(group, _FN)
    if attention not in ATTENTIONS:
        raise ValueError(f"{_FN}: attention must be one of {ATTENTIONS}, got {attention!r}")
    config = getattr(model, "config", None)
    get_embedding = getattr(model, "get_input_embeddings", None)
    if config is None or get_embedding is None:
        raise TypeError(f"{_FN}: model must be a transformers PreTrainedModel (a config and an "
                        f"input embedding), got {type(model).__name__}")
    if getattr(model, _STATE, None) is not None:
        raise ValueError(f"{_FN}: {type(model).__name__} is already context parallel")
    problem = _unsupported(config)
    if problem:
        raise ValueError(f"{_FN}: {problem}")
    if attention == "ulysses" and any(isinstance(getattr(m, "sinks", None), torch.Tensor)
                                      for m in model.modules()):
        raise ValueError(f"{_FN}: attention sinks are not supported with attention='ulysses' "
                         f"(SDPA has none); use attention='ring'")
    config = _own_config(model)
    text = getattr(config, "get_text_config", lambda: config)()
    _register()
    state = _State(g, attention, model=_model_digest(model, config))
    setattr(model, _STATE, state)
    for module in model.modules():
        module.__dict__[_STATE] = state
        conf = getattr(module, "config", None)
        if conf is not None and hasattr(conf, "_attn_implementation"):
            conf._attn_implementation = IMPLEMENTATION
    for sub in (config, text):
        sub._attn_implementation = IMPLEMENTATION
    # first: it takes labels aside (its loss handles a vocab-parallel head) before any guard
    model.register_forward_pre_hook(_before, with_kwargs=True, prepend=True)
    get_embedding().register_forward_hook(_keep_rows)
    model.register_forward_hook(_loss, with_kwargs=True)
    _sum_gradients(model, g)
    return model


_WHERE_FROM = ("_name_or_path", "_commit_hash")
"""Config fields that say where a model was loaded from, not what it is (not compared)."""


def _model_digest(model: nn.Module, config: Any) -> int:
    """A digest of the model's config and its parameters' names (at the call).

    Compared at every forward (`_agree`): ranks with another depth would wait in each
    other's rings, ranks with another config (a rope base) compute another model's share,
    silently. The same model loaded from another path on each rank is the same model.
    """
    fields = {k: v for k, v in config.to_dict().items() if k not in _WHERE_FROM}
    described = json.dumps(fields, sort_keys=True, default=str) + repr(
        [name for name, _ in model.named_parameters()])
    return zlib.crc32(described.encode())


def _parameters_digest(model: nn.Module) -> int:
    """A digest of the parameters' shapes, dtypes and ``requires_grad`` now.

    A rank cast alone, resized, or with another parameter frozen (its gradient's sum would
    wait) differs.
    """
    return zlib.crc32(repr([(tuple(p.shape), p.dtype, p.requires_grad)
                            for p in model.parameters()]).encode())


def _sum_gradients(model: nn.Module, g: Group) -> None:
    """Hook every parameter that trains to sum its gradient over ``g``, once each.

    At the conversion and at every forward: a parameter unfrozen since, or a new object
    (``load_state_dict(assign=True)``, ``to_empty``, a resized embedding) counts too.
    """
    if g.is_single:
        return
    for p in model.parameters():
        if p.requires_grad and not getattr(p, _SUMMED, False):
            setattr(p, _SUMMED, True)
            p.register_hook(_summer(g))


def _own_config(model: nn.Module) -> Any:
    """Give ``model`` a copy of its config (and sub-configs) of its own; return it.

    Its attention is switched by writing the config's ``_attn_implementation``, which
    every layer reads at call time: written in place, it would switch another model built
    from the same config object (a dense reference) too.
    """
    copies: dict[int, Any] = {}
    config = copy.deepcopy(model.config, copies)
    for module in model.modules():
        conf = module.__dict__.get("config")
        if conf is None or not hasattr(conf, "_attn_implementation"):
            continue
        if id(conf) not in copies:  # (one not reached from the model's: copied too)
            copy.deepcopy(conf, copies)
        module.config = copies[id(conf)]
    return config


def _unsupported(config: Any) -> str | None:
    """Why a model with this config cannot be split by sequence, or ``None``."""
    model_type = getattr(config, "model_type", None)  # the model's own (measured) config
    if model_type not in CONTEXT_MODEL_TYPES:
        return (f"model_type {model_type!r} has not been measured equal to dense with its "
                f"sequence split (tensorpar.context.hf.CONTEXT_MODEL_TYPES): a layer that "
                f"mixes positions outside attention, or an attention mask the ring does not "
                f"implement, would see only this rank's share of the sequence")
    text = getattr(config, "get_text_config", lambda: config)()
    kinds = sorted({str(k) for k in getattr(text, "layer_types", None) or ()}
                   - set(_ATTENTION_LAYERS))
    if kinds:
        return (f"layers of kind {', '.join(kinds)} (config.layer_types) are not attention "
                f"layers the ring runs (only {', '.join(_ATTENTION_LAYERS)})")
    # "vision": bidirectional among image tokens only, and only token ids come in here
    bidirectional = getattr(text, "use_bidirectional_attention", None)
    if bidirectional not in (None, False, "vision"):
        return (f"use_bidirectional_attention={bidirectional!r} is not supported (some "
                f"families' attention layers then say non-causal while their masks stay "
                f"causal)")
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return (f"attention logit soft-capping (attn_logit_softcapping="
                f"{text.attn_logit_softcapping}) is not supported by ring attention; "
                f"expected None")
    return None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _attention)


def _summer(g: Group) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        # the summed gradient is replicated: its consumers count it once (identity adjoint)
        return all_reduce(grad.contiguous(), backward="identity", group=g)
    return hook


def _before(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    state: _State = getattr(model, _STATE)
    given = kwargs.get("position_ids")
    visible: Visible | None = None
    whole = None
    try:  # any refusal of this rank's inputs is raised once the ranks have compared
        ids, mask, padding = _take_inputs(model, state, args, kwargs)
        problem: Exception | None = None
        routes = kwargs.get("output_router_logits")
        state.routes = bool(_routes(model) if routes is None else routes)
        if padding is not None:  # (dense transformers moves the mask to the tokens')
            visible = Padding(padding, ids.device)
        whole = None if given is None else given.expand(ids.shape[0], -1)
        if whole is not None and mask is None and not _would_cache(model, kwargs) and \
                getattr(model.config, "model_type", None) not in PACKED_ACROSS:
            ids_of_documents = _documents(whole)
            if ids_of_documents is not None:
                visible = Documents(ids_of_documents, whole.device)
    except Exception as e:
        ids, mask, padding, problem, visible, whole = None, None, None, e, None, None
    if not state.group.is_single:  # before anything travels the ring: no rank left waiting
        _agree(state, problem, ids, padding, whole, kwargs.get("labels"), visible,
               _home(model), model, sum(m.training for m in model.modules()))
    if problem is not None:
        raise problem
    assert ids is not None
    batch, total = ids.shape
    layout = zigzag_layout(total, state.group.size)
    state.index = positions(layout, state.group.rank, ids.device)
    global_pos = (given if given is not None
                  else torch.arange(total, device=ids.device).unsqueeze(0).expand(batch, -1))
    kwargs["position_ids"] = global_pos[:, state.index]
    order = None if state.attention != "ulysses" else torch.cat(
        [positions(layout, r, ids.device) for r in range(state.group.size)])
    kwargs[CALL] = Call(layout, visible, order)
    kwargs["use_cache"] = False
    state.labels = kwargs.pop("labels", None)
    state.layout, state.mask = layout, mask
    return (ids,), kwargs


def _take_inputs(model: nn.Module, state: _State, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """This rank's checks of a call: ``input_ids``, the attention mask and its padding.

    Takes ``input_ids``, ``attention_mask`` and ``num_items_in_batch`` out of ``kwargs``.

    Raises:
        ValueError: an input `context_parallel` does not take (raised on every rank, by
            `_agree`, once the ranks have compared).
    """
    ids = args[0] if args else kwargs.pop("input_ids", None)
    mask = kwargs.pop("attention_mask", None)
    state.count = kwargs.pop("num_items_in_batch", None)  # the loss's denominator, if given
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{_FN}: the model must be called with input_ids of shape (B, T) "
                         f"(inputs_embeds are not split), got {got}")
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError(f"{_FN}: inputs_embeds is not supported; pass input_ids")
    padding = _padding(mask, ids)
    if len(args) > 1:
        raise ValueError(f"{_FN}: pass the arguments after input_ids by keyword")
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{_FN}: a cache ({name}) is not supported (training and scoring "
                             f"only: the cache is switched off)")
    keep = kwargs.get("logits_to_keep")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep):
        shown = f"a tensor of shape {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) \
            else repr(keep)
        raise ValueError(f"{_FN}: logits_to_keep is not supported (each rank holds positions "
                         f"from all over the sequence); expected 0, got {shown}. generate() "
                         f"passes it: a context-parallel model trains and scores, it does not "
                         f"generate")
    other = sorted(k for k, v in kwargs.items() if k not in _INPUTS and v is not None)
    if other:
        raise ValueError(f"{_FN}: inputs {other} are not supported (they may shape the "
                         f"attention, as a prefix's token_type_ids do, which the ring does "
                         f"not follow); expected only {sorted(_INPUTS)}")
    given = kwargs.get("position_ids")
    if given is not None and (not isinstance(given, torch.Tensor) or given.ndim != 2 or
                              given.shape[1] != ids.shape[1] or
                              given.shape[0] not in (1, ids.shape[0])):
        got = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
        raise ValueError(f"{_FN}: position_ids must be shaped (B, T) or (1, T) as input_ids "
                         f"{tuple(ids.shape)}, got {got}")
    if ids.shape[1] < state.group.size:  # a rank without a position would fail in the model
        raise ValueError(f"{_FN}: the sequence ({ids.shape[1]} positions) is shorter than the "
                         f"group ({state.group.size} ranks): every rank needs a position")
    routes = kwargs.get("output_router_logits")
    if bool(_routes(model) if routes is None else routes) and \
            kwargs.get("return_dict") is False and _balancing(model) is not None:
        raise ValueError(f"{_FN}: return_dict=False with output_router_logits is not "
                         f"supported (the load-balancing loss is computed over the whole "
                         f"sequence, into out.aux_loss)")
    return ids, mask, padding


_AGREED = ("input_ids", "the padding of attention_mask", "position_ids", "labels",
           "num_items_in_batch", "output_router_logits",
           "whether gradients are on (torch.is_grad_enabled)",
           "the masking (packed documents, padding or none)",
           "attention (context_parallel's attention=)",
           "the model (its config or its parameters' names, at context_parallel)",
           "the parameters' shapes, dtypes or requires_grad",
           "train/eval mode (the modules in training mode)")
"""What every rank's call must agree on, in the order of `_agree`'s row (after the shape)."""


# eager: it hashes on the host (the ring's transfers break the graph anyway)
@torch.compiler.disable  # type: ignore[untyped-decorator]
def _agree(state: _State, problem: Exception | None, ids: torch.Tensor | None,
           padding: torch.Tensor | None, positions_given: Any, labels: Any,
           visible: Visible | None, home: torch.device | None,
           model: nn.Module | None = None, training: int = 0) -> None:
    """Compare this call's inputs with every rank's (one all-gather); raise on every rank.

    Every rank must pass the whole, same batch: a rank with other tokens, labels, masks or
    positions would compute its share of another batch, silently; one with another shape
    would send the ring chunks of another size. ``home``: the device of the model's input
    embedding, where every rank's exchange buffer goes (a refused rank's inputs may be on
    no device at all: on a group with a CPU and a CUDA backend, buffers on two kinds of
    device would meet in two backends, and wait for ever). ``model``: its parameters'
    gradient hooks are completed (`_sum_gradients`) and their digest compared.

    Raises:
        ValueError: a rank's own inputs were refused (`CollectiveArgumentError` on the
            others), or the ranks' inputs differ.
    """
    g = state.group
    parameters = 0
    if model is not None:  # (here: eager under torch.compile, where hooks are registered)
        _sum_gradients(model, g)
        parameters = _parameters_digest(model)
    row = [0] * (3 + len(_AGREED))
    if problem is None and ids is not None:
        kind = 0 if visible is None else 1 if isinstance(visible, Padding) else 2
        row = [1, ids.shape[0], ids.shape[1], digest(ids), digest(padding),
               digest(positions_given), digest(labels), digest(state.count),
               int(state.routes), int(torch.is_grad_enabled()), kind,
               ATTENTIONS.index(state.attention), state.model, parameters, training]
    device = g.comm_device(home)
    rows = all_gather(torch.tensor([row], dtype=torch.int64, device=device), group=g.handle,
                      sizes=[1] * g.size).tolist()
    if problem is not None:
        return  # the caller raises this rank's own error
    bad = [r for r, m in enumerate(rows) if not m[0]]
    if bad:
        raise CollectiveArgumentError(f"{_FN}: rank(s) {bad} of the group refused their inputs "
                                      f"(their own error says why)")
    shapes = [tuple(m[1:3]) for m in rows]
    if len(set(shapes)) > 1:
        raise CollectiveArgumentError(
            f"{_FN}: every rank must pass the whole batch, the same on each; the ranks passed "
            f"input_ids of shapes {shapes} (rank order)")
    for i, name in enumerate(_AGREED):
        values = [m[3 + i] for m in rows]
        if len(set(values)) > 1:
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise CollectiveArgumentError(
                f"{_FN}: every rank must pass the whole batch, the same on each; {name} "
                f"differ between rank 0 and rank(s) {differ}")


def _home(model: nn.Module) -> torch.device | None:
    """The device of the model's input embedding (``None``: it holds no parameter)."""
    weight = next(model.get_input_embeddings().parameters(), None)  # type: ignore[operator]
    return None if weight is None else weight.device


def _would_cache(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether the dense model, called with ``kwargs``, would run with a cache.

    As transformers decides: ``use_cache`` if given, else the config's; never under
    gradient checkpointing in training (with gradients on).
    """
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return True
    use = kwargs.get("use_cache")
    if use is None:
        config = model.config
        use = getattr(getattr(config, "get_text_config", lambda: config)(), "use_cache", None)
    checkpointing = any(getattr(m, "gradient_checkpointing", False) is True
                        for m in model.modules())
    if checkpointing and model.training and torch.is_grad_enabled():
        return False
    return bool(use)


def _padding(mask: Any, ids: torch.Tensor) -> torch.Tensor | None:
    """The keys a ``(B, T)`` padding mask keeps, or ``None`` where it keeps every key."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.is_complex() or \
            tuple(mask.shape) != tuple(ids.shape):
        got = (f"{mask.dtype} of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor)
               else type(mask).__name__)
        raise ValueError(f"{_FN}: attention_mask must be a padding mask of 0 and 1 shaped as "
                         f"input_ids {tuple(ids.shape)}, got {got}")
    keep = mask != 0
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{_FN}: attention_mask must hold only 0 and 1 (1: the token takes "
                         f"part)")
    return None if bool(keep.all()) else keep


def _documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Each position's document in packed rows, or ``None`` (one document per row).

    A document starts wherever the position does not go up by one from the last.
    """
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    documents = (step != 1).cumsum(-1)
    return documents if bool((documents[:, -1] != 0).any()) else None


def _keep_rows(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    state: _State = module.__dict__[_STATE]
    if state.index is None:
        raise RuntimeError(f"{_FN}: the input embedding was called outside the model's forward")
    return output.index_select(1, state.index)  # (B, T_local, H)


def _loss(model: nn.Module, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
    state: _State = getattr(model, _STATE)
    labels, index = state.labels, state.index
    state.labels = state.index = None
    aux = _load_balancing(model, state, out)
    state.layout = state.mask = None
    if labels is None or index is None:
        return out
    ignore = -100
    shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore)], dim=1)
    count = state.count if state.count is not None else \
        (shifted != ignore).sum()  # every rank holds every label: no communication
    target = shifted[:, index].contiguous()
    logits = out[0] if isinstance(out, tuple) else out.logits  # return_dict=False: a tuple
    shard = getattr(model.get_output_embeddings(), "shard", None)  # type: ignore[operator]
    if shard is not None and logits.shape[-1] != sum(shard.sizes):  # vocab-parallel head
        from tensorpar.nn.layers.loss import (
            vocab_parallel_cross_entropy,  # (nn imports this module)
        )

        local = vocab_parallel_cross_entropy(
            logits.float().flatten(0, 1), target.flatten(), group=shard.group,
            sizes=shard.sizes, ignore_index=ignore, reduction="sum") / count
    else:
        local = model.loss_function(logits=logits, labels=None,  # type: ignore[operator]
                                    vocab_size=logits.shape[-1], shift_labels=target,
                                    num_items_in_batch=count, ignore_index=ignore)
    # each rank's share of the mean; the sum is the dense loss, replicated on every rank
    loss = local if state.group.is_single else all_reduce(
        local, backward="identity", group=state.group)
    if aux is not None:  # as the dense model adds it
        coefficient: float = model.router_aux_loss_coef  # type: ignore[assignment]
        loss = loss + coefficient * aux.to(loss.device)
    if isinstance(out, tuple):  # as the dense model's: the loss first
        return (loss, *out)
    out.loss = loss
    return out


def _load_balancing(model: nn.Module, state: _State, out: Any) -> torch.Tensor | None:
    """The load-balancing loss over the whole sequence, where the model computed one.

    An MoE family with ``output_router_logits`` computes it in its forward from the router
    logits it saw: this rank's rows only. It is computed again by the family's own
    function from every rank's router logits, gathered (the gradient of this replicated
    loss flows back to each rank's own rows) and put in the dense order, and stored as
    ``out.aux_loss``.
    """
    function = _balancing(model)
    if not state.routes or function is None:
        return None
    if isinstance(out, tuple):  # (a config without return_dict)
        raise ValueError(f"{_FN}: tuple outputs with output_router_logits are not supported "
                         f"(the load-balancing loss is computed over the whole sequence, into "
                         f"out.aux_loss)")
    router_logits = getattr(out, "router_logits", None)
    if getattr(out, "aux_loss", None) is None or not isinstance(router_logits, tuple):
        return None
    layout, g = state.layout, state.group
    assert layout is not None
    rows = [positions(layout, r, torch.device("cpu")) for r in range(g.size)]
    order = torch.argsort(torch.cat(rows))  # gathered position -> dense position
    gathered = []
    for logits in router_logits:  # (B * T_rank, E) per layer
        per_row = logits.view(-1, len(rows[g.rank]), logits.shape[-1])
        every = per_row if g.is_single else gather_from_group(
            per_row, dim=1, group=g, sizes=[len(r) for r in rows])
        gathered.append(every.index_select(1, order.to(every.device)).flatten(0, 1))
    aux: torch.Tensor = function(tuple(gathered), model.num_experts,
                                 model.num_experts_per_tok, state.mask)
    out.aux_loss = aux
    return aux


def _balancing(model: nn.Module) -> Any:
    """The family's load-balancing loss function (transformers' MoE families), or ``None``."""
    return getattr(inspect.getmodule(type(model)), "load_balancing_loss_func", None)


def _routes(model: nn.Module) -> bool:
    config = model.config
    text = getattr(config, "get_text_config", lambda: config)()
    return bool(getattr(text, "output_router_logits", False))


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0,
               scaling: float | None = None, sliding_window: int | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The transformers attention implementation: ring attention over the context-parallel group."""
    state: _State | None = module.__dict__.get(_STATE)
    call = kwargs.get(CALL)
    if state is None or not isinstance(call, Call):
        raise RuntimeError(f"{_FN}: the {IMPLEMENTATION!r} attention ran outside a context-"
                           f"parallel model's forward, or the model did not hand its keyword "
                           f"arguments down to its attention")
    if dropout:
        raise ValueError(f"{_FN}: attention dropout ({dropout}) is not supported; expected 0")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{_FN}: attention soft-capping is not supported")
    causal = bool(getattr(module, "is_causal", True))
    window = sliding_window if sliding_window else None
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    # gpt-oss-style attention sinks: one logit per head in every query's softmax
    sinks = kwargs.get("s_aux")
    if state.attention == "ulysses" and isinstance(sinks, torch.Tensor):
        raise ValueError(f"{_FN}: attention sinks are not supported with "
                         f"attention='ulysses' (SDPA has none); use attention='ring'")
    query, key, value, plain = as_sdpa_under_autocast(query, key, value)
    with plain:
        if state.attention == "ulysses":
            return _ulysses(query, key, value, state.group, call, causal, window, scale), None
        spec = RingSpec(group=state.group, layout=call.layout, causal=causal, window=window,
                        scale=scale, kv_groups=query.shape[1] // key.shape[1],
                        visible=call.visible)
        out = ring_apply(query, key.contiguous(), value.contiguous(), spec,  # (B, H, T_r, D)
                         sinks if isinstance(sinks, torch.Tensor) else None)
    return out.transpose(1, 2).contiguous(), None


def _ulysses(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: Group, call: Call,
             causal: bool, window: int | None, scale: float) -> torch.Tensor:
    """`ulysses_apply` over the layout's rows, masked by the call's documents or padding."""
    rows = [sum(seg.length for seg in ranks) for ranks in call.layout]
    visible = call.visible
    out = ulysses_apply(query, key, value, g, rows, call.order, causal, window, scale,
                        visible.on_device if isinstance(visible, Documents) else None,
                        visible.on_device if isinstance(visible, Padding) else None)
    return out.transpose(1, 2).contiguous()  # (B, T_local, H, D)
