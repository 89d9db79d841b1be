"""Halo rows sent ahead with a norm's statistics, for the convolution after it.

In a block ``conv -> norm -> activation -> conv`` the norm exchanges its statistics with
every rank, and the next convolution then exchanges its halo rows: two waits for the
other ranks in a row. The norm can send the raw rows that convolution will need in its
own exchange instead (`tensorpar.domain._layers.fused_norm`): the receiver normalises them
with the domain's statistics, the pointwise calls between the two layers run on them as
on the tile (`Ahead.carry`), and the convolution takes them (`take`) with no exchange of its
own. Backward mirrors it: the rows' gradients go home in the norm's exchange of sums.

Which rows a norm sends is learnt from the forward before (`Ahead.request`, per call of
the norm): a convolution fed by a norm call's output through pointwise calls records its
window there; that call in the next forward sends the rows of that window. Everything
deciding whether rows go ahead and whether a convolution takes them is the same on every
rank (the model's calls, the windows, every rank's tile sizes), so the ranks agree without
asking. Where anything differs (another convolution, a call that is not pointwise, an
in-place change), the convolution exchanges its rows as usual; rows sent ahead and not
taken cost only their bytes, and their request is let go.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["Ahead", "Request", "Rows", "Source"]

Request = tuple[int, tuple[tuple[int, int, int, int, bool], ...], str]
"""A convolution's request: its spatial dims, its windows (see `window`), its padding mode."""

_POINTWISE = frozenset({
    F.relu, F.relu6, F.silu, F.gelu, F.elu, F.selu, F.celu, F.leaky_relu, F.mish, F.softplus,
    F.hardswish, F.hardsigmoid, F.hardtanh, F.sigmoid, F.tanh, F.logsigmoid,
    torch.relu, torch.sigmoid, torch.tanh,
    torch.Tensor.relu, torch.Tensor.sigmoid, torch.Tensor.tanh})
"""Calls that act on each point alone (their other arguments are not tensors)."""

_DROPOUTS = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d})
"""Carried where they drop nothing (``p=0``, or not training): a block's dropout of 0."""


def _drops_nothing(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", True)
    return p == 0 or not training


Source = tuple[Any, int]
"""A norm's call: the norm (its layer) and the call's place among its calls this forward."""


@dataclass(frozen=True)
class Rows:
    """Rows sent ahead, as the convolution will read them.

    ``arrived``: the rows received, by source rank, along the split dim, with every
    pointwise call since the norm applied (``None``: none were sent, only the source is
    known); ``window``: the request they answer; ``source``: the norm's call that sent
    them; ``version``: the tensor's version when recorded (an in-place change since voids
    them).
    """

    arrived: torch.Tensor | None
    window: Request | None
    source: Source
    version: int


class Ahead:
    """One converted model's rows sent ahead: requests across forwards, rows within one.

    A request is kept per norm call (a norm called twice a forward has two), and let go
    after a forward whose rows no convolution took (the model took another road). Requests
    are held by the norm itself, weakly, never by its ``id``: a norm that goes (a functional
    norm's layer lives for one call) takes its requests with it, and a new object that
    happens to get its address on one rank finds none there, as on every other rank.
    """

    def __init__(self) -> None:
        self._requests: weakref.WeakKeyDictionary[Any, dict[int, Request]] = \
            weakref.WeakKeyDictionary()
        self._rows: dict[int, tuple[weakref.ref[torch.Tensor], Rows]] = {}
        self._calls: dict[int, int] = {}
        self._sent: dict[Source, Request] = {}
        self._taken: set[Source] = set()

    def clear(self) -> None:
        """Forget this forward's rows and calls (the requests stay)."""
        self._rows.clear()
        self._calls.clear()
        self._sent.clear()
        self._taken.clear()

    def finish(self) -> None:
        """End a forward: let go the requests whose rows went and were not taken; `clear`."""
        for (norm, n), window in self._sent.items():
            mine = self._requests.get(norm, {})
            if (norm, n) not in self._taken and mine.get(n) == window:
                del mine[n]
        self.clear()

    def source(self, norm: Any) -> Source:
        """The next call of the norm ``norm`` (its layer) in this forward."""
        n = self._calls.get(id(norm), 0)
        self._calls[id(norm)] = n + 1  # (``norm`` lives through the forward: `Rows` holds it)
        return norm, n

    def request(self, source: Source) -> Request | None:
        """The window a convolution fed by this norm call asked for, if any."""
        return self._requests.get(source[0], {}).get(source[1])

    def offer(self, t: torch.Tensor, rows: Rows) -> None:
        """Record that ``t``'s halo rows (or only its source) are at hand."""
        self._rows[id(t)] = (weakref.ref(t), rows)
        if rows.arrived is not None and rows.window is not None:
            self._sent[rows.source] = rows.window

    def rows_of(self, t: torch.Tensor) -> Rows | None:
        """What `offer` recorded for ``t``, unless ``t`` was changed in place since."""
        entry = self._rows.get(id(t))
        if entry is None or entry[0]() is not t or entry[1].version != t._version:
            return None
        return entry[1]

    def take(self, t: torch.Tensor, window: Request, exchanges: bool) -> torch.Tensor | None:
        """The rows a convolution of ``window`` over ``t`` needs, if they were sent ahead.

        Where ``t`` came from a norm's call whose rows no convolution took yet, but none (or
        those of another window) were sent, records the request for that call in the next
        forward (``exchanges``: the window needs rows from other ranks at all).
        """
        rows = self.rows_of(t)
        if rows is None:
            return None
        if rows.window == window and rows.arrived is not None:
            self._taken.add(rows.source)
            return rows.arrived
        if exchanges and rows.source not in self._taken:
            norm, n = rows.source
            self._requests.setdefault(norm, {})[n] = window
        return None

    def carry(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """After a call: carry the rows sent ahead through a pointwise call (see the module doc).

        ``func(x, ...)`` with ``x`` holding rows and no other tensor argument gives rows
        ``func(rows, ...)`` to ``out`` (``inplace=True`` too: ``out`` is ``x``, changed).
        """
        identity = func in _DROPOUTS and _drops_nothing(args, kwargs)
        if not (identity or func in _POINTWISE) or not args or \
                not isinstance(out, torch.Tensor):
            return
        x = args[0]
        if not isinstance(x, torch.Tensor) or any(isinstance(a, torch.Tensor) for a in args[1:]) \
                or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return
        entry = self._rows.get(id(x))
        if entry is None or entry[0]() is not x:
            return
        before = entry[1]
        if before.version != (x._version - 1 if out is x else x._version):
            return  # changed in place by something else first
        arrived = before.arrived if before.arrived is None or identity else \
            func(before.arrived, *args[1:], **kwargs)
        self.offer(out, Rows(arrived, before.window, before.source, out._version))
