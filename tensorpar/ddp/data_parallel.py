"""DistributedDataParallel: PyTorch DDP's interface, backed by BucketedAllReduce."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from tensorpar._torch import tree_map
from tensorpar.collectives._buffers import common_rank, sum_flags
from tensorpar.collectives._hierarchical import Algorithm
from tensorpar.comm._faults import wait_translated
from tensorpar.comm._group import GroupLike
from tensorpar.ddp._join import DDPJoinHook
from tensorpar.ddp.reducer import BucketedAllReduce, refused_here
from tensorpar.errors import ReducerError
from tensorpar.hierarchical.topology import Topology

__all__ = ["DistributedDataParallel"]

# DDP's arguments tensorpar does not implement: (name, the value that asks for it, why)
_REFUSED = (
    ("static_graph", True, "the reducer makes no use of a static graph; for parameters some "
     "steps skip pass find_unused_parameters=True, and checkpoint with use_reentrant=False"),
    ("check_reduction", True, "torch deprecates it and ignores it; here an unfinished "
     "reduction is always detected at the next forward"),
    ("skip_all_reduce_unused_params", True, "unused parameters always take part in their "
     "bucket's all-reduce here (zeros, or what their .grad holds)"),
    ("batched_grad_copy", True, "each gradient is copied into its bucket as it arrives, "
     "overlapped with the backward pass: there is nothing to batch"),
)


class DistributedDataParallel(nn.Module, Joinable):
    """A drop-in for ``torch.nn.parallel.DistributedDataParallel`` (same constructor).

    Gradients are averaged across the group during backward by `BucketedAllReduce`: buckets
    of gradient views, all-reduced in place as they fill, one synchronisation at the end of
    the backward pass. A DDP script changes its import and nothing else.

    As in DDP: ``.module(...)`` never communicates, nor does a forward under ``no_grad``
    (evaluation on one rank is safe). Buffers are broadcast from rank 0 in one collective
    at the start of a training forward, when DDP would: if ``forward_sync_buffers`` and the
    previous training forward was synchronised (so once per step under accumulation).
    DDP also broadcasts at the first ``no_grad`` forward after a synchronised step and then
    skips the next training forward's broadcast; here that broadcast waits for the next
    training forward, so a forward on one rank never pairs with a peer's call (the buffers
    arrive the same, unless the ``no_grad`` forward itself changes them, e.g. BatchNorm in
    train mode).

    DDP's arguments and what they do here:

    - ``module``, ``process_group`` (or ``device_mesh``, a 1-D mesh), ``bucket_cap_mb``,
      ``find_unused_parameters``, ``forward_sync_buffers``, ``broadcast_buffers``
      (deprecated by torch: ``False`` also leaves the buffers out of the initial sync),
      ``init_sync`` (``False``: nothing is checked or broadcast at construction),
      ``no_sync()``, ``require_backward_grad_sync`` (read at each training forward, as in
      DDP), ``join()`` and `register_comm_hook` with torch's own hooks work as in DDP.
      Left out, ``bucket_cap_mb`` is a quarter of the gradients between 1 and 25 MiB, where
      DDP's is always 25 (see `BucketedAllReduce`).
    - ``device_ids`` / ``output_device``: a GPU module on one device only, and that device;
      inputs are moved to it as DDP does. On a CPU or multi-device module both must be
      ``None`` (DDP's rule). ``dim``: only 0.
    - ``gradient_as_bucket_view``: honoured; the default here is ``True`` (gradients are
      views of the buckets: no copies, half the memory), where DDP's is ``False``.
    - Refused with a ``ValueError`` naming them: ``static_graph=True``,
      ``check_reduction=True``, ``skip_all_reduce_unused_params=True``,
      ``bucket_cap_mb_list``, ``batched_grad_copy=True``; and with a ``TypeError``:
      ``mixed_precision``, ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``
      (use ``reduce_dtype`` / ``compress_dtype`` or a comm hook).

    The keyword-only arguments after ``forward_sync_buffers`` are tensorpar's own (see
    `BucketedAllReduce`). ``copy.deepcopy`` and pickling give a wrapper of its own around a
    copy of the module (see `__deepcopy__` and `__reduce__`).

    Attributes:
        require_backward_grad_sync: as in DDP: ``False`` at a training forward makes its
            backward accumulate locally, without any collective (``no_sync()`` sets it).

    Raises:
        ValueError: an argument tensorpar does not honour (named in the message), or the
            model differs across ranks (`ReducerError`).
        TypeError: ``mixed_precision``, ``delay_all_reduce_named_params`` or
            ``param_to_hook_all_reduce`` was given.

    Example:
        >>> import torch
        >>> from tensorpar.nn import DistributedDataParallel
        >>> model = DistributedDataParallel(torch.nn.Linear(3, 2))   # one rank
        >>> model(torch.ones(1, 3)).shape
        torch.Size([1, 2])
    """

    def __init__(self, module: nn.Module, device_ids: list[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: GroupLike = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = True, static_graph: bool = False,
                 delay_all_reduce_named_params: Any = None, param_to_hook_all_reduce: Any = None,
                 mixed_precision: Any = None, device_mesh: Any = None,
                 skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: list[int] | None = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None, *, first_bucket_mb: float = 1.0,
                 average: bool = True, gradient_predivide_factor: float | None = None,
                 reduce_dtype: torch.dtype | None = None,
                 compress_dtype: torch.dtype | None = None, rebuild_buckets: bool = True,
                 algorithm: Algorithm = "flat", topology: Topology | None = None,
                 overlap_groups: int = 1) -> None:
        nn.Module.__init__(self)
        Joinable.__init__(self)
        name = type(self).__name__
        given = {"static_graph": static_graph,
                 "check_reduction": check_reduction, "batched_grad_copy": batched_grad_copy,
                 "skip_all_reduce_unused_params": skip_all_reduce_unused_params}
        try:  # refused on one rank: refused on every rank (`refused_here`)
            _refuse(name, given, bucket_cap_mb_list, dim, process_group, device_mesh,
                    {"mixed_precision": mixed_precision,
                     "delay_all_reduce_named_params": delay_all_reduce_named_params,
                     "param_to_hook_all_reduce": param_to_hook_all_reduce})
            self._input_device = _input_device(name, module, device_ids, output_device)
            forward_sync, init_buffers = _buffer_policy(broadcast_buffers, forward_sync_buffers)
        except Exception:
            refused_here(device_mesh if device_mesh is not None else process_group,
                         next((p.device for p in module.parameters() if p.requires_grad), None),
                         init_sync)
            raise
        self.module = module
        self.require_backward_grad_sync = True
        self._divide_by_live_ranks = False
        kept = None if init_buffers else [b.detach().clone() for b in module.buffers()]
        try:
            self.reducer = BucketedAllReduce(
                module, group=device_mesh if device_mesh is not None else process_group,
                bucket_cap_mb=bucket_cap_mb,
                first_bucket_mb=first_bucket_mb, find_unused_parameters=find_unused_parameters,
                broadcast_buffers=forward_sync, average=average,
                gradient_predivide_factor=gradient_predivide_factor,
                reduce_dtype=reduce_dtype, compress_dtype=compress_dtype,
                rebuild_buckets=rebuild_buckets, algorithm=algorithm, topology=topology,
                overlap_groups=overlap_groups, init_sync=init_sync,
                gradient_as_bucket_view=gradient_as_bucket_view)
        except (ValueError, TypeError, ReducerError) as exc:  # name the class the user called
            raise type(exc)(str(exc).replace("BucketedAllReduce", name, 1)) from exc
        if kept is not None:  # broadcast_buffers=False: the buffers stay this rank's own
            with torch.no_grad():
                for buffer, value in zip(module.buffers(), kept, strict=True):
                    buffer.copy_(value)
        self.reducer._leave_forward_to_caller()  # buffers are synchronised in forward()
        self.reducer._owned_by_caller()  # dropping the wrapper drops its reducer, as in DDP
        self._arguments = {  # what a copy is built with (`__deepcopy__`)
            "device_ids": device_ids, "output_device": output_device,
            "broadcast_buffers": broadcast_buffers, "process_group": process_group,
            "bucket_cap_mb": bucket_cap_mb, "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view, "device_mesh": device_mesh,
            "forward_sync_buffers": forward_sync_buffers, "first_bucket_mb": first_bucket_mb,
            "average": average, "gradient_predivide_factor": gradient_predivide_factor,
            "reduce_dtype": reduce_dtype, "compress_dtype": compress_dtype,
            "rebuild_buckets": rebuild_buckets, "algorithm": algorithm, "topology": topology,
            "overlap_groups": overlap_groups}

    def __deepcopy__(self, memo: dict[int, Any]) -> DistributedDataParallel:
        """A wrapper of its own around a deep copy of the module, as DDP's copies are.

        The copy averages its own gradients over the same group, with the same arguments,
        and is built without any collective (``init_sync=False``), so a copy made on one
        rank (an evaluation or EMA model) is safe; with ``overlap_groups`` > 1 its reducer
        creates process groups, so make such a copy on every rank at the same point. As in
        DDP, a communication hook is not copied (register it on the copy).
        """
        module = copy.deepcopy(self.module, memo)
        twin = _unpickled(type(self), module, self._arguments, self._flags())
        memo[id(self)] = twin
        return twin

    def _flags(self) -> tuple[bool, bool, bool, bool]:
        """What a copy carries besides the arguments (the state they may have changed).

        Whether backwards synchronise, whether the last training forward did (buffers are
        broadcast after one that did), ``forward_sync_buffers`` and the training mode.
        """
        return (self.require_backward_grad_sync, self.reducer._forward_sync,
                self.forward_sync_buffers, self.training)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as DDP is: the module and the arguments, on the default group only.

        Loading builds a wrapper around the loaded module without any collective (see
        `__deepcopy__`); process groups cannot be pickled, so a wrapper on another group
        (or a mesh, or a topology) refuses.
        """
        if any(self._arguments[k] is not None for k in ("process_group", "device_mesh",
                                                       "topology")):
            raise TypeError(f"{type(self).__name__}: pickling is supported only with the "
                            f"default process group (as DDP's), not with process_group=, "
                            f"device_mesh= or topology=")
        return (_unpickled, (type(self), self.module, self._arguments, self._flags()))

    @property
    def forward_sync_buffers(self) -> bool:
        """Whether buffers are broadcast at the start of training forwards (DDP's flag)."""
        return self.reducer.broadcast_buffers

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, value: bool) -> None:
        self.reducer.broadcast_buffers = value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module; gradients are averaged during its backward.

        A forward under ``torch.no_grad()`` only calls the module: no collective.
        """
        if self._input_device is not None:
            args, kwargs = tree_map(self._move, (args, kwargs))
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        sync = self._before_module()
        out = self.module(*args, **kwargs)
        self._after_module(sync)
        return out

    # (the reducer's bookkeeping runs eagerly under torch.compile: a graph that read its
    # counters would be compiled again at every step)
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _before_module(self) -> bool:
        """A training forward's start: arm the reducer, join, buffers; whether it syncs."""
        reducer = self.reducer
        sync = self.require_backward_grad_sync
        reducer._arm(sync)
        reducer._begin_forward()
        reducer._joining = joining = self._join_config.enable and not reducer.group.is_single
        work = Join.notify_join_context(self)
        if work is not None and self._divide_by_live_ranks:
            wait_translated(work, "Join's all-reduce", reducer.group)
            reducer._divisor = float(work.result()[0].item())  # ranks that have not joined
        if reducer._will_sync_buffers():
            src = common_rank(reducer.group, True, self.join_device) if joining else 0
            reducer._sync_buffers(src)
        if joining:  # tell the ranks that ran out whether this backward synchronises
            sum_flags(reducer.group, sync, self.join_device)
        return sync

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _after_module(self, sync: bool) -> None:
        self.reducer._forward_sync = sync and self.reducer._sync_enabled

    def sync_buffers(self) -> None:
        """Broadcast the module's buffers from rank 0 now; call it on every rank.

        Before an evaluation that every rank runs: `BucketedAllReduce.sync_buffers`.
        """
        self.reducer.sync_buffers()

    def _move(self, x: Any) -> Any:
        return x.to(self._input_device) if isinstance(x, torch.Tensor) else x

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next training forward outside it synchronises.

        As in DDP, the forward pass must run inside the context (the flag is read there).
        """
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """Reduce the buckets with a DDP communication hook (see `BucketedAllReduce`).

        Args:
            state: passed to every call of ``hook``.
            hook: e.g. ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks
                .fp16_compress_hook``.
        """
        self.reducer.register_comm_hook(state, hook)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """A context manager for uneven inputs across ranks, as DDP's ``join()``.

        Ranks that run out of batches shadow the others' collectives (zeros for their
        gradients) until every rank has joined; then the model of the last rank to join is
        broadcast to all. Collectives of your own inside the loop need
        ``throw_on_early_termination=True``, as in DDP. Validation mode does not compare
        the reducer's steps inside it (the ranks' counts legitimately differ).

        Args:
            divide_by_initial_world_size: divide by the group size (True) or by the number
                of ranks still training (False; needs the default averaging and no comm hook).
            enable: False turns the detection off (inputs known to be even).
            throw_on_early_termination: raise on every rank as soon as one runs out.

        Returns:
            A ``torch.distributed.algorithms.Join`` over this module.

        Raises:
            ValueError: ``divide_by_initial_world_size=False`` with a comm hook,
                ``average=False`` or a ``gradient_predivide_factor``.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook ``Join`` runs on a rank that ran out of inputs (see `join`)."""
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """The device of ``Join``'s own collectives."""
        hint = next((p.device for p in self.module.parameters()), None)
        return self.reducer.group.comm_device(hint)

    @property
    def join_process_group(self) -> Any:
        """The data-parallel process group."""
        return self.reducer.group.handle


