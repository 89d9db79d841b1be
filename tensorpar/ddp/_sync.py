"""The end of a synchronised backward pass: what `BucketedAllReduce` does at its sync point.

`SyncPoint` holds the reducer's steps after the last gradient: parameters the pass did not
reach, the optional usage exchange, the wait for every bucket, the final division, the
checks, the one-time rebuild in execution order; and their mirror for a rank that ran out
of inputs under ``Join`` (`SyncPoint._shadow_backward`), which must issue the same
collectives in the same order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable

import torch

from tensorpar.collaborative import CollaborativeTensor, sync_collectives
from tensorpar.comm import _comm
from tensorpar.comm._faults import wait_translated
from tensorpar.comm._group import Group
from tensorpar.ddp._buckets import Bucket
from tensorpar.ddp._checks import (
    exchange_usage,
    grads_in_place_error,
    local_unused_error,
    unused_error,
)
from tensorpar.ddp._comm_hook import CommHook
from tensorpar.errors import CollectiveMismatchError, CollectiveTimeoutError, ReducerError

__all__ = ["SyncPoint"]


class SyncPoint:
    """The end-of-backward half of `BucketedAllReduce` (which supplies the state below)."""

    group: Group
    buckets: list[Bucket]
    find_unused_parameters: bool
    iterations: int
    sync_wait_seconds: float
    _params: list[torch.Tensor]
    _names: list[str]
    _views: list[torch.Tensor]
    _bucket_of: list[Bucket]
    _ready: list[bool]
    _ready_order: list[int]
    _used_since_sync: list[bool]
    _saved: dict[int, torch.Tensor | None]
    _late: list[str]
    _hook: CommHook | None
    _pre: float
    _post: float
    _divisor: float | None
    _unsynced: int
    _sync_armed: bool
    _awaiting_sync: bool
    _disarm_after_sync: bool
    _joining: bool
    _rebuild_pending: bool
    _as_views: bool
    _tiles: int
    _launch: Callable[[Bucket], None]
    _launch_ready: Callable[[], None]
    _check: Callable[..., bool]
    _build: Callable[[list[int]], None]
    _reset_iteration: Callable[[], None]

    def _factors(self) -> tuple[float, float]:
        """(divide before, divide after) the all-reduce, for this iteration."""
        return (self._pre, self._post) if self._divisor is None else (self._divisor, 1.0)

    def _finish_backward(self) -> None:
        """Runs once at the end of every synchronised backward pass, on every rank."""
        pre, post = self._factors()
        try:
            missing = [i for i, ready in enumerate(self._ready) if not ready]
            for i in missing:
                self._fill_missing(i, pre)
            self._launch_ready()
            if self._hook is not None:  # before any collective of this thread: a hook's
                self._wait_for_hooks()   # callbacks may issue collectives of their own
            checking = self._check("BucketedAllReduce end of backward")  # (validation mode)
            usage = None  # exchanged only where needed: no extra collective or host sync
            if self.find_unused_parameters or checking:
                usage = exchange_usage(self._used_since_sync, self.group,
                                       self.buckets[0].buffer.device)
            start = time.perf_counter()
            if self._hook is None:
                sync_collectives(_handles(self.buckets))
            self.sync_wait_seconds += time.perf_counter() - start
            for bucket in self.buckets:
                if bucket.comm is not None:
                    bucket.buffer.copy_(bucket.comm)
                    bucket.comm = None
                if post != 1.0:
                    bucket.buffer.div_(post)
            error = self._settle(missing, usage)
            if self._rebuild_pending:  # before raising: a peer may have nothing to raise
                self._rebuild_pending = False
                self._rebuild_in_ready_order()
            if error is not None:
                raise error
        except CollectiveTimeoutError as exc:  # name the reducer's step, keep the error's kind
            raise type(exc)(f"BucketedAllReduce, end of backward pass (iteration "
                            f"{self.iterations}): {exc}") from exc
        except CollectiveMismatchError:  # every rank raised here: this pass does not count
            self.iterations -= 1
            raise
        finally:
            self._used_since_sync = [False] * len(self._params)
            self._saved.clear()
            self._divisor = None
            self._unsynced = 0
            self.iterations += 1
            self._awaiting_sync = False
            if self._disarm_after_sync:  # a forward under no_sync came after this one's
                self._sync_armed = self._disarm_after_sync = False
            self._reset_iteration()

    def _fill_missing(self, i: int, pre: float) -> None:
        """A parameter this backward pass did not reach contributes what its .grad holds.

        That is zeros (no .grad), or what earlier steps accumulated (no ``zero_grad``, or
        micro-batches under no_sync), divided like a fresh gradient, as DDP does. Without a
        rank that used it, the earlier value is put back after the all-reduce. A domain
        model's gradient untouched since the last sync is whole: divided by the tiles too
        (the all-reduce sums over them).
        """
        p, view = self._params[i], self._views[i]
        grad = p.grad
        if self.find_unused_parameters and not self._used_since_sync[i] and self._as_views:
            self._saved[i] = None if grad is None else grad.detach().clone()
        if grad is not None and not self._used_since_sync[i]:
            pre *= self._tiles
        if grad is None:
            view.zero_()
        elif grad is not view:
            torch.div(grad, pre, out=view) if pre != 1.0 else view.copy_(grad)
        elif pre != 1.0:
            view.div_(pre)
        if self._as_views:
            p.grad = view  # another rank may have used it
        self._bucket_of[i].pending -= 1

    def _wait_for_hooks(self) -> None:
        start = time.perf_counter()
        for bucket in self.buckets:
            assert bucket.future is not None  # every bucket was launched
            reduced = wait_translated(bucket.future, "comm hook's collective", self.group)
            if reduced.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(reduced.view_as(bucket.buffer))
            bucket.future = None
        self.sync_wait_seconds += time.perf_counter() - start

    def _settle(self, missing: list[int], usage: torch.Tensor | None) -> ReducerError | None:
        """After the all-reduce: restore unused parameters; return the error to raise, if any."""
        unused: set[int] = set()  # no rank used them: their .grad stays as it was
        if usage is not None:
            if not self.find_unused_parameters:
                error = unused_error(self._names, usage)
                if error is not None:
                    return error
            unused = {i for i in missing if not bool(usage[:, i].any())}
            for i in unused:
                saved = self._saved.get(i)
                if not self._as_views:
                    continue  # .grad was never touched
                if saved is None:
                    self._params[i].grad = None
                else:
                    self._views[i].copy_(saved)
        else:
            skipped = [self._names[i] for i in missing if not self._used_since_sync[i]]
            if skipped:
                return local_unused_error(skipped, self.group.rank)
        if not self._as_views:  # the averages go back into each .grad
            for i, p in enumerate(self._params):
                if i in unused:
                    continue
                if p.grad is None:
                    p.grad = self._views[i].clone()
                else:
                    p.grad.copy_(self._views[i])
        return grads_in_place_error(self._names, self._params,
                                    self._views if self._as_views else None, self._late)

    def _rebuild_in_ready_order(self) -> None:
        """Rebuild the buckets in rank 0's ready order (every rank then agrees)."""
        seen = set(self._ready_order)
        order = self._ready_order + [i for i in range(len(self._params)) if i not in seen]
        device = self.group.comm_device(self.buckets[0].buffer.device)
        shared = torch.tensor(order, dtype=torch.int64, device=device)
        _comm.broadcast(shared, 0, self.group)
        self._build(shared.cpu().tolist())

    def _abandon(self) -> None:
        """Drain the collectives an unfinished iteration launched, then start clean."""
        with contextlib.suppress(Exception):
            if self._hook is None:
                sync_collectives(_handles(b for b in self.buckets if b.launched))
            for bucket in self.buckets:
                if bucket.future is not None:
                    bucket.future.wait()
        self._reset_iteration()

    def _shadow_backward(self) -> None:
        """Issue a synchronised backward pass's collectives with zeros (a rank out of inputs).

        The same collectives, in the same order, as `_finish_backward` on the ranks that
        still train under ``Join``: every bucket's all-reduce (or comm hook), the usage
        exchange, the one-time rebuild. This rank's own gradients are left alone.
        """
        handles = []
        for bucket in self.buckets:
            zeros = dataclasses.replace(bucket, buffer=torch.zeros_like(bucket.buffer),
                                        handle=None, future=None, comm=None)
            self._launch(zeros)
            if zeros.future is not None:  # one hook at a time, as in a backward pass
                wait_translated(zeros.future, "comm hook's collective", self.group)
            if zeros.handle is not None:
                handles.append(zeros.handle)
        if self.find_unused_parameters:
            exchange_usage([False] * len(self._params), self.group,
                           self.buckets[0].buffer.device)
        sync_collectives(handles)
        if self._rebuild_pending:
            self._rebuild_pending = False
            self._reset_iteration()
            self._rebuild_in_ready_order()


def _handles(buckets: Iterable[Bucket]) -> list[CollaborativeTensor]:
    """The handles of launched buckets (every bucket at the end of a backward pass)."""
    handles = [b.handle for b in buckets]
    if any(h is None for h in handles):
        raise ReducerError("BucketedAllReduce: a bucket was never launched in this backward "
                           "pass; this is a bug in the reducer, please report it")
    return [h for h in handles if h is not None]
