"""Expert-parallel plans for transformers' mixture-of-experts models.

`plan_from_transformers(model, experts="expert_parallel")` hands its tensor-parallel plan
here: every experts module (stacked ``gate_up_proj``/``down_proj``) becomes `ExpertParallel`,
the shared experts of the MoE blocks (Qwen2-MoE's ``shared_expert``, DeepSeek's
``shared_experts``) are split like a dense MLP, and the router, the shared-expert gate and
everything the plan leaves out stay replicated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import nn

from tensorpar.nn.experts import ExpertParallel, experts_problem
from tensorpar.nn.plans.plan import Colwise, Rowwise, Style, match_module

__all__ = ["ExpertsMode", "check_experts_mode", "expert_parallel_plan"]

ExpertsMode = Literal["replicated", "expert_parallel"]
_SHARED = ("shared_expert", "shared_experts")


def check_experts_mode(fn: str, experts: object) -> None:
    """Raise unless ``experts`` is a known mode."""
    if experts not in ("replicated", "expert_parallel"):
        raise ValueError(f"{fn}: experts={experts!r}; expected 'replicated' (every rank "
                         f"holds every expert) or 'expert_parallel'")


def expert_parallel_plan(model: nn.Module, plan: Mapping[str, Style], *,
                         reduce_dtype: torch.dtype | None = None) -> dict[str, Style]:
    """``plan`` with ``model``'s experts split by expert and its shared experts by feature.

    Patterns of ``plan`` that match no module are dropped (a dense-MLP pattern of a model
    whose every layer is a mixture-of-experts block).

    Args:
        model: a transformers mixture-of-experts model.
        plan: its tensor-parallel plan (attention, dense MLPs, embeddings).
        reduce_dtype: the row-parallel layers' ``reduce_dtype`` (shared experts).

    Returns:
        The plan with an `ExpertParallel` entry per experts module (one pattern per
        layer-index-free name) and the shared experts' projections.

    Raises:
        ValueError: the model has no experts module, or one that cannot be split by expert.
    """
    fn = "plan_from_transformers(experts='expert_parallel')"
    names = [n for n, m in model.named_modules() if n and _stacked_experts(m)]
    if not names:
        raise ValueError(f"{fn}: {type(model).__name__} has no experts module (stacked "
                         f"gate_up_proj/down_proj parameters) to split")
    problems = [p for p in (experts_problem(n, model.get_submodule(n)) for n in names) if p]
    if problems:
        raise ValueError(f"{fn}: " + "; ".join(problems))
    modules = [n for n, _ in model.named_modules() if n]
    out = {k: v for k, v in plan.items() if any(match_module(k, n) for n in modules)
           and not any(match_module(k, n) for n in names)}
    for name in names:
        out[_pattern(name)] = ExpertParallel()
        parent = name.rpartition(".")[0]
        for shared in _SHARED:
            mlp = _submodule(model, f"{parent}.{shared}" if parent else shared)
            if mlp is None or not all(isinstance(getattr(mlp, p, None), nn.Linear)
                                      for p in ("gate_proj", "up_proj", "down_proj")):
                continue
            base = _pattern(f"{parent}.{shared}" if parent else shared)
            out.setdefault(f"{base}.gate_proj", Colwise())
            out.setdefault(f"{base}.up_proj", Colwise())
            out.setdefault(f"{base}.down_proj", Rowwise(reduce_dtype=reduce_dtype))
    return out


def _stacked_experts(module: nn.Module) -> bool:
    """A transformers experts module: stacked 3-D expert weights under the usual names."""
    first = getattr(module, "gate_up_proj", None)
    if first is None:
        first = getattr(module, "up_proj", None)
    down = getattr(module, "down_proj", None)
    return all(isinstance(p, nn.Parameter) and p.ndim == 3 for p in (first, down))


def _pattern(name: str) -> str:
    """``model.layers.3.mlp.experts`` -> ``model.layers.*.mlp.experts``."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
