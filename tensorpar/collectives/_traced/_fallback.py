"""The two ends of every traced collective: the eager fallback and the async result."""

from __future__ import annotations

from typing import Any

import torch

from tensorpar.collaborative import CollaborativeTensor
from tensorpar.collectives._autograd import Launch

__all__ = ["eager", "result"]

_REGIONS = ("copy_to_group", "gather_from_group", "reduce_from_group", "split_to_group")


@torch.compiler.disable  # type: ignore[untyped-decorator]
def eager(fn: str, *args: Any, **kwargs: Any) -> Any:
    """Run the public collective ``fn`` eagerly: dynamo breaks the graph around this call.

    Inside it ``torch.compiler.is_compiling()`` is False, so the public function takes its
    eager path (header exchanges, validation's fingerprints, placeholders).
    """
    # the public modules call into this package: import them at call time (an arrow back
    # up that the import graph shows; it goes when each entry point dispatches its own mode)
    from tensorpar.collectives import functional, regions

    return getattr(regions if fn in _REGIONS else functional, fn)(*args, **kwargs)


def result(out: torch.Tensor, async_op: bool) -> torch.Tensor | CollaborativeTensor:
    """``out``, or with ``async_op`` a resolved handle to it.

    The wait is already in the graph (``wait_tensor``), where the compiler may move it.
    """
    return CollaborativeTensor(out, Launch(False)) if async_op else out
