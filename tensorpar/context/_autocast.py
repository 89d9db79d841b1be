"""Attention under autocast computes as SDPA does there: in autocast's dtype."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["as_sdpa_under_autocast"]


def as_sdpa_under_autocast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                      contextlib.AbstractContextManager[object]]:
    """``q``, ``k``, ``v`` cast as autocast casts SDPA's inputs, and a context to run in.

    Where autocast is on for ``q``'s device, float32/float16/bfloat16 inputs go to its
    dtype (float64 stays, as autocast leaves it) and the context turns autocast off, so the
    attention (its transfers included) runs as on inputs of that dtype without autocast;
    the casts carry the gradients back in the inputs' dtypes. Elsewhere: the inputs as they
    are and a context that does nothing.
    """
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v, contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(device)
    q, k, v = (t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t
               for t in (q, k, v))
    return q, k, v, torch.autocast(device, enabled=False)
