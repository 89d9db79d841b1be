"""Hand plans checked against a transformers model's own plan, and whole-logit readers guarded.

Where transformers (or tensorpar, for the architectures it plans itself) says how a module
must be split, a hand plan that splits it another way is wrong in a way the sizes do not
show: plain ``colwise`` on Phi-3's packed ``[gate; up]`` gives every rank a slice of ``gate``
only; ``colwise`` on GPT-2's ``c_attn`` meets a forward that slices it at global offsets. These
checks run in `parallelize` before anything changes, on every rank with the same inputs, so
every rank raises the same error.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from tensorpar.nn.hf.plan import plan_from_transformers
from tensorpar.nn.plans.inplace_styles import INPLACE_STYLES
from tensorpar.nn.plans.plan import Colwise, PackedColwise, Rowwise, Style, layout, match_module

__all__ = ["check_own_plan", "guard_whole_logits"]


def own_plan(model: nn.Module) -> dict[str, Style]:
    """The model's own plan per module name (empty where none is known or it is refused)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        return {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_from_transformers(model)
    except (ValueError, TypeError, AttributeError):
        return {}
    names = [n for n, _ in model.named_modules() if n]
    return {n: style for pattern, style in plan.items() for n in names
            if match_module(pattern, n)}


def check_own_plan(model: nn.Module, assignments: Mapping[str, Style], size: int) -> list[str]:
    """Every module the hand plan splits against the model's own plan (one line each)."""
    reference = own_plan(model)
    if not reference:
        return []
    arch = model.config.model_type  # type: ignore[union-attr]
    problems = []
    for name, ref in reference.items():
        got = assignments.get(name)
        why = _conflict(model, name, got, ref, assignments, size)
        if why:
            problems.append(f"{name!r}: the plan gives {got if got is not None else 'replicated'}"
                            f", but {arch}'s own plan (plan_from_transformers) needs {ref}: "
                            f"{why}")
    return problems


def _conflict(model: nn.Module, name: str, got: Style | None, ref: Style,
              assignments: Mapping[str, Style], size: int) -> str | None:
    if isinstance(ref, INPLACE_STYLES):
        if got == ref:
            return None
        parent = name.rpartition(".")[0]
        if got is None and not any(n.rpartition(".")[0] == parent for n in assignments):
            return None  # nothing around it is split: its gradient is whole
        return ("its parameters see only this rank's heads, so their gradient is partial "
                "and must be summed over the group")
    if got is None:
        return None  # a replicated layer computes the dense result
    module = model.get_submodule(name)
    gathered = isinstance(got, (Colwise, PackedColwise)) and got.gather_output
    if isinstance(ref, (Colwise, PackedColwise)) and ref.gather_output:
        if gathered:
            return None
        return ("the model's forward slices this output at positions computed from global "
                "sizes, so it must be gathered (gather_output=True)")
    if isinstance(ref, PackedColwise):
        if gathered or (isinstance(got, PackedColwise)
                        and _where(got, module, size) == _where(ref, module, size)):
            return None
        return ("the output is blocks the model cuts apart (e.g. [gate; up] by chunk(2)); a "
                "plain split gives a rank a slice of one block only")
    if isinstance(ref, Colwise) and ref.multiple_of > 1 and not gathered:
        if isinstance(got, (Colwise, PackedColwise)) \
                and _where(got, module, size) == _where(ref, module, size):
            return None
        return (f"the model reads whole heads off this output: shards must be whole heads, "
                f"split as {_where(ref, module, size)} (dim, sizes per rank); got "
                f"{_where(got, module, size)}")
    if isinstance(ref, Rowwise) and isinstance(got, Rowwise):
        if not ref.input_is_parallel and got.input_is_parallel:
            return ("its input is whole on every rank (the layer before it gathers), so it "
                    "must split its input itself (input_is_parallel=False)")
        if ref.input_is_parallel and ref.multiple_of > 1 and got.input_is_parallel \
                and _where(got, module, size) != _where(ref, module, size):
            return (f"its input is the rank's heads, split as {_where(ref, module, size)} "
                    f"(dim, sizes per rank); got {_where(got, module, size)}")
    return None


def _where(style: Style, module: nn.Module, size: int) -> Any:
    try:
        return layout(style, module, "weight", size)
    except (AssertionError, ValueError, ZeroDivisionError):
        return None


def guard_whole_logits(model: nn.Module, head_name: str) -> None:
    """Make ``generate()`` and ``labels=`` refuse a model whose LM head is vocab-parallel.

    Each rank holds its slice of the vocabulary's logits; generation and transformers'
    own loss read whole logits and would go wrong silently, differently on every rank.
    """
    generate = getattr(model, "generate", None)
    if callable(generate):
        def refuse_generate(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(_whole_logits("generate()", head_name))
        model.__dict__["generate"] = refuse_generate  # shadows the method on this instance

    def refuse_labels(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs.get("labels") is not None:
            raise RuntimeError(_whole_logits("forward(labels=...)", head_name))

    model.register_forward_pre_hook(refuse_labels, with_kwargs=True)


def _whole_logits(what: str, head_name: str) -> str:
    return (f"{what}: the LM head {head_name!r} is vocab-parallel (lm_head='vocab_parallel'): "
            f"each rank holds only its slice of the logits, and this reads whole logits. Plan "
            f"the model with plan_from_transformers(model, lm_head='gathered') for generation "
            f"and labels=, or train with tensorpar.nn.vocab_parallel_cross_entropy on the "
            f"local logits")
