"""CollaborativeTensor: the result of an asynchronous collective, valid only once resolved."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NoReturn

import torch

from tensorpar._not_data import NotData
from tensorpar.comm._launch import Launch
from tensorpar.errors import UnresolvedCollectiveError

__all__ = ["CollaborativeTensor", "as_result", "sync_collectives"]


class CollaborativeTensor(NotData):
    """A handle to the result of a collective that may still be in flight.

    Returned by the collectives when called with ``async_op=True``. It is not a tensor:
    using it as data raises `UnresolvedCollectiveError`. Get the tensor with
    `resolve` (waits), with `sync_collectives` (one synchronisation point for
    many handles), or with `assume_resolved` (no wait, under a contract).

    Dropping a handle unresolved is safe: the collective still completes in order with the
    group's later collectives, and its buffers stay alive until it has.

    Example:
        >>> import torch, tensorpar
        >>> handle = tensorpar.all_reduce(torch.ones(2), async_op=True)
        >>> handle.resolve()
        tensor([1., 1.])
    """

    __slots__ = ("_launch", "_resolved", "_tensor")

    def __init__(self, tensor: torch.Tensor, launch: Launch) -> None:
        self._tensor = tensor
        self._launch = launch
        self._resolved = not launch.works

    def resolve(self) -> torch.Tensor:
        """Wait for the collective and return its result (idempotent)."""
        if not self._resolved:
            self._launch.wait()
            self._resolved = True
        return self._tensor

    def assume_resolved(self) -> torch.Tensor:
        """Return the result tensor **without waiting**.

        Contract: the returned tensor must not be read or written until the collective has
        been synchronised, by `resolve` or `sync_collectives` on this handle.
        This is how a reducer hands out bucket views early and synchronises once at the end.
        On CUDA/NCCL, kernels queued on the current stream after `resolve` see the
        result; on CPU/gloo, `resolve` blocks until the data is there.
        """
        return self._tensor

    def is_resolved(self) -> bool:
        """True once `resolve` or `sync_collectives` has synchronised this handle."""
        return self._resolved

    @property
    def shape(self) -> torch.Size:
        """The result's shape (metadata is available before resolution)."""
        return self._tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        """The result's dtype."""
        return self._tensor.dtype

    @property
    def device(self) -> torch.device:
        """The result's device."""
        return self._tensor.device

    def __repr__(self) -> str:
        state = "resolved" if self._resolved else "in flight"
        dtype = str(self._tensor.dtype).removeprefix("torch.")
        return f"CollaborativeTensor({dtype}{list(self._tensor.shape)}, {state})"

    def _not_data(self, op: str) -> NoReturn:
        hint = ("use the tensor that .resolve() returned" if self._resolved
                else "call .resolve() (or tensorpar.sync_collectives) first")
        raise UnresolvedCollectiveError(
            f"{op}: got a CollaborativeTensor ({'resolved' if self._resolved else 'in flight'}), "
            f"which is a handle, not a tensor: {hint}")


def as_result(out: torch.Tensor, launch: Launch, async_op: bool
              ) -> torch.Tensor | CollaborativeTensor:
    """The tensor, or with ``async_op`` a handle that must be resolved first."""
    return CollaborativeTensor(out, launch) if async_op else out


def sync_collectives(handles: Iterable[CollaborativeTensor]) -> list[torch.Tensor]:
    """Resolve many handles at one synchronisation point and return their tensors in order.

    Args:
        handles: handles returned by collectives called with ``async_op=True``.

    Returns:
        The resolved tensors, in the order of ``handles``.

    Raises:
        TypeError: an element is not a `CollaborativeTensor`.
    """
    handles = list(handles)
    for i, h in enumerate(handles):
        if not isinstance(h, CollaborativeTensor):
            raise TypeError(f"sync_collectives: handles[{i}] is a {type(h).__name__}, "
                            f"expected a CollaborativeTensor")
    return [h.resolve() for h in handles]
