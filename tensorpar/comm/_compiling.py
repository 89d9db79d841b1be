"""Whether the caller runs under ``torch.compile``: the switch between eager and traced paths."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.compiler import is_compiling

from tensorpar._torch import get_eval_frame_callback

__all__ = ["FORCE_EAGER", "autocast_on", "compiling", "force_eager"]

FORCE_EAGER = hasattr(torch.compiler, "set_stance")
"""Whether `force_eager` can switch compiled code off (torch 2.6 and later)."""


def compiling() -> bool:
    """True while dynamo traces the caller, or while a compiled frame is being entered.

    ``is_compiling()`` alone is False in the eager frames dynamo runs around a graph break
    and at the first call of a compiled function; the eval-frame callback is set there.
    """
    return is_compiling() or get_eval_frame_callback() is not None


def autocast_on(device_type: str) -> bool:
    """Whether autocast is active for ``device_type`` (True where torch cannot say)."""
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except (TypeError, RuntimeError):  # an older torch, or a device without autocast (meta)
        return True


def force_eager() -> contextlib.AbstractContextManager[Any]:
    """A context in which ``torch.compile`` directives are ignored (compiled code runs eagerly).

    ``torch.compiler.set_stance("force_eager")`` (torch 2.6 and later); on an older torch,
    nothing.
    """
    if not FORCE_EAGER:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")  # type: ignore[no-any-return]
