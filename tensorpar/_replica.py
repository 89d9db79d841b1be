"""Construction-time replica check, then broadcast from rank 0, for the data-parallel reducer."""

from __future__ import annotations

import torch
from torch import nn

from tensorpar import _comm
from tensorpar._group import Group
from tensorpar.errors import ReducerError

__all__ = ["check_and_broadcast_replicas"]


def _signature(module: nn.Module) -> list[str]:
    return [f"{name} {str(p.dtype).removeprefix('torch.')}{list(p.shape)}"
            for name, p in module.named_parameters()]


def check_and_broadcast_replicas(module: nn.Module, group: Group) -> None:
    """Check every rank holds the same parameters, then broadcast them (and buffers) from rank 0.

    Raises the same error on every rank, naming the first difference and the ranks.
    """
    if group.is_single:
        return
    mine = "\n".join(_signature(module)).encode()
    device = group.comm_device(next((p.device for p in module.parameters()), None))
    length = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    lengths = torch.empty(group.size, dtype=torch.int64, device=device)
    _comm.all_gather_into(lengths, length, group, purpose="meta")
    width = int(lengths.max())
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[: len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
    every = torch.empty(group.size * width, dtype=torch.uint8, device=device)
    _comm.all_gather_into(every, padded, group, purpose="meta")
    rows = every.view(group.size, width).cpu()
    signatures = [bytes(rows[r, : int(lengths[r])].tolist()).decode().split("\n")
                  for r in range(group.size)]
    reference = signatures[0]
    for rank, sig in enumerate(signatures[1:], start=1):
        for k in range(max(len(reference), len(sig))):
            a = reference[k] if k < len(reference) else "(nothing)"
            b = sig[k] if k < len(sig) else "(nothing)"
            if a != b:
                raise ReducerError(
                    f"BucketedAllReduce: the model differs across ranks: parameter #{k} is "
                    f"'{a}' on rank 0 but '{b}' on rank {rank} (rank 0 has {len(reference)} "
                    f"parameters, rank {rank} has {len(sig)})")
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            _comm.broadcast(tensor.data, 0, group)
