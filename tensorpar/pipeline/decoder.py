"""One pipeline stage of a transformers causal LM, run through the family's own ``forward``.

A stage holds a contiguous run of the decoder layers (the first stage the embedding too, the
last the final norm and the LM head). Each stage calls the causal LM's own forward, so what a
family does around its layers (a scaled embedding, a mask per attention kind, rotary tables,
hybrid recurrent layers, soft-capped or scaled logits) is done as the dense model does it.
For the call, the forward's layer list is replaced by one in which:

- the layers of other stages are stand-ins (`Elsewhere`) that return what they are given:
  those before this stage run (doing nothing) and their output is discarded;
- this stage's first layer, except on the first stage, is called with the activation the
  previous stage sent in place of the hidden states the forward hands it (which it computed
  from a zero embedding of the same width);
- this stage's last layer, except on the last stage, ends the forward when it returns: its
  output is the stage's.

The real layers are called as modules (``layer(hidden, ...)``), so their hooks, FSDP2's and
activation checkpointing see the received activation, in the forward and in a recompute.

A family where anything but the hidden states crosses from layer to layer (a second residual
stream, a value carried from the first layer), whose layers run more than once (a looped
block), or whose later layers read the token ids would come out wrong this way, silently.
So is a stage that calls a module with parameters that another stage holds. The families
run are therefore listed (`HF_MODEL_TYPES`): each is compared with its dense self at two and
three stages, every gradient, with each stage holding only what its rank keeps, in
``tests/test_pipeline_hf_families.py``; any other is refused by name.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["HF_MODEL_TYPES", "LAYER_OUTPUTS", "Decoder", "Elsewhere", "run_decoder_stage"]

HF_MODEL_TYPES = (
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "axk2",
    "bailing_hybrid", "bamba", "beam", "cohere", "cohere2", "cohere2_moe", "cohere_compass_text",
    "cwm", "deepseek_v2", "deepseek_v3", "deepseek_v32", "diffllama", "doge", "dots1",
    "dots3_note_text", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe",
    "falcon_h1", "flex_olmo", "flint", "gemma", "gemma2", "gemma3_text",
    "gemma4_unified_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "gpt_neox",
    "gpt_oss", "granite", "granite_swa", "granitemoe", "granitemoe_swa",
    "granitemoehybrid", "granitemoeshared", "helium", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "hy_v3", "hyperclovax", "inkling_text", "internlm3",
    "iquestcoder", "jais2", "jamba", "kimi_linear", "kolibri1", "laguna", "lara_mini",
    "lfm2", "lfm2_moe", "lfm3", "llama", "longcat_flash", "mellum", "mimo_v2_flash",
    "minicpm3", "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral",
    "ministral3", "mistral", "mixtral", "nanochat", "nemotron", "nemotron_h", "olmo",
    "olmo2", "olmo3", "olmo_hybrid", "olmoe", "phi", "phi3", "phimoe", "qwen2",
    "qwen2_moe", "qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next",
    "qwen4_exp_text", "sarvam_mla", "sarvam_moe", "seed_oss", "smollm3", "solar_open",
    "starcoder2", "vaultgemma", "youtu",
)
"""transformers ``model_type``\\ s run stage by stage: each causal LM with a decoder
``layers`` list whose pipeline equals its dense self (every gradient, float64, two and three
stages, each holding only its own modules) with the transformers the tests pin (5.24)."""

LAYER_OUTPUTS = {"bamba": 2}
"""Families whose forward unpacks several values from each decoder layer, of which only the
first (the hidden states) goes on to the next layer (Bamba's second is its attention
weights): their stand-ins return as many, the rest ``None``. Families whose later values
go on (top-k indices handed to the next layer) are not listed in `HF_MODEL_TYPES`."""

_PLAIN = (str, int, float, bool, type(None))


class Decoder(NamedTuple):
    """A transformers causal LM cut into stages: what running one of them needs.

    Attributes:
        model: the causal LM, whose forward runs each stage.
        prefix: the decoder's name (``"model"``).
        head: the LM head's name (``"lm_head"``).
        width: the embedding's width (a zero embedding of it feeds the later stages).
        elsewhere: a stand-in for each decoder layer, in order.
        views: each stage's layer list as its forward sees it, by the stage's blocks,
            with the layers it was built from (built again if one of them changed).
    """

    model: Any  # a transformers PreTrainedModel (transformers is not imported here)
    prefix: str
    head: str
    width: int
    elsewhere: tuple[nn.Module, ...]
    views: dict[tuple[str, ...], tuple[list[nn.Module], nn.ModuleList]]


class Elsewhere(nn.Module):
    """A decoder layer that another stage runs: it returns the hidden states it is given.

    It keeps the layer's plain attributes (``attention_type``, ``layer_idx``...), which
    a family's forward may read from each layer as it loops; it holds no parameters.
    """

    def __init__(self, layer: nn.Module, outputs: int = 1) -> None:
        super().__init__()
        for name, value in vars(layer).items():
            if not name.startswith("_") and name != "training" and isinstance(value, _PLAIN):
                setattr(self, name, value)
        self.outputs = outputs  # how many values the family's forward unpacks (`LAYER_OUTPUTS`)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The hidden states it was given (first argument, or ``hidden_states=``).

        With ``outputs`` > 1: a tuple of them and ``None`` for each other value.
        """
        hidden = args[0] if args else kwargs.get("hidden_states")
        return hidden if self.outputs == 1 else (hidden, *(None,) * (self.outputs - 1))