def _unpickled(cls: type[DistributedDataParallel], module: nn.Module,
               arguments: dict[str, Any], flags: tuple[bool, bool, bool, bool]
               ) -> DistributedDataParallel:
    """A wrapper around ``module`` (a copy's), built without a collective (see `_flags`)."""
    wrapped = cls(module, **arguments, init_sync=False)
    (wrapped.require_backward_grad_sync, wrapped.reducer._forward_sync,
     wrapped.forward_sync_buffers, training) = flags
    return wrapped.train(training)


def _refuse(name: str, given: Mapping[str, object], bucket_cap_mb_list: object, dim: int,
            process_group: object, device_mesh: object, unsupported: dict[str, object]) -> None:
    for arg, value in unsupported.items():
        if value is not None:
            raise TypeError(f"{name}: {arg} is not supported (got {value!r}); use "
                            f"reduce_dtype/compress_dtype or register_comm_hook")
    for arg, refused, why in _REFUSED:
        if given[arg] == refused:
            raise ValueError(f"{name}: {arg}={refused} is not supported: {why}")
    if bucket_cap_mb_list is not None:
        raise ValueError(f"{name}: bucket_cap_mb_list={bucket_cap_mb_list!r} is not supported: "
                         f"pass bucket_cap_mb (and first_bucket_mb for the first bucket)")
    if dim != 0:
        raise ValueError(f"{name}: dim={dim}: inputs are not scattered here, so only "
                         f"dim=0 (DDP's default) is accepted")
    if process_group is not None and device_mesh is not None:
        raise ValueError(f"{name}: pass process_group or device_mesh, not both")


