"""The two ends of every traced collective: the eager fallback and the async result."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from tensorpar._autograd import Launch
from tensorpar.collaborative import CollaborativeTensor

__all__ = ["eager", "result"]

_PUBLIC = {"all_gather": "tensorpar.functional", "all_reduce": "tensorpar.functional",
           "all_to_all": "tensorpar.functional", "broadcast": "tensorpar.functional",
           "gather": "tensorpar.functional", "reduce": "tensorpar.functional",
           "reduce_scatter": "tensorpar.functional", "scatter": "tensorpar.functional",
           "copy_to_group": "tensorpar.regions", "gather_from_group": "tensorpar.regions",
           "reduce_from_group": "tensorpar.regions", "split_to_group": "tensorpar.regions"}


@torch.compiler.disable  # type: ignore[untyped-decorator]
def eager(fn: str, *args: Any, **kwargs: Any) -> Any:
    """Run the public collective ``fn`` eagerly: dynamo breaks the graph around this call.

    Inside it ``torch.compiler.is_compiling()`` is False, so the public function takes its
    eager path (header exchanges, validation's fingerprints, placeholders).
    """
    return getattr(importlib.import_module(_PUBLIC[fn]), fn)(*args, **kwargs)


def result(out: torch.Tensor, async_op: bool) -> torch.Tensor | CollaborativeTensor:
    """``out``, or with ``async_op`` a resolved handle to it.

    The wait is already in the graph (``wait_tensor``), where the compiler may move it.
    """
    return CollaborativeTensor(out, Launch(False)) if async_op else out
