"""The handle of an asynchronous hierarchical all-reduce, which the engine's thread fills."""

from __future__ import annotations

import threading
from typing import Any

from tensorpar.errors import TensorparError

__all__ = ["HierarchicalWork"]


class HierarchicalWork:
    """Handle of an asynchronous `hierarchical_all_reduce`: the result is ready after `wait`.

    Waiting on CPU (gloo) blocks until the data is in place; on CUDA (NCCL) it makes the
    caller's current stream wait for it, as ``torch.distributed`` works do. A handle dropped
    without waiting still completes, in order with the topology's later calls.
    """

    def __init__(self) -> None:
        self._issued = threading.Event()
        self._final: list[Any] = []
        self._error: BaseException | None = None
        self._event: Any = None  # the caller's stream position, on accelerators
        self._tasks_left = 0

    def wait(self) -> bool:
        """Wait for the all-reduce (idempotent).

        Returns:
            ``True``.

        Raises:
            TensorparError: a collective of the pipeline failed (`CollectiveTimeoutError`
                or `PeerLostError` where its collective's was); the topology's subgroups
                are then out of step and the topology must not be used again.
        """
        self._issued.wait()
        if self._error is not None:  # (a timeout or a lost peer keeps its class)
            cls = type(self._error) if isinstance(self._error, TensorparError) \
                else TensorparError
            raise cls(f"hierarchical_all_reduce: a collective of the pipeline failed: "
                      f"{self._error}") from self._error
        for work in self._final:
            work.wait()
        return True

    def is_completed(self) -> bool:
        """True once every collective of the call has completed (never blocks)."""
        return self._issued.is_set() and all(w.is_completed() for w in self._final)