def _input_device(name: str, module: nn.Module, device_ids: list[int | torch.device] | None,
                  output_device: int | torch.device | None) -> torch.device | None:
    """The device inputs are moved to (DDP's ``device_ids[0]``), after DDP's checks."""
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"{name}: device_ids={device_ids}: one device per process only "
                         f"(as in DDP); got {len(device_ids)}")
    devices = {p.device for p in module.parameters()}
    if not device_ids or len(devices) != 1 or next(iter(devices)).type == "cpu":
        if device_ids or output_device is not None:
            raise ValueError(f"{name}: device_ids and output_device only work with a "
                             f"single-device GPU module (as in DDP); got device_ids "
                             f"{device_ids}, output_device {output_device} and module "
                             f"parameters on {sorted(map(str, devices))}")
        return None
    (device,) = devices
    for arg, value in (("device_ids[0]", device_ids[0]), ("output_device", output_device)):
        if value is not None and _device(device.type, value) != device:
            raise ValueError(f"{name}: {arg}={value} is not the module's device ({device}); "
                             f"move the module there first")
    return device


def _device(kind: str, value: int | torch.device) -> torch.device:
    return torch.device(kind, value) if isinstance(value, int) else torch.device(value)


def _buffer_policy(broadcast_buffers: bool | None, forward_sync_buffers: bool | None
                   ) -> tuple[bool, bool]:
    """(sync buffers in forward, sync buffers at construction), by torch DDP's rules."""
    if forward_sync_buffers is not None:  # broadcast_buffers is then ignored
        return forward_sync_buffers, True
    effective = True if broadcast_buffers is None else broadcast_buffers
    return effective, effective