class _StageEnd(Exception):
    """Raised by a stage's last layer to end the model's forward there."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class _Bound(nn.Module):
    """A stage's first or last layer: called with the received activation, or ending there."""

    def __init__(self, layer: nn.Module, given: torch.Tensor | None, ends: bool) -> None:
        super().__init__()
        self.layer = layer
        self.given = given
        self.ends = ends

    def __getattr__(self, name: str) -> Any:  # the layer's attributes, for the forward's loop
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.given is not None:
            if args:
                args = (self.given, *args[1:])
            elif "hidden_states" in kwargs:
                kwargs["hidden_states"] = self.given
            else:
                raise TypeError(f"pipeline: the decoder layer {type(self.layer).__name__} was "
                                f"called without its hidden states")
        out = self.layer(*args, **kwargs)
        if self.ends:
            raise _StageEnd(out[0] if isinstance(out, tuple) else out)
        return out


def _share(root: nn.Module, model: nn.Module) -> None:
    """Point ``model``'s top-level modules, parameters and buffers at the pipeline's.

    The pipeline holds the model's top-level children under the same names; one replaced
    on the pipeline since (a tensor-parallel LM head) must be the one the forward calls.
    """
    for table in ("_modules", "_parameters", "_buffers"):
        ours, theirs = getattr(root, table), getattr(model, table)
        for name, value in theirs.items():
            if name in ours and ours[name] is not value:
                theirs[name] = ours[name]
    model.training = root.training


def _view(decoder: Decoder, blocks: tuple[str, ...], layers: list[nn.Module], first: bool,
          last: bool) -> nn.ModuleList:
    """The layer list stage ``blocks`` runs: stand-ins but for ``layers``, bound at the ends."""
    view: list[nn.Module] = list(decoder.elsewhere)
    at = [int(name.rsplit(".", 1)[1]) for name in blocks]
    view[at[0]:at[-1] + 1] = layers
    if not first:
        view[at[0]] = _Bound(view[at[0]], None, ends=not last and at[0] == at[-1])
    if not last and (first or at[0] != at[-1]):
        view[at[-1]] = _Bound(view[at[-1]], None, ends=True)
    return nn.ModuleList(view)


def run_decoder_stage(root: nn.Module, blocks: tuple[str, ...], first: bool, last: bool,
                      x: torch.Tensor, decoder: Decoder,
                      model_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The stage of ``blocks`` (dense names of decoder layers) on ``x``: logits or hidden.

    ``x``: the token ids on the first stage, else the previous stage's output;
    ``model_inputs``: more keyword inputs of the model's forward (``attention_mask``,
    ``position_ids``), this microbatch's rows. The layers are looked up in ``root`` (the
    pipeline) at every call, so layers changed there since (by ``parallelize``,
    ``fully_shard``) are the ones that run.
    """
    model = decoder.model
    _share(root, model)
    inner = model.get_submodule(decoder.prefix)
    held = inner._modules["layers"]
    layers = [root.get_submodule(name) for name in blocks]
    built, view = decoder.views.get(blocks, (None, None))
    if view is None or built is None or any(a is not b for a, b in zip(built, layers, strict=True)):
        view = _view(decoder, blocks, layers, first, last)
        decoder.views[blocks] = (layers, view)
    start = view[int(blocks[0].rsplit(".", 1)[1])]
    if isinstance(start, _Bound) and not first:
        start.given = x
    inner._modules["layers"] = view
    try:
        if first:
            out = model(input_ids=x, use_cache=False, **model_inputs)
        else:
            zeros = x.new_zeros((*x.shape[:2], decoder.width))
            out = model(inputs_embeds=zeros, use_cache=False, **model_inputs)
    except _StageEnd as end:
        return end.hidden
    finally:
        inner._modules["layers"] = held
        if isinstance(start, _Bound):
            start.given = None  # not kept alive by the view until the next call
    logits: torch.Tensor = out.logits if hasattr(out, "logits") else out[0]
    return logits  # (B, T, vocab)
