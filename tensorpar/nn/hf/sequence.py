"""Sequence parallelism for transformers decoder models: the styles added to a tensor-parallel plan.

The region runs from the first decoder layer's input to the last norm's output. The
embedding stays as tensor parallelism has it (its output whole on every rank): transformers
models read the embedding output's length for the positions and the attention mask before
the first layer, so the sequence is split at the first layer's input (`SequenceSplit`).
Inside each layer, the children holding split layers (attention, MLP) gather the sequence
(`SequenceGather`), the others (norms) run on the slice (`SequenceParallel`), and the last
norm gathers its output for the LM head.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from tensorpar.nn.plans.plan import (
    Colwise,
    MlaKvAProj,
    PackedColwise,
    PartialGrad,
    Rowwise,
    SequenceGather,
    SequenceParallel,
    SequenceSplit,
    Style,
    match_module,
)

__all__ = ["sequence_parallel_plan"]

_FN = "plan_from_transformers(sequence_parallel=True)"


def sequence_parallel_plan(model: nn.Module, plan: Mapping[str, Style], prefix: str, *,
                           regather: bool = False) -> dict[str, Style]:
    """``plan`` with the sequence-parallel styles of ``model``'s decoder layers added.

    Raises:
        ValueError: the model is an encoder-decoder, has no decoder layer list or no final
            norm, or a layer's attention/MLP holds parameters the plan does not split
            (mixture-of-experts blocks, latent attention, whole-head attention).
    """
    config = getattr(model, "config", None)
    arch = getattr(config, "model_type", type(model).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{_FN}: {arch} is an encoder-decoder model; tensorpar's sequence "
                         f"parallelism covers decoder-only models")
    base = model.get_submodule(prefix[:-1]) if prefix else model
    styles = {n: st for pattern, st in plan.items() for n, _ in model.named_modules()
              if n and match_module(pattern, n)}
    children = list(base.named_children())
    stack = next((i for i, (_, c) in enumerate(children) if isinstance(c, nn.ModuleList)
                  and any(n.startswith(f"{prefix}{children[i][0]}.") for n in styles)), None)
    if stack is None:
        raise ValueError(f"{_FN}: {arch}: found no list of decoder layers holding split "
                         f"layers in {type(base).__name__}")
    layers_name, layers = prefix + children[stack][0], children[stack][1]
    assert isinstance(layers, nn.ModuleList)
    out = dict(plan)
    out[f"{layers_name}.0"] = SequenceSplit()
    per_child: dict[str, Style] = {}
    for i, layer in enumerate(layers):
        for child_name, child in layer.named_children():
            full = f"{layers_name}.{i}.{child_name}"
            style = _child_style(arch, full, child, styles, regather)
            if style is None:
                continue
            if per_child.setdefault(child_name, style) != style:
                raise ValueError(f"{_FN}: {arch}: {child_name!r} runs on the sequence slice in "
                                 f"some decoder layers and gathers it in others")
    for child_name, style in per_child.items():
        out[f"{layers_name}.*.{child_name}"] = style
    finals = [prefix + n for n, c in children[stack + 1:]
              if any(True for _ in c.parameters()) and prefix + n not in styles]
    if len(finals) != 1:
        raise ValueError(f"{_FN}: {arch}: expected one norm after the decoder layers in "
                         f"{type(base).__name__}, found {finals or 'none'}")
    out[finals[0]] = SequenceParallel(gather_output=True)
    return out


def _child_style(arch: str, name: str, child: nn.Module, styles: Mapping[str, Style],
                 regather: bool) -> Style | None:
    """A decoder layer's child: gathered (holds split layers), on the slice (a norm), or none."""
    inner = {n: st for n, st in styles.items() if n.startswith(name + ".")}
    if name in styles:
        raise ValueError(f"{_FN}: {arch}: {name!r} ({styles[name]}) is a direct child of a "
                         f"decoder layer; tensorpar gathers the sequence for the modules that "
                         f"hold split layers (attention, MLP)")
    if not inner:
        nested = [f"{name}.{p}" for p, _ in child.named_parameters() if "." in p]
        if nested:  # not a norm: e.g. a mixture-of-experts block left replicated
            raise ValueError(f"{_FN}: {arch}: {name!r} ({type(child).__name__}) is left "
                             f"replicated with parameters in its own layers ({nested[:3]}): "
                             f"a mixture-of-experts block, which tensorpar's sequence "
                             f"parallelism does not cover yet")
        return SequenceParallel() if any(True for _ in child.parameters()) else None
    for n, st in inner.items():
        whole = (isinstance(st, (Colwise, PackedColwise)) and st.gather_output) \
            or (isinstance(st, Rowwise) and not st.input_is_parallel)
        if whole or not isinstance(st, (Colwise, PackedColwise, Rowwise, PartialGrad)):
            what = "multi-head latent attention" if isinstance(st, MlaKvAProj) else \
                "attention or MLP that runs whole on every rank"
            raise ValueError(f"{_FN}: {arch}: {n!r} is planned {st} ({what}); sequence "
                             f"parallelism needs the attention and MLP split by heads and "
                             f"features throughout (tensorpar does not cover this layer yet)")
    loose = [f"{name}.{p}" for p, _ in child.named_parameters()
             if f"{name}.{p}".rpartition(".")[0] not in inner]
    if loose:
        raise ValueError(f"{_FN}: {arch}: {name!r} holds parameters the tensor-parallel plan "
                         f"does not split ({loose[:4]}{'...' if len(loose) > 4 else ''}): a "
                         f"mixture-of-experts block or latent attention, which tensorpar's "
                         f"sequence parallelism does not cover yet")
    return SequenceGather(regather=regather)
