"""DistributedDataParallel: PyTorch DDP's interface, backed by BucketedAllReduce."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch import nn

from tensorpar._algorithm import Algorithm
from tensorpar._group import GroupLike
from tensorpar.errors import ReducerError
from tensorpar.reducer import BucketedAllReduce
from tensorpar.topology import Topology

__all__ = ["DataParallel", "DistributedDataParallel"]


class DistributedDataParallel(nn.Module):
    """A drop-in for ``torch.nn.parallel.DistributedDataParallel`` (same constructor).

    Gradients are averaged across the group during backward by `BucketedAllReduce`: buckets
    of gradient views, all-reduced in place as they fill, one synchronisation at the end of
    the backward pass. A DDP script changes its import and nothing else.

    DDP's arguments and what they do here:

    - ``module``, ``process_group`` (or ``device_mesh``, a 1-D mesh), ``bucket_cap_mb``,
      ``find_unused_parameters``, ``broadcast_buffers`` (default True) and ``no_sync()``
      work as in DDP; so does `register_comm_hook` with torch's own hooks. Left out,
      ``bucket_cap_mb`` is a quarter of the gradients between 1 and 25 MiB, where DDP's is
      always 25 (see `BucketedAllReduce`).
    - ``device_ids`` / ``output_device``: at most one device (the module's); inputs are not
      moved (move them before the call, as with a single-device DDP module). ``dim``: only 0.
    - ``gradient_as_bucket_view``: always on (gradients are always bucket views).
      ``static_graph``, ``init_sync``, ``check_reduction``, ``skip_all_reduce_unused_params``,
      ``bucket_cap_mb_list``, ``batched_grad_copy``, ``forward_sync_buffers``: accepted,
      without effect (the replicas are always checked and synchronised at construction, and
      the buckets are rebuilt in execution order after the first step).
    - ``mixed_precision``, ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``:
      refused with a `TypeError`; use ``reduce_dtype`` / ``compress_dtype`` or a comm hook.

    The keyword-only arguments after ``device_mesh`` are tensorpar's own (see
    `BucketedAllReduce`).

    Example:
        >>> import torch
        >>> from tensorpar.nn import DistributedDataParallel
        >>> model = DistributedDataParallel(torch.nn.Linear(3, 2))   # one rank
        >>> model(torch.ones(1, 3)).shape
        torch.Size([1, 2])
    """

    def __init__(self, module: nn.Module, device_ids: list[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool | None = True, init_sync: bool = True,
                 process_group: GroupLike = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
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
        super().__init__()
        name = type(self).__name__
        for arg, value in (("mixed_precision", mixed_precision),
                           ("delay_all_reduce_named_params", delay_all_reduce_named_params),
                           ("param_to_hook_all_reduce", param_to_hook_all_reduce)):
            if value is not None:
                raise TypeError(f"{name}: {arg} is not supported (got {value!r}); use "
                                f"reduce_dtype/compress_dtype or register_comm_hook")
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(f"{name}: device_ids={device_ids}: one device per process only "
                             f"(as in DDP's recommended use); got {len(device_ids)}")
        if dim != 0:
            raise ValueError(f"{name}: dim={dim}: inputs are not scattered here, so only "
                             f"dim=0 (DDP's default) is accepted")
        if process_group is not None and device_mesh is not None:
            raise ValueError(f"{name}: pass process_group or device_mesh, not both")
        self.module = module
        try:
            self.reducer = BucketedAllReduce(
                module, group=device_mesh if device_mesh is not None else process_group,
                bucket_cap_mb=bucket_cap_mb,
                first_bucket_mb=first_bucket_mb, find_unused_parameters=find_unused_parameters,
                broadcast_buffers=True if broadcast_buffers is None else broadcast_buffers,
                average=average, gradient_predivide_factor=gradient_predivide_factor,
                reduce_dtype=reduce_dtype, compress_dtype=compress_dtype,
                rebuild_buckets=rebuild_buckets, algorithm=algorithm, topology=topology,
                overlap_groups=overlap_groups)
        except (ValueError, TypeError, ReducerError) as exc:  # name the class the user called
            raise type(exc)(str(exc).replace("BucketedAllReduce", name, 1)) from exc

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module (gradients are averaged during its backward)."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside it reduces the sum."""
        with self.reducer.no_sync():
            yield

    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """Reduce the buckets with a DDP communication hook (see `BucketedAllReduce`).

        Args:
            state: passed to every call of ``hook``.
            hook: e.g. ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks
                .fp16_compress_hook``.
        """
        self.reducer.register_comm_hook(state, hook)

    def join(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not supported: uneven inputs across ranks (DDP's ``Join``) are refused.

        Raises:
            NotImplementedError: always. Give every rank the same number of batches (e.g.
                ``DistributedSampler(drop_last=True)``), or stop all ranks together when
                one runs out (an all-reduced flag).
        """
        raise NotImplementedError(
            f"{type(self).__name__}.join: uneven inputs across ranks are not supported; give "
            f"every rank the same number of batches (DistributedSampler(drop_last=True)), or "
            f"all-reduce a 'still has data' flag each step and stop together")


class DataParallel(DistributedDataParallel):
    """Deprecated name of `DistributedDataParallel` (it is not ``torch.nn.DataParallel``)."""

    def __init__(self, module: nn.Module, *, group: GroupLike = None, **options: Any) -> None:
        warnings.warn("tensorpar.nn.DataParallel is deprecated: use "
                      "tensorpar.nn.DistributedDataParallel (the same, with DDP's signature)",
                      DeprecationWarning, stacklevel=2)
        super().__init__(module, process_group=group, **options)
