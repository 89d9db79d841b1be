"""How a parallel layer runs one call: decided here, once per call, for every layer.

The layers have one hand-written autograd Function each for the common case (the
communication fused with the matmul, or a cached split), and fall back to other paths where
it does not apply. Which one runs depends on the same few conditions everywhere, read here.
"""

from __future__ import annotations

import enum

import torch

from tensorpar.collectives._autograd import needs_graph
from tensorpar.comm._compiling import autocast_on, compiling
from tensorpar.comm._group import Group
from tensorpar.comm._switch import VALIDATE

__all__ = ["LayerPath", "autocast_on", "layer_path", "validating"]


class LayerPath(enum.Enum):
    SINGLE = "single"
    """A group of one rank: the dense arithmetic, no collective."""
    COMPOSED = "composed"
    """The composition of public region calls (``F.linear`` around them): validation mode
    (each call fingerprinted), autocast (whose casts the composition handles as dense code
    does), or ``torch.compile`` (the region calls trace, and the compiler derives the
    backward and schedules the collectives around the matmuls itself)."""
    NO_GRAPH = "no_graph"
    """No autograd graph is recorded (inference): the forward arithmetic alone."""
    FUSED = "fused"
    """The layer's own autograd Function."""


def layer_path(x: torch.Tensor, group: Group, *, casts: bool = True) -> LayerPath:
    """The path a layer takes for input ``x`` on ``group``.

    ``casts``: whether autocast changes what the layer computes (a matmul: yes; a split of
    its input: no, so it keeps its fused path under autocast).
    """
    if group.is_single:
        return LayerPath.SINGLE
    if VALIDATE[0] or (casts and autocast_on(x.device.type)) or compiling():
        return LayerPath.COMPOSED
    if not torch.is_grad_enabled() and not needs_graph(x):  # (a forward-AD level keeps it)
        return LayerPath.NO_GRAPH
    return LayerPath.FUSED


def validating() -> bool:
    """Whether validation mode is on (the layers compare their replicated inputs then)."""
    return bool(VALIDATE[0])
