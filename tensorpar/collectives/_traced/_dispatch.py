"""Where a public collective goes under ``torch.compile``: decided here, once per call.

A public function that finds itself compiled (`tensorpar.comm._compiling.compiling`) calls
`compiled_call` with itself, its traced namesake and whether this call can trace. The call
traces when dynamo is tracing it, validation mode is off and the call's arguments let every
rank know, at trace time and without asking its peers, the shape of what travels. Otherwise
the public function runs eagerly between two graphs (one graph break): a call that needs a
header exchange, validation's fingerprints, or one that dynamo runs for real inside a
compiled function (a frame it skipped), which must keep dynamo out of tensorpar's eager
internals (they talk to the process group directly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.compiler import is_compiling

from tensorpar.collaborative import CollaborativeTensor
from tensorpar.comm._launch import Launch
from tensorpar.comm._switch import VALIDATE

__all__ = ["between_graphs", "compiled_call", "result"]

R = TypeVar("R")


@torch.compiler.disable  # type: ignore[untyped-decorator]
def between_graphs(public: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
    """``public(*args, **kwargs)``, eagerly: dynamo breaks the graph around this call.

    Inside it ``compiling()`` is False, so ``public`` takes its eager path.
    """
    return public(*args, **kwargs)


def compiled_call(public: Callable[..., R], traced: Callable[..., R], traceable: bool, /,
                  *args: Any, **kwargs: Any) -> R:
    """Run a compiled call of ``public``: ``traced`` when it traces, else ``public`` eagerly."""
    if traceable and not VALIDATE[0] and is_compiling():
        return traced(*args, **kwargs)
    out: R = between_graphs(public, *args, **kwargs)
    return out


def result(out: torch.Tensor, async_op: bool) -> torch.Tensor | CollaborativeTensor:
    """``out``, or with ``async_op`` a resolved handle to it.

    The wait is already in the graph (``wait_tensor``), where the compiler may move it.
    """
    return CollaborativeTensor(out, Launch(False)) if async_op else out
