"""Checking and installing a plan's sequence-parallel styles (see `tensorpar.nn.sequence`)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from tensorpar.comm._group import Group
from tensorpar.nn.layers.embedding import VocabParallelEmbedding
from tensorpar.nn.layers.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.nn.plans.inplace_styles import PartialGrad
from tensorpar.nn.plans.plan import Colwise, PackedColwise, Rowwise, Style, Vocab
from tensorpar.nn.sequence import (
    SEQUENCE_STYLES,
    SequenceGather,
    SequenceParallel,
    SequenceShards,
    SequenceSplit,
    install_sequence_style,
)
from tensorpar.nn.state.partial_grad import install_partial_grad

__all__ = ["check_sequence", "install_sequence"]


def _inside(name: str, parent: str) -> bool:
    return name.startswith(parent + ".")


def check_sequence(model: nn.Module, assignments: Mapping[str, Style]) -> list[str]:
    """What keeps the plan's sequence-parallel styles from being right (empty: nothing)."""
    styled = {n: s for n, s in assignments.items() if isinstance(s, SEQUENCE_STYLES)}
    starts = [n for n, s in assignments.items() if isinstance(s, SequenceSplit)
              or (isinstance(s, Vocab) and s.sequence_parallel)]
    if not styled and not starts:
        return []
    problems = []
    dims = {s.dim for s in styled.values()}
    if len(dims) > 1:
        problems.append(f"sequence-parallel styles give different sequence dims {sorted(dims)}; "
                        f"a model has one: " + ", ".join(f"{n!r}: {s}" for n, s in styled.items()))
    if not starts:
        problems.append("sequence-parallel styles without a SequenceSplit: nothing splits the "
                        "sequence (put SequenceSplit on the first module of the region, e.g. the "
                        "first decoder layer, or split the embedding with "
                        "Vocab(sequence_parallel=True))")
    elif len(starts) > 1:
        problems.append(f"the sequence is split in several places ({starts}); a model's "
                        f"sequence-parallel region starts once")
    for name, style in styled.items():
        if isinstance(style, SequenceGather):
            problems += _check_gathered(model, name, assignments)
        elif isinstance(style, SequenceParallel):
            inner = [n for n in assignments if _inside(n, name)]
            if inner:
                problems.append(f"{name!r} (SequenceParallel) runs whole on the sequence slice, "
                                f"but the plan also styles modules inside it: {inner}")
    return problems


def _check_gathered(model: nn.Module, gname: str, assignments: Mapping[str, Style]
                    ) -> list[str]:
    """Inside a `SequenceGather` module only split layers and partial-gradient parameters."""
    problems = []
    for name, style in assignments.items():
        if not _inside(name, gname):
            continue
        if isinstance(style, SEQUENCE_STYLES):
            problems.append(f"{name!r} ({type(style).__name__}) sits inside {gname!r} "
                            f"(SequenceGather), which already runs on the whole sequence")
        elif isinstance(style, (Colwise, PackedColwise)) and style.gather_output:
            problems.append(f"{name!r}: {style} inside SequenceGather {gname!r}: a gathered "
                            f"output is whole on every rank, so its gradient is not a partial "
                            f"share the sequence reduce-scatter may sum; split it without "
                            f"gather_output, or leave {gname!r} out of sequence parallelism")
        elif isinstance(style, Rowwise) and not style.input_is_parallel:
            problems.append(f"{name!r}: {style} inside SequenceGather {gname!r}: the input "
                            f"must be the column layers' slice (input_is_parallel=True)")
        elif isinstance(style, (Colwise, PackedColwise, Rowwise)) \
                and type(model.get_submodule(name)) is not nn.Linear:
            problems.append(f"{name!r} is a {type(model.get_submodule(name)).__name__}; inside "
                            f"SequenceGather {gname!r} tensorpar splits nn.Linear layers only")
    covered = {n for n, s in assignments.items() if _inside(n, gname)
               and isinstance(s, (Colwise, PackedColwise, Rowwise, PartialGrad))}
    loose = [f"{gname}.{p}" for p, _ in model.get_submodule(gname).named_parameters()
             if f"{gname}.{p}".rpartition(".")[0] not in covered]
    if loose:
        problems.append(f"SequenceGather {gname!r} holds parameters that no split layer or "
                        f"PartialGrad covers: {loose}. Every rank computes them whole from the "
                        f"gathered input, so their gradient would be counted once per rank by "
                        f"the sequence reduce-scatter; split them, mark them PartialGrad if each "
                        f"rank's use covers its own heads only, or leave {gname!r} out of "
                        f"sequence parallelism")
    return problems


def install_sequence(model: nn.Module, assignments: Mapping[str, Style],
                     built: Mapping[str, nn.Module], group: Group) -> None:
    """Add the hooks of the plan's sequence-parallel styles (checked by `check_sequence`)."""
    styled = {n: s for n, s in assignments.items() if isinstance(s, SEQUENCE_STYLES)}
    embeddings = [n for n, s in assignments.items() if isinstance(s, Vocab)
                  and s.sequence_parallel]
    if not styled and not embeddings:
        return
    shards = SequenceShards(group, next(iter(styled.values())).dim if styled else 1)
    for name in embeddings:
        layer = built[name]
        if isinstance(layer, VocabParallelEmbedding):
            layer.sequence = shards
    for name, style in styled.items():
        module = model.get_submodule(name)
        install_sequence_style(module, style, shards)
        if isinstance(style, SequenceSplit):
            install_partial_grad(module, group.handle)  # it sees this rank's slice only
        elif isinstance(style, SequenceParallel):  # all of it runs on the slice
            for sub in module.modules():
                install_partial_grad(sub, group.handle)
        if not isinstance(style, SequenceGather):
            continue
        for layer_name, layer in built.items():
            if not _inside(layer_name, name):
                continue
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                layer.sequence = shards
            if isinstance(layer, RowParallelLinear) and layer.bias is not None:
                install_partial_grad(layer, group.handle, names=["bias"])
