"""Whether the caller runs under ``torch.compile``: the switch between eager and traced paths."""

from __future__ import annotations

from torch.compiler import is_compiling

from tensorpar._torch import get_eval_frame_callback

__all__ = ["compiling"]


def compiling() -> bool:
    """True while dynamo traces the caller, or while a compiled frame is being entered.

    ``is_compiling()`` alone is False in the eager frames dynamo runs around a graph break
    and at the first call of a compiled function; the eval-frame callback is set there.
    """
    return is_compiling() or get_eval_frame_callback() is not None
