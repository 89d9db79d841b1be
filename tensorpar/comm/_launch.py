"""The work handles one collective call launched: waited on together, then finished."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SYNC", "Launch"]


class Launch:
    """Collects the work handles of collectives launched with ``async_op=True``.

    A synchronous launch (``async_op=False``) keeps nothing: ``_comm`` calls return ``None``.
    """

    def __init__(self, async_op: bool) -> None:
        self.async_op = async_op
        self.works: list[Any] = []
        self.keepalive: list[torch.Tensor] = []
        self.finishers: list[Callable[[], object]] = []

    def add(self, work: Any, *keepalive: torch.Tensor) -> None:
        if work is not None:
            self.works.append(work)
            self.keepalive.extend(keepalive)

    def then(self, finish: Callable[[], object]) -> None:
        """Run ``finish`` once the works are done (at `wait`): post-processing of a result."""
        self.finishers.append(finish)

    def wait(self) -> None:
        """Wait for the works, then run the finishers (`then`) in the order they were given."""
        for work in self.works:
            work.wait()
        self.works.clear()
        self.keepalive.clear()
        for finish in self.finishers:
            finish()
        self.finishers.clear()


SYNC = Launch(False)
