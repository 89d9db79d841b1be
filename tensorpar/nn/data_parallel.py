"""DataParallel: a drop-in for DistributedDataParallel backed by BucketedAllReduce."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from tensorpar._group import GroupLike
from tensorpar.reducer import BucketedAllReduce

__all__ = ["DataParallel"]


class DataParallel(nn.Module):
    """Wrap ``module`` so its gradients are averaged across ``group`` during backward.

    DDP's calling convention: ``forward`` passes through to ``module``, ``.module`` is the
    wrapped model, and ``no_sync()`` accumulates gradients locally. Keyword arguments go to
    `BucketedAllReduce` (``bucket_cap_mb``, ``find_unused_parameters``,
    ``broadcast_buffers``, ...).

    Example:
        >>> import torch
        >>> from tensorpar.nn import DataParallel
        >>> model = DataParallel(torch.nn.Linear(3, 2))
        >>> model(torch.ones(1, 3)).shape
        torch.Size([1, 2])
    """

    def __init__(self, module: nn.Module, *, group: GroupLike = None, **reducer_options: Any):
        super().__init__()
        self.module = module
        self.reducer = BucketedAllReduce(module, group=group, **reducer_options)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module (gradients are averaged during its backward)."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside it reduces the sum."""
        with self.reducer.no_sync():
            yield
