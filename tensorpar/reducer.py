"""BucketedAllReduce: data-parallel gradient averaging in flat buckets, overlapped with backward."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tensorpar import _comm
from tensorpar._algorithm import Algorithm, hierarchical_topology
from tensorpar._buckets import Bucket, MiB, default_bucket_cap_mb, plan_buckets
from tensorpar._comm_hook import CommHook
from tensorpar._group import GroupLike, resolve_group
from tensorpar._group_pool import GroupPool
from tensorpar._replica import check_and_broadcast_replicas
from tensorpar._switch import VALIDATE
from tensorpar.collaborative import CollaborativeTensor, sync_collectives
from tensorpar.errors import CollectiveMismatchError, CollectiveTimeoutError, ReducerError
from tensorpar.functional import all_reduce
from tensorpar.topology import Topology
from tensorpar.validation import check

__all__ = ["BucketedAllReduce"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class BucketedAllReduce:
    """Average gradients across a data-parallel group, bucket by bucket, during backward.

    Gradients live as views in flat per-(dtype, device) buckets. A bucket is all-reduced in
    place, asynchronously, as soon as every gradient in it is ready, in the same bucket order
    on every rank, while the rest of the backward pass runs. One synchronisation point at the
    end of the backward pass (queued on the autograd engine) resolves every bucket, so
    ``.grad`` holds the average when ``backward()`` returns.

    After the first iteration the buckets are rebuilt in the order the gradients became
    ready (rank 0's order), keeping the gradient values.

    Args:
        module: the model; every rank must hold the same parameters (checked here).
        group: the data-parallel group (``None``: the default group).
        bucket_cap_mb: bucket size in MiB: a bucket closes once it holds at least this much
            (so it exceeds the cap by at most its last parameter). ``None`` (default): a
            quarter of all the gradients, between 1 and 25 MiB, so that even a small model's
            gradients stream in several buckets behind the backward pass instead of waiting
            for one large bucket to fill (DDP's default is always 25 MiB).
        first_bucket_mb: the same for the first bucket launched, which is smaller so that
            communication starts early (``min`` with ``bucket_cap_mb``).
        find_unused_parameters: allow parameters that get no gradient on some or all ranks
            in an iteration. They contribute zeros; a parameter no rank used keeps
            ``.grad = None``. Off: such a parameter raises `ReducerError` naming it.
        broadcast_buffers: broadcast the module's buffers from rank 0 before every forward.
        average: divide by the group size (default) or return the sum.
        gradient_predivide_factor: divide by this before the all-reduce and by
            ``group_size / factor`` after. Default: the group size (all division before the
            all-reduce, which keeps fp16 sums from overflowing). Division happens once.
        reduce_dtype: all-reduce float16/bfloat16 gradients in this dtype (e.g. float32).
        compress_dtype: send float32/float64 gradients in this dtype (e.g. bfloat16).
        rebuild_buckets: rebuild the buckets in execution order after the first iteration.
        algorithm: how each bucket is all-reduced: ``"flat"``, ``"hierarchical"`` (within
            each machine, then across machines; see `tensorpar.all_reduce`) or ``"auto"``.
        topology: the `Topology` of ``group``, for the non-flat algorithms.
        overlap_groups: process groups (over the ranks of ``group``, created once) that the
            buckets take in turn, so that more buckets are on the wire at once (gloo runs at
            most two collectives of one group at a time). 1 (default): ``group`` alone. The
            flat algorithm only; a comm hook reduces on its own group.

    Raises:
        ReducerError: the ranks' parameters differ (names the first difference and ranks).

    Example:
        >>> import torch, tensorpar
        >>> model = torch.nn.Linear(3, 2)
        >>> reducer = tensorpar.BucketedAllReduce(model)   # one rank: nothing to reduce
        >>> model(torch.ones(4, 3)).sum().backward()
        >>> model.weight.grad.shape
        torch.Size([2, 3])
    """

    def __init__(self, module: nn.Module, *, group: GroupLike = None,
                 bucket_cap_mb: float | None = None, first_bucket_mb: float = 1.0,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 average: bool = True, gradient_predivide_factor: float | None = None,
                 reduce_dtype: torch.dtype | None = None,
                 compress_dtype: torch.dtype | None = None,
                 rebuild_buckets: bool = True, algorithm: Algorithm = "flat",
                 topology: Topology | None = None, overlap_groups: int = 1) -> None:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if bucket_cap_mb is None:
            bucket_cap_mb = default_bucket_cap_mb(p for _, p in named)
        if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError(f"BucketedAllReduce: bucket_cap_mb={bucket_cap_mb} and "
                             f"first_bucket_mb={first_bucket_mb} must be positive")
        self.module = module
        self.group = resolve_group(group, "BucketedAllReduce")
        if algorithm != "flat":  # checked here, once: the same checks as every call's
            hierarchical_topology("BucketedAllReduce", algorithm, topology,
                                  torch.empty(0), "sum", self.group)
        self._algorithm, self._topology = algorithm, topology
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        size = self.group.size
        factor = float(size if gradient_predivide_factor is None else gradient_predivide_factor)
        if not factor > 0:
            raise ValueError(f"BucketedAllReduce: gradient_predivide_factor={factor} must be > 0")
        self._pre = factor if average else 1.0
        self._post = size / factor if average else 1.0
        self._cap = int(bucket_cap_mb * MiB)
        self._first_cap = int(min(first_bucket_mb, bucket_cap_mb) * MiB)
        self._comm_dtype_of: dict[torch.dtype, torch.dtype] = {}
        if reduce_dtype is not None:
            self._comm_dtype_of.update({d: reduce_dtype for d in _LOW_PRECISION})
        if compress_dtype is not None:
            self._comm_dtype_of.update({torch.float32: compress_dtype,
                                        torch.float64: compress_dtype})

        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._registered = self._snapshot()
        check_and_broadcast_replicas(module, self.group)

        self.buckets: list[Bucket] = []
        """The buckets, in launch order."""
        self.bytes_reduced = 0
        """Bytes handed to all-reduce so far (in the communication dtype)."""
        self.sync_wait_seconds = 0.0
        """Time spent waiting at the end-of-backward synchronisation point so far."""
        self.iterations = 0
        """Synchronised backward passes so far."""

        self._sync_enabled = True
        self._rebuild_pending = rebuild_buckets
        self._ready_order: list[int] = []
        self._ready = [False] * len(self._params)
        self._used_since_sync = [False] * len(self._params)
        self._task: int | None = None
        self._forwards = 0  # forward passes, compared across ranks in validation mode
        # the counts at the last mismatch every rank raised together: compared from there on
        self._forward_base = self._iteration_base = 0
        self._unsynced = 0  # backward passes under no_sync since the last synchronised one
        self._unsynced_task: int | None = None
        self._late: list[str] = []
        self._hook: CommHook | None = None
        self._hooks: list[Any] = []
        self._pool = GroupPool(self.group, overlap_groups if algorithm == "flat" else 1,
                               "BucketedAllReduce")  # on every rank, in the same order
        if self.group.is_single:
            return
        self._build(list(reversed(range(len(self._params)))))
        # The module owns the reducer (a cycle the garbage collector can see); the hooks on
        # the parameters hold it weakly, so dropping the model frees everything.
        module.__dict__.setdefault("_tensorpar_reducers", []).append(self)
        me = weakref.ref(self)
        for i, p in enumerate(self._params):
            self._hooks.append(p.register_post_accumulate_grad_hook(_grad_hook(me, i)))
        self._hooks.append(module.register_forward_pre_hook(_forward_hook(me)))

    # -- public ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next synchronised backward reduces the sum."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """Reduce every bucket with a PyTorch DDP communication hook instead of an all-reduce.

        ``hook(state, bucket)`` gets a ``GradBucket``-like bucket (``buffer()``, ``index()``,
        ``is_last()``, ``gradients()``, ``parameters()``, ``set_buffer()``) and returns a
        ``torch.futures.Future`` of the reduced buffer, exactly as for DDP, so torch's own hooks
        (``default_hooks.allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
        PowerSGD) run unchanged. As in DDP the hook does the averaging: the reducer no longer
        divides. Register it once, before the first backward pass. Hooks run one bucket at
        a time, for the reason in `tensorpar._comm_hook`.

        Args:
            state: passed to every call of ``hook`` (e.g. the process group, or a
                ``PowerSGDState``).
            hook: the communication hook.

        Raises:
            ReducerError: a hook is already registered, a backward pass has already run, or
                the reducer changes the communication dtype (``reduce_dtype`` /
                ``compress_dtype``: compress in the hook instead).
        """
        name = getattr(hook, "__name__", repr(hook))
        if self._hook is not None:
            raise ReducerError(f"BucketedAllReduce.register_comm_hook({name}): a hook "
                               f"({self._hook.hook}) is already registered; register once")
        if self.iterations or self._task is not None:
            raise ReducerError(f"BucketedAllReduce.register_comm_hook({name}): register the "
                               f"hook before the first backward pass (after {self.iterations})")
        if self._comm_dtype_of:
            raise ReducerError(f"BucketedAllReduce.register_comm_hook({name}): cannot be "
                               f"combined with reduce_dtype/compress_dtype; the hook decides "
                               f"what travels (e.g. fp16_compress_hook)")
        self._hook = CommHook(state, hook)
        self._pre = self._post = 1.0

    def remove(self) -> None:
        """Remove the reducer's hooks and its extra process groups (gradients stay put).

        Call it on every rank at the same point: the groups of ``overlap_groups`` go too.
        """
        self._pool.close()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        owners = self.module.__dict__.get("_tensorpar_reducers", [])
        if self in owners:
            owners.remove(self)

    # -- buckets --------------------------------------------------------------------------
    def _build(self, order: list[int]) -> None:
        """(Re)build the buckets, taking parameters in ``order``, keeping gradient values."""
        self.buckets = plan_buckets(self._params, self._names, order, self._cap,
                                    self._first_cap, self._comm_dtype_of)
        self._bucket_of: list[Bucket] = [self.buckets[0]] * len(self._params)
        self._views: list[torch.Tensor] = [self._params[0]] * len(self._params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                p = self._params[i]
                self._bucket_of[i] = bucket
                self._views[i] = bucket.view_of(slot, p.shape)
                if p.grad is not None:
                    self._views[i].copy_(p.grad)
                    p.grad = self._views[i]
        self._reset_iteration()

    def _reset_iteration(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.param_indices)
            bucket.launched = False
            bucket.handle = None
            bucket.future = None
        self._next = 0  # the next bucket to launch
        self._ready = [False] * len(self._params)
        self._ready_order = []
        self._late = []
        self._task = None

    # -- hooks ----------------------------------------------------------------------------
    def _snapshot(self) -> tuple[tuple[int, bool], ...]:
        return tuple((id(p), p.requires_grad) for p in self.module.parameters())

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if self._snapshot() != self._registered:
            raise ReducerError(self._describe_change())
        if self._task is not None and torch._C._current_graph_task_id() == -1:
            # the last backward pass never reached its end on this rank (it raised, or a
            # check in it did): drain what it launched and start this iteration clean
            self._abandon()
        self._forwards += 1
        buffers = list(module.buffers()) if self.broadcast_buffers else []
        if VALIDATE[0] and buffers:  # the broadcasts must not pair with a peer's other call
            self._check("BucketedAllReduce forward")
        for buf in buffers:
            _comm.broadcast(buf, 0, self.group)

    def _check(self, operation: str, *, bucket: int = -1, **fields: Any) -> None:
        """Compare this step of the reducer across the ranks (validation mode).

        A mismatch raises on every rank at once; the ranks then count forward passes and
        iterations afresh from this point, so they agree again on the next iteration.
        """
        counters = (
            ("no_sync backward passes since the last synchronised one", self._unsynced,
             "no_sync() on some ranks only"),
            ("reducer forward passes", self._forwards - self._forward_base,
             "a rank skipped a batch, or ran an extra forward"),
            ("reducer iteration", self.iterations - self._iteration_base,
             "a rank skipped or repeated a backward pass"),
            ("reducer bucket", bucket, ""))
        try:
            check(operation, self.group, backward=operation != "BucketedAllReduce forward",
                  counters=counters, **fields)
        except CollectiveMismatchError:
            self._forward_base, self._iteration_base = self._forwards, self.iterations
            self._unsynced = 0
            raise

    def _describe_change(self) -> str:
        known = {id(p): n for n, p in zip(self._names, self._params, strict=True)}
        for name, p in self.module.named_parameters():
            if id(p) not in known and p.requires_grad:
                return (f"BucketedAllReduce: parameter {name!r} was added (or made trainable) "
                        f"after the reducer was built; its gradient would never be averaged. "
                        f"Build the reducer after the model is final.")
        for i, p in enumerate(self._params):
            if not p.requires_grad:
                return (f"BucketedAllReduce: parameter {self._names[i]!r} had requires_grad="
                        f"True when the reducer was built and is now False. Build the reducer "
                        f"after freezing parameters.")
        return ("BucketedAllReduce: the module's parameters changed after the reducer was "
                "built (a parameter was removed or replaced)")

    def _on_grad_ready(self, i: int, p: torch.Tensor) -> None:
        view, grad = self._views[i], p.grad
        # Divide for the average while the gradient is copied in (one pass over memory);
        # under no_sync the sum accumulates and is divided by the synchronised backward.
        pre = self._pre if self._sync_enabled else 1.0
        if grad is not view:
            assert grad is not None  # the hook runs after a gradient was accumulated
            torch.div(grad, pre, out=view) if pre != 1.0 else view.copy_(grad)
            p.grad = view  # a fresh gradient (e.g. after zero_grad(set_to_none=True))
        elif pre != 1.0:
            view.div_(pre)
        self._used_since_sync[i] = True
        if not self._sync_enabled:
            task = torch._C._current_graph_task_id()
            if task != self._unsynced_task:
                self._unsynced_task = task
                self._unsynced += 1
            return
        task = torch._C._current_graph_task_id()
        if self._task is None:
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        elif task != self._task:
            self._abandon()
            raise ReducerError(
                "BucketedAllReduce: a new backward pass started before the previous one "
                "finished its gradient reduction: the previous one raised or was interrupted, "
                "or a nested backward ran inside it (torch.utils.checkpoint with "
                "use_reentrant=True; use use_reentrant=False). This iteration's gradients "
                "are not averaged; zero them and run it again.")
        bucket = self._bucket_of[i]
        if self._ready[i]:  # a second gradient in one backward pass: reported at the sync
            self._late.append(self._names[i])
            return
        self._ready[i] = True
        self._ready_order.append(i)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch ready buckets strictly in index order, so every rank issues the same order."""
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        if bucket.comm_dtype != bucket.dtype:
            bucket.comm = bucket.buffer.to(bucket.comm_dtype)
            target = bucket.comm
        else:
            target = bucket.buffer
        if VALIDATE[0]:
            self._check("BucketedAllReduce bucket", dtype=target.dtype, shape=target.shape,
                        bucket=bucket.index)
        if self._hook is not None:
            previous = self.buckets[bucket.index - 1].future if bucket.index else None
            if previous is not None:  # one hook in flight at a time (see tensorpar._comm_hook)
                previous.wait()
            params = [self._params[i] for i in bucket.param_indices]
            bucket.future = self._hook.launch(bucket, params,
                                              bucket.index == len(self.buckets) - 1)
        else:
            bucket.handle = all_reduce(target, inplace=True, async_op=True,
                                       group=self._pool[bucket.index],
                                       algorithm=self._algorithm, topology=self._topology)
        bucket.launched = True
        self.bytes_reduced += target.numel() * target.element_size()

    # -- end of backward ------------------------------------------------------------------
    def _finish_backward(self) -> None:
        """Runs once at the end of every synchronised backward pass, on every rank."""
        try:
            missing = [i for i, ready in enumerate(self._ready) if not ready]
            for i in missing:  # zeros, or what earlier micro-batches accumulated
                if not self._used_since_sync[i]:
                    self._views[i].zero_()
                elif self._pre != 1.0:
                    self._views[i].div_(self._pre)
                self._params[i].grad = self._views[i]  # another rank may have used it
                self._bucket_of[i].pending -= 1
            self._launch_ready()
            if self._hook is not None:  # before any collective of this thread: a hook's
                self._wait_for_hooks()   # callbacks may issue collectives of their own
            if VALIDATE[0]:
                self._check("BucketedAllReduce end of backward")
            used = torch.tensor(self._used_since_sync, dtype=torch.uint8,
                                device=self.group.comm_device(self.buckets[0].buffer.device))
            usage = torch.empty(self.group.size * used.numel(), dtype=torch.uint8,
                                device=used.device)
            _comm.all_gather_into(usage, used, self.group, purpose="meta")
            start = time.perf_counter()
            if self._hook is None:
                sync_collectives(_handles(self.buckets))
            self.sync_wait_seconds += time.perf_counter() - start
            for bucket in self.buckets:
                if bucket.comm is not None:
                    bucket.buffer.copy_(bucket.comm)
                    bucket.comm = None
                if self._post != 1.0:
                    bucket.buffer.div_(self._post)
            self._check_after_sync(usage.view(self.group.size, -1).cpu())
            if self._rebuild_pending:
                self._rebuild_pending = False
                self._rebuild_in_ready_order()
        except CollectiveTimeoutError as exc:  # name the reducer's step, keep the error's kind
            raise type(exc)(f"BucketedAllReduce, end of backward pass (iteration "
                            f"{self.iterations}): {exc}") from exc
        except CollectiveMismatchError:  # every rank raised here: this pass does not count
            self.iterations -= 1
            raise
        finally:
            self._used_since_sync = [False] * len(self._params)
            self._unsynced = 0
            self.iterations += 1
            self._reset_iteration()

    def _wait_for_hooks(self) -> None:
        start = time.perf_counter()
        for bucket in self.buckets:
            assert bucket.future is not None  # every bucket was launched
            reduced = bucket.future.wait()
            if reduced.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(reduced.view_as(bucket.buffer))
            bucket.future = None
        self.sync_wait_seconds += time.perf_counter() - start

    def _check_after_sync(self, usage: torch.Tensor) -> None:
        unused = [i for i in range(len(self._params)) if not bool(usage[:, i].all())]
        if unused and not self.find_unused_parameters:
            lines = [f"{self._names[i]!r} (no gradient on ranks "
                     f"{[r for r in range(self.group.size) if not usage[r, i]]})"
                     for i in unused]
            raise ReducerError(
                "BucketedAllReduce: parameters got no gradient in this backward pass: "
                + ", ".join(lines) + ". Pass find_unused_parameters=True if parts of the "
                "model are legitimately skipped, or detach the unused parameters.")
        for i in unused:
            if not bool(usage[:, i].any()):
                self._params[i].grad = None  # no rank used it
        moved = [self._names[i] for i, p in enumerate(self._params)
                 if p.grad is not None and p.grad is not self._views[i]]
        if moved:
            raise ReducerError(
                f"BucketedAllReduce: the .grad of {moved} was replaced during backward, after "
                f"its bucket took it; the averaged gradient is in the bucket, not in .grad")
        if self._late:
            raise ReducerError(
                f"BucketedAllReduce: {sorted(set(self._late))} received a gradient twice in one "
                f"backward pass, so their averaged gradient is wrong; a parameter's "
                f"AccumulateGrad must run once per backward")

    def _rebuild_in_ready_order(self) -> None:
        """Rebuild the buckets in rank 0's ready order (every rank then agrees)."""
        order = self._ready_order + [i for i in range(len(self._params))
                                     if i not in set(self._ready_order)]
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

    def __repr__(self) -> str:
        return (f"BucketedAllReduce({len(self._params)} parameters in {len(self.buckets)} "
                f"buckets, group size {self.group.size})")


def _handles(buckets: Iterable[Bucket]) -> list[CollaborativeTensor]:
    """The handles of launched buckets (every bucket at the end of a backward pass)."""
    handles = [b.handle for b in buckets]
    if any(h is None for h in handles):
        raise ReducerError("BucketedAllReduce: a bucket was never launched in this backward "
                           "pass; this is a bug in the reducer, please report it")
    return [h for h in handles if h is not None]


def _grad_hook(reducer: weakref.ref[BucketedAllReduce], i: int) -> Any:
    def hook(p: torch.Tensor) -> None:
        owner = reducer()
        if owner is not None:
            owner._on_grad_ready(i, p)
    return hook


def _forward_hook(reducer: weakref.ref[BucketedAllReduce]) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        owner = reducer()
        if owner is not None:
            owner._before_forward(module, args)
    return hook
