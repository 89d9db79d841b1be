"""Running PyTorch DDP communication hooks on tensorpar's buckets.

A DDP hook takes ``(state, bucket)`` and returns a ``torch.futures.Future`` whose value is the
bucket's reduced gradients. The hooks torch ships (``default_hooks.allreduce_hook``,
``fp16_compress_hook``, ``bf16_compress_hook``, PowerSGD) use a handful of ``GradBucket``
methods; `HookBucket` offers them over a tensorpar bucket, so the hooks run unchanged.

The reducer runs one hook at a time: it launches a bucket's hook only once the previous
bucket's future has completed. Hooks issue collectives from their futures' callbacks, on the
backend's threads (PowerSGD issues its P and Q all-reduces there, and even waits for one
inside a callback). With several hooks in flight, those callbacks and the next bucket's
launch could issue collectives in a different order on different ranks (gloo pairs them by
order: a wrong pairing, or an abort on mismatched sizes), and callbacks blocked in a wait can
hold every gloo worker thread, a deadlock. Both were seen with PowerSGD and five buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorpar.ddp._buckets import Bucket

__all__ = ["CommHook", "HookBucket"]


class HookBucket:
    """The ``torch.distributed.GradBucket`` interface over one tensorpar bucket.

    ``buffer()`` is the flat gradient buffer (``parameters()[i].grad`` are views of it);
    ``set_buffer`` makes the hook's later ``buffer()`` calls return another tensor (e.g. a
    compressed copy), as in DDP. The future's value is copied back into the gradients.
    """

    def __init__(self, bucket: Bucket, params: Sequence[torch.Tensor], last: bool) -> None:
        self._bucket = bucket
        self._buffer = bucket.buffer
        self._params = list(params)
        self._last = last

    def index(self) -> int:
        """The bucket's position in launch order."""
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat gradient buffer (or what `set_buffer` put in its place)."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace what `buffer` returns from now on (the gradients keep their storage)."""
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """Every parameter's gradient, as views of the flat buffer."""
        return [self._bucket.view_of(slot, p.shape) for slot, p in enumerate(self._params)]

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in buffer order."""
        return list(self._params)

    def is_last(self) -> bool:
        """Whether this is the last bucket launched in the backward pass."""
        return self._last

    is_the_last_bucket_to_allreduce = is_last


@dataclass(frozen=True)
class CommHook:
    """A registered hook and its state, as ``register_comm_hook(state, hook)`` received them."""

    state: Any
    hook: Callable[[Any, Any], torch.futures.Future[torch.Tensor]]

    def launch(self, bucket: Bucket, params: Sequence[torch.Tensor], last: bool
               ) -> torch.futures.Future[torch.Tensor]:
        """Run the hook on ``bucket``; the future's value is the reduced buffer."""
        future = self.hook(self.state, HookBucket(bucket, params, last))
        if not callable(getattr(future, "wait", None)):
            raise TypeError(f"register_comm_hook: the hook {getattr(self.hook, '__name__', '')} "
                            f"returned a {type(future).__name__}, expected a "
                            f"torch.futures.Future of the reduced bucket")
        return future
