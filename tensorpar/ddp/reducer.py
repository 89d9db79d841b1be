"""BucketedAllReduce: data-parallel gradient averaging in flat buckets, overlapped with backward."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from tensorpar._torch import current_graph_task_id, gradient_is_captured, queue_engine_callback
from tensorpar.collectives._buffers import broadcast_coalesced
from tensorpar.collectives._hierarchical import Algorithm, hierarchical_topology
from tensorpar.collectives.functional import all_reduce
from tensorpar.comm._faults import wait_translated
from tensorpar.comm._group import GroupLike, resolve_group
from tensorpar.comm._group_pool import GroupPool
from tensorpar.ddp._buckets import Bucket, MiB, default_bucket_cap_mb, plan_buckets
from tensorpar.ddp._checks import describe_change
from tensorpar.ddp._comm_hook import CommHook
from tensorpar.ddp._partial_sums import partial_sums_of, product_group
from tensorpar.ddp._sync import SyncPoint
from tensorpar.errors import CollectiveMismatchError, ReducerError
from tensorpar.hierarchical import shutdown_hierarchical
from tensorpar.hierarchical.topology import Topology
from tensorpar.validation import check, validation_enabled
from tensorpar.validation._replica import check_and_broadcast_replicas
from tensorpar.validation.calls import agree_on_call, agreed

__all__ = ["BucketedAllReduce"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class BucketedAllReduce(SyncPoint):
    """Average gradients across a data-parallel group, bucket by bucket, during backward.

    Gradients live as views in flat per-(dtype, device) buckets. A bucket is all-reduced in
    place, asynchronously, as soon as every gradient in it is ready, in the same bucket order
    on every rank, while the rest of the backward pass runs. One synchronisation point at the
    end of the backward pass (queued on the autograd engine) resolves every bucket, so
    ``.grad`` holds the average when ``backward()`` returns.

    After the first iteration the buckets are rebuilt in the order the gradients became
    ready (rank 0's order), keeping the gradient values.

    Used alone (without `tensorpar.nn.DistributedDataParallel`), the reducer sees the
    model's forward through a forward pre-hook on ``module``, and follows DDP's rules
    there: a forward under ``torch.no_grad()`` does nothing at all (no collective, not
    counted by validation mode), so evaluating on one rank is safe; a training forward
    broadcasts the buffers from rank 0 in one collective, when DDP would (if
    ``broadcast_buffers`` and the previous training forward was synchronised, i.e. not
    under `no_sync`: once per step under accumulation). A training forward on one rank
    alone would still broadcast; the wrapper has ``.module`` for that. A model with a
    reducer refuses ``copy.deepcopy`` (the copy would lack the hooks and not average); the
    wrapper's copies are wrapped models of their own.

    Nothing is exchanged besides the buckets (no per-iteration host synchronisation)
    unless ``find_unused_parameters`` is on or validation mode is: then which rank used
    which parameter is all-gathered at the end of the backward pass.

    Args:
        module: the model; every rank must hold the same parameters (checked here).
        group: the data-parallel group (``None``: the default group). For a model that sums
            gradients over groups of its own (converted by ``parallelize_domain``), the
            replica group beside its domain: each bucket is then all-reduced over both
            (their product, e.g. the whole 2-D mesh) and divided by the replicas alone.
        bucket_cap_mb: bucket size in MiB: a bucket closes once it holds at least this much
            (so it exceeds the cap by at most its last parameter). ``None`` (default): a
            quarter of all the gradients, between 1 and 25 MiB, so that even a small model's
            gradients stream in several buckets behind the backward pass instead of waiting
            for one large bucket to fill (DDP's default is always 25 MiB).
        first_bucket_mb: the same for the first bucket launched, which is smaller so that
            communication starts early (``min`` with ``bucket_cap_mb``).
        find_unused_parameters: allow parameters that get no gradient on some or all ranks
            in an iteration. As in DDP, such a parameter contributes what its ``.grad``
            holds (zeros without one; the earlier steps' sum when gradients accumulate
            without ``zero_grad``), and one no rank used keeps its ``.grad`` as it was
            (``None`` after ``zero_grad()``). Off: such a parameter raises `ReducerError`
            naming it, on the ranks that skipped it (on every rank in validation mode).
        broadcast_buffers: broadcast the module's buffers from rank 0 at training forwards
            (DDP's ``forward_sync_buffers``; see above).
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
        init_sync: check that the ranks hold the same parameters and give the same options
            (a construction refused on one rank is refused on every rank), and broadcast
            rank 0's parameters and buffers (default); ``False``: none of it, no
            collective at construction (the ranks must already agree).
        gradient_as_bucket_view: ``.grad`` is a view of its bucket (default: no copy, no
            second copy of the gradients in memory); ``False``: ``.grad`` stays a tensor of
            its own, copied into the bucket at the synchronised backward and back after
            the all-reduce (DDP's default; twice the gradient memory, two more copies).

    Raises:
        ReducerError: the ranks' parameters differ (names the first difference and ranks);
            a parameter another reducer already averages (a module wrapped twice); an
            embedding with ``sparse=True``.
        CollectiveArgumentError: the ranks' options differ, or another rank's construction
            was refused (with ``init_sync``).

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
                 topology: Topology | None = None, overlap_groups: int = 1,
                 init_sync: bool = True, gradient_as_bucket_view: bool = True) -> None:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.group = resolve_group(group, "BucketedAllReduce")
        device = named[0][1].device if named else None

        def check() -> tuple[None, Sequence[object]]:
            _refuse_model(module, named)
            self._configure_buckets([p for _, p in named], bucket_cap_mb, first_bucket_mb,
                                    reduce_dtype, compress_dtype)
            return None, (find_unused_parameters, bucket_cap_mb, first_bucket_mb,
                          broadcast_buffers, average, gradient_predivide_factor, reduce_dtype,
                          compress_dtype, rebuild_buckets, algorithm, overlap_groups,
                          init_sync, gradient_as_bucket_view)

        agreed("BucketedAllReduce", [self.group] if init_sync else [], _OPTIONS, device, check)
        self.module = module
        self.replicas = self.group.size
        """The number of replicas averaged over (``group``'s size)."""
        self._tiles = 1  # the product of a domain model's groups: its gradients' partial sums
        sums = partial_sums_of(module)
        if sums is not None:  # e.g. a domain-parallel model: its sums ride on the buckets
            if algorithm != "flat":
                raise ValueError(f"BucketedAllReduce: algorithm={algorithm!r} with a model "
                                 f"that sums gradients over groups of its own (a "
                                 f"domain-parallel model): only 'flat' is supported")
            self.group = product_group((self.group, *sums.sum_groups()), "BucketedAllReduce")
            self._tiles = self.group.size // self.replicas
            sums.hand_over()
        if algorithm != "flat":  # checked here, once: the same checks as every call's
            hierarchical_topology("BucketedAllReduce", algorithm, topology,
                                  torch.empty(0), "sum", self.group)
        self._algorithm, self._topology = algorithm, topology
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self._as_views = gradient_as_bucket_view
        self._configure_division(average, gradient_predivide_factor)
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._registered = self._snapshot()
        if init_sync:
            check_and_broadcast_replicas(module, self.group)
        self._init_state(rebuild_buckets)
        self._pool = GroupPool(self.group, overlap_groups if algorithm == "flat" else 1,
                               "BucketedAllReduce")  # on every rank, in the same order
        if self.group.is_single:
            return
        self._build(list(reversed(range(len(self._params)))))
        self._attach(module)

    def _configure_buckets(self, params: list[nn.Parameter], bucket_cap_mb: float | None,
                           first_bucket_mb: float, reduce_dtype: torch.dtype | None,
                           compress_dtype: torch.dtype | None) -> None:
        if bucket_cap_mb is None:
            bucket_cap_mb = default_bucket_cap_mb(params)
        if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError(f"BucketedAllReduce: bucket_cap_mb={bucket_cap_mb} and "
                             f"first_bucket_mb={first_bucket_mb} must be positive")
        self._cap = int(bucket_cap_mb * MiB)
        self._first_cap = int(min(first_bucket_mb, bucket_cap_mb) * MiB)
        self._comm_dtype_of: dict[torch.dtype, torch.dtype] = {}
        if reduce_dtype is not None:
            self._comm_dtype_of.update({d: reduce_dtype for d in _LOW_PRECISION})
        if compress_dtype is not None:
            self._comm_dtype_of.update({torch.float32: compress_dtype,
                                        torch.float64: compress_dtype})

    def _configure_division(self, average: bool, predivide: float | None) -> None:
        size = self.replicas
        factor = float(size if predivide is None else predivide)
        if not factor > 0:
            raise ValueError(f"BucketedAllReduce: gradient_predivide_factor={factor} must be > 0")
        self._pre = factor if average else 1.0
        self._post = size / factor if average else 1.0
        self._divisor: float | None = None  # this iteration's divisor, when Join sets one

    def _init_state(self, rebuild_buckets: bool) -> None:
        self.buckets: list[Bucket] = []
        """The buckets, in launch order."""
        self.bytes_reduced = 0
        """Bytes handed to all-reduce so far (in the communication dtype)."""
        self.sync_wait_seconds = 0.0
        """Time spent waiting at the end-of-backward synchronisation point so far."""
        self.iterations = 0
        """Synchronised backward passes so far."""
        self._sync_enabled = True  # no_sync() clears it
        self._sync_armed = True  # whether a backward synchronises (a wrapper's forward: `_arm`)
        self._awaiting_sync = False  # a synchronising forward's backward has not run yet
        self._disarm_after_sync = False  # a forward under no_sync came after that one
        self._forward_sync = True  # sync buffers at the next training forward (DDP's rule)
        self._joining = False  # in a Join context: the ranks' counts legitimately differ
        self._rebuild_pending = rebuild_buckets
        self._ready_order: list[int] = []
        self._ready = [False] * len(self._params)
        self._used_since_sync = [False] * len(self._params)
        self._saved: dict[int, torch.Tensor | None] = {}  # unused parameters' earlier grads
        self._task: int | None = None
        self._forwards = 0  # training forward passes, compared across ranks in validation mode
        # the counts at the last mismatch every rank raised together: compared from there on
        self._forward_base = self._iteration_base = 0
        self._unsynced = 0  # backward passes under no_sync since the last synchronised one
        self._unsynced_task: int | None = None
        self._late: list[str] = []
        self._hook: CommHook | None = None
        self._hooks: list[Any] = []

    def _attach(self, module: nn.Module) -> None:
        """Hook the parameters (and the module's forward, for buffers) to this reducer."""
        # The module owns the reducer (a cycle the garbage collector can see); the hooks on
        # the parameters hold it weakly, so dropping the model frees everything.
        module.__dict__.setdefault("_tensorpar_reducers", []).append(self)
        me = weakref.ref(self)
        for p in self._params:
            _REDUCED[p] = me
        for i, p in enumerate(self._params):
            self._hooks.append(p.register_post_accumulate_grad_hook(_grad_hook(me, i)))
            if self._tiles > 1:
                self._hooks.append(p.register_hook(_whole_part_hook(me, i, p)))
        self._forward_hook = module.register_forward_pre_hook(_forward_hook(me))
        self._hooks.append(self._forward_hook)

    def _owned_by_caller(self) -> None:
        """Let the module no longer keep this reducer alive: a wrapper holds it instead.

        Once the wrapper is dropped the reducer goes, its hooks do nothing, and the module
        may be wrapped again (as a module whose DDP wrapper was dropped).
        """
        owners = self.module.__dict__.get("_tensorpar_reducers", [])
        if self in owners:
            owners.remove(self)

    def _leave_forward_to_caller(self) -> None:
        """Drop the forward hook: a wrapper calls `_begin_forward` from its own forward."""
        if self.group.is_single:
            return
        self._forward_hook.remove()
        self._hooks.remove(self._forward_hook)

    def _arm(self, sync: bool) -> None:
        """A wrapper's training forward: whether the backwards after it synchronise.

        After a forward outside ``no_sync`` backwards synchronise; after one under
        ``no_sync`` they accumulate locally, except that such a forward does not take the
        synchronisation from an earlier forward whose backward has not run yet (that
        backward synchronises, as in DDP; the ones after it do not). Where DDP
        synchronises only the first of several backwards after a synchronising forward
        (two forwards then two backwards, ``retain_graph=True``), each one does here: the
        replicas stay equal (DDP's differ).
        """
        if sync:
            self._sync_armed, self._awaiting_sync, self._disarm_after_sync = True, True, False
        elif self._awaiting_sync:
            self._disarm_after_sync = True
        else:
            self._sync_armed = False

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
        a time, for the reason in `tensorpar.ddp._comm_hook`.

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
        if self._tiles > 1:  # (a hook averages over one group: here the tiles add up)
            raise ReducerError(f"BucketedAllReduce.register_comm_hook({name}): not with a "
                               f"domain-parallel model, whose buckets are summed over its "
                               f"tiles and averaged over the replicas only; use "
                               f"compress_dtype or reduce_dtype instead")
        self._hook = CommHook(state, hook)
        self._pre = self._post = 1.0

    def remove(self) -> None:
        """Remove the reducer's hooks and its extra process groups (gradients stay put).

        Call it on every rank at the same point: the groups of ``overlap_groups`` go too, and
        with a hierarchical algorithm the thread that issues the topology's collectives is
        stopped and joined (a later call on the topology starts it again).
        """
        if self._topology is not None and self._algorithm != "flat":
            shutdown_hierarchical(self._topology)
        self._pool.close()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        owners = self.module.__dict__.get("_tensorpar_reducers", [])
        if self in owners:
            owners.remove(self)
        for p in self._params:
            if _REDUCED.get(p) is not None and _REDUCED[p]() is self:
                del _REDUCED[p]

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
                if p.grad is not None and self._as_views:
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

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        """The module's forward pre-hook (the reducer used alone, without a wrapper).

        Eager under ``torch.compile`` (as the wrapper's bookkeeping): it reads the
        reducer's counters and may broadcast the buffers.
        """
        if not torch.is_grad_enabled():  # evaluation: never communicates (see the class doc)
            return
        self._begin_forward()
        if self._will_sync_buffers():
            self._sync_buffers(0)
        self._forward_sync = self._sync_enabled

    def _begin_forward(self) -> None:
        """Bookkeeping at a training forward (grad enabled); issues no collective."""
        if self._snapshot() != self._registered:
            raise ReducerError(describe_change(self.module, self._names, self._params))
        if self._task is not None and current_graph_task_id() == -1:
            # the last backward pass never reached its end on this rank (it raised, or a
            # check in it did): drain what it launched and start this iteration clean
            self._abandon()
        self._forwards += 1

    def _will_sync_buffers(self) -> bool:
        """DDP's rule: after a synchronised training forward (or none yet), if any buffers."""
        return (self._forward_sync and self.broadcast_buffers and not self.group.is_single
                and next(self.module.buffers(), None) is not None)

    def sync_buffers(self) -> None:
        """Broadcast the module's buffers from rank 0 now; call it on every rank of the group.

        A training forward does this itself (``broadcast_buffers``), and then updates each
        rank's BatchNorm statistics from its own batch. Before an evaluation that every rank
        runs (each on its shard, metrics summed after), call this so that each evaluates
        with rank 0's buffers, as DDP's first ``no_grad`` forward after a step gives them.
        Nothing to do (no collective) on one rank or without buffers.
        """
        if not self.group.is_single and next(self.module.buffers(), None) is not None:
            self._sync_buffers(0, "BucketedAllReduce.sync_buffers")

    def _sync_buffers(self, src: int, operation: str = "BucketedAllReduce forward") -> None:
        """Broadcast every buffer of the module from group rank ``src``: one collective."""
        self._check(operation)
        broadcast_coalesced(list(self.module.buffers()), src, self.group)

    def _check(self, operation: str, *, bucket: int = -1, **fields: Any) -> bool:
        """Compare this step of the reducer across the ranks (validation mode); whether it did.

        Nothing is compared outside validation mode, or while this rank joins (its calls
        must not pair with a peer's other call).

        A mismatch raises on every rank at once; the ranks then count forward passes and
        iterations afresh from this point, so they agree again on the next iteration.
        """
        if self._joining or not validation_enabled():
            return False
        counters = (
            ("no_sync backward passes since the last synchronised one", self._unsynced,
             "no_sync() on some ranks only"),
            ("reducer forward passes", self._forwards - self._forward_base,
             "a rank skipped a batch, or ran an extra forward"),
            ("reducer iteration", self.iterations - self._iteration_base,
             "a rank skipped or repeated a backward pass"),
            ("reducer bucket", bucket, ""))
        try:
            return check(operation, self.group, backward=operation != "BucketedAllReduce forward",
                         counters=counters, **fields)
        except CollectiveMismatchError:
            self._forward_base, self._iteration_base = self._forwards, self.iterations
            self._unsynced = 0
            raise

    def _before_accumulate(self, i: int, p: torch.Tensor) -> None:
        """A domain model's first gradient since the last sync: keep ``.grad``'s sum once.

        The new gradients are partial and the bucket's one all-reduce sums them over the
        tiles too; what ``.grad`` holds here is whole (an earlier synchronised backward's
        average, a gradient set before), so it is divided by the tiles first and comes
        back once from that sum, as the replicas' average gives it back in DDP.
        """
        grad = p.grad
        if self._used_since_sync[i] or grad is None or gradient_is_captured(p):
            return
        if grad is self._views[i]:
            grad.div_(self._tiles)
        else:  # (a tensor of the caller's: not written)
            p.grad = grad / self._tiles

    def _on_grad_ready(self, i: int, p: torch.Tensor) -> None:
        view, grad = self._views[i], p.grad
        syncing = self._sync_enabled and self._sync_armed
        # Divide for the average while the gradient is copied in (one pass over memory);
        # under no_sync the sum accumulates and is divided by the synchronised backward.
        pre = self._factors()[0] if syncing else 1.0
        assert grad is not None  # the hook runs after a gradient was accumulated
        if grad.layout != torch.strided:
            raise ReducerError(f"BucketedAllReduce: {self._names[i]!r} got a {grad.layout} "
                               f"gradient, which the buckets do not hold (a sparse embedding "
                               f"lookup): compute a dense gradient")
        if not self._as_views:  # .grad keeps its own storage: the bucket gets a copy
            if syncing:
                torch.div(grad, pre, out=view) if pre != 1.0 else view.copy_(grad)
        elif grad is not view:
            torch.div(grad, pre, out=view) if pre != 1.0 else view.copy_(grad)
            p.grad = view  # a fresh gradient (e.g. after zero_grad(set_to_none=True))
        elif pre != 1.0:
            view.div_(pre)
        self._used_since_sync[i] = True
        if not syncing:
            task = current_graph_task_id()
            if task != self._unsynced_task:
                self._unsynced_task = task
                self._unsynced += 1
            return
        task = current_graph_task_id()
        if self._task is None:
            self._task = task
            queue_engine_callback(self._finish_backward)
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
        self._check("BucketedAllReduce bucket", dtype=target.dtype, shape=target.shape,
                    bucket=bucket.index)
        if self._hook is not None:
            previous = self.buckets[bucket.index - 1].future if bucket.index else None
            if previous is not None:  # one hook in flight at a time (see tensorpar.ddp._comm_hook)
                wait_translated(previous, f"BucketedAllReduce, backward pass (iteration "
                                f"{self.iterations}): bucket {bucket.index - 1}'s comm hook",
                                self.group)
            params = [self._params[i] for i in bucket.param_indices]
            bucket.future = self._hook.launch(bucket, params,
                                              bucket.index == len(self.buckets) - 1)
        else:
            bucket.handle = all_reduce(target, inplace=True, async_op=True,
                                       group=self._pool[bucket.index],
                                       algorithm=self._algorithm, topology=self._topology)
        bucket.launched = True
        self.bytes_reduced += target.numel() * target.element_size()

    def __deepcopy__(self, memo: dict[int, object]) -> BucketedAllReduce:
        """Refused: a copy of the model would not carry the gradient hooks (not averaged)."""
        raise TypeError("BucketedAllReduce: a model with a reducer cannot be deep-copied (the "
                        "copy's gradients would not be averaged, silently); copy it before "
                        "building the reducer or after its remove(), or wrap it in "
                        "tensorpar.nn.DistributedDataParallel, whose copies are wrapped "
                        "models of their own")

    def __repr__(self) -> str:
        return (f"BucketedAllReduce({len(self._params)} parameters in {len(self.buckets)} "
                f"buckets, group size {self.group.size})")


_OPTIONS = ("find_unused_parameters", "bucket_cap_mb", "first_bucket_mb", "broadcast_buffers",
            "average", "gradient_predivide_factor", "reduce_dtype", "compress_dtype",
            "rebuild_buckets", "algorithm", "overlap_groups", "init_sync",
            "gradient_as_bucket_view")
"""The options every rank's reducer must agree on (compared at construction)."""

_REDUCED: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""The reducer each parameter's gradient goes to, by the parameter's identity (a second
reducer would take the gradient too)."""


def settle_buffers(module: nn.Module) -> None:
    """Before a checkpoint of ``module``: its replicas' buffers made rank 0's where due.

    After a training forward each replica's BatchNorm statistics are its own batch's until
    the next training forward broadcasts rank 0's; DCP writes a replicated key from a rank
    of its choosing (another for each key). Every reducer averaging ``module``'s
    parameters whose next training forward would broadcast (DDP's rule) broadcasts now, so
    the checkpoint holds what the run goes on with; nothing changes in the run's course.
    Collective over those reducers' groups (every rank of them calls it).
    """
    seen: list[BucketedAllReduce] = []
    for p in module.parameters():
        ref = _REDUCED.get(p)
        reducer = ref() if ref is not None else None
        if reducer is not None and not any(reducer is r for r in seen):
            seen.append(reducer)
    for reducer in seen:
        if reducer._will_sync_buffers():
            reducer.sync_buffers()


def refused_here(group: GroupLike, device: torch.device | None, init_sync: bool) -> None:
    """Tell the other ranks that this rank's reducer (or wrapper) was refused.

    Their construction raises too, instead of waiting in its collectives for this rank.
    With ``init_sync=False`` the construction communicates nothing (nor does this).
    """
    if not init_sync:
        return
    try:
        g = resolve_group(group, "BucketedAllReduce")
    except Exception:  # the group itself was refused: this rank's error says why
        return
    agree_on_call("BucketedAllReduce", [g], _OPTIONS, None, device)


def _refuse_model(module: nn.Module, named: list[tuple[str, nn.Parameter]]) -> None:
    """Refuse parameters another reducer takes, and layers with sparse gradients."""
    taken = [n for n, p in named if (r := _REDUCED.get(p)) is not None and r() is not None]
    if taken:
        raise ReducerError(
            f"BucketedAllReduce: {len(taken)} parameter(s) of {type(module).__name__} "
            f"({', '.join(taken[:3])}{', ...' if len(taken) > 3 else ''}) already have their "
            f"gradients averaged by another BucketedAllReduce or DistributedDataParallel "
            f"(the module, or a module holding it, was wrapped before): wrap it once, or "
            f"call .remove() on the first reducer (the wrapper's .reducer)")
    sparse = [n for n, m in module.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ReducerError(
            f"BucketedAllReduce: {', '.join(repr(n) for n in sparse)} compute(s) sparse "
            f"gradients (sparse=True), which the buckets do not hold: use sparse=False")


def _grad_hook(reducer: weakref.ref[BucketedAllReduce], i: int) -> Any:
    def hook(p: torch.Tensor) -> None:
        owner = reducer()
        if owner is not None:
            owner._on_grad_ready(i, p)
    return hook


def _whole_part_hook(reducer: weakref.ref[BucketedAllReduce], i: int, p: torch.Tensor) -> Any:
    def hook(grad: torch.Tensor) -> None:  # before the gradient is accumulated into p.grad
        owner = reducer()
        if owner is not None:
            owner._before_accumulate(i, p)
    return hook


def _forward_hook(reducer: weakref.ref[BucketedAllReduce]) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        owner = reducer()
        if owner is not None:
            owner._before_forward(module, args)
    return hook
