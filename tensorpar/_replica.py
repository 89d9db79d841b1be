"""Replica checks: do the ranks hold the same model?

`check_and_broadcast_replicas` (the data-parallel reducer) compares the parameters' names,
dtypes and shapes and then broadcasts rank 0's values; `check_same_weights` (`parallelize`)
compares exact checksums of the values and raises where they differ.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from tensorpar import _comm
from tensorpar._group import Group, GroupLike, resolve_group
from tensorpar._meta import ranks_by_value
from tensorpar.errors import CollectiveArgumentError, ReducerError

__all__ = ["check_and_broadcast_replicas", "check_same_weights"]


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


def _dense_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (named once each), skipping already sharded modules.

    A module with a ``full_state`` method (a tensor-parallel layer) holds one shard per
    rank, which legitimately differs; its tensors are left out, as are meta tensors.
    """
    sharded = [f"{n}." for n, m in module.named_modules() if n and hasattr(m, "full_state")]
    seen: set[int] = set()
    out: list[tuple[str, torch.Tensor]] = []
    for prefix, sub in module.named_modules():
        if any(f"{prefix}.".startswith(s) for s in sharded):
            continue
        for name, t in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
            if id(t) not in seen and not t.is_meta:
                seen.add(id(t))
                out.append((f"{prefix}.{name}" if prefix else name, t))
    return out


def _fingerprint(name: str, t: torch.Tensor) -> list[int]:
    """Three int64s: the name, dtype and shape (crc32), and two checksums of the bytes.

    The checksums are exact (integer sums of the tensor's bytes taken as 32-bit words), so
    any difference in any bit shows; the second weights each word by its position, so a
    permutation shows too.
    """
    layout = zlib.crc32(f"{name} {t.dtype} {list(t.shape)}".encode())
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = (data.view(torch.int32) if t.element_size() % 4 == 0 else data).to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device) % 65521 + 1
    return [layout, int(words.sum()), int((words * weights).sum())]


def check_same_weights(fn: str, module: nn.Module, group: GroupLike) -> None:
    """Raise on every rank of ``group`` unless every rank holds the same dense weights.

    Compares exact checksums of every parameter and buffer (two int64 all-gathers: the
    count, then three int64s per tensor), so it costs one pass over the weights.

    Raises:
        CollectiveArgumentError: the ranks differ; names the first differing parameter or
            buffer and which ranks hold which version.
    """
    g = resolve_group(group, fn)
    if g.is_single:
        return
    tensors = _dense_tensors(module)
    device = g.comm_device(next((t.device for _, t in tensors), None))
    counts = _all_gather_ints(torch.tensor([len(tensors)], dtype=torch.int64), g, device)
    if counts.count(counts[0]) != g.size:
        raise CollectiveArgumentError(
            f"{fn}: the ranks hold different models: {ranks_by_value(counts, _tensors)}; "
            f"build the same dense model on every rank")
    mine = torch.tensor([v for name, t in tensors for v in _fingerprint(name, t)],
                        dtype=torch.int64)
    every = torch.tensor(_all_gather_ints(mine, g, device)).view(g.size, -1, 3)
    for k, (name, _) in enumerate(tensors):
        rows = every[:, k]
        if bool((rows == rows[0]).all()):
            continue
        if bool((rows[:, 0] != rows[0, 0]).any()):
            what = "name, dtype or shape"
            labels = [int(v) for v in rows[:, 0]]
        else:
            what = "values"
            labels = [hash(tuple(r.tolist())) for r in rows[:, 1:]]
        order = list(dict.fromkeys(labels))
        versions = [f"version {order.index(v) + 1}" for v in labels]
        raise CollectiveArgumentError(
            f"{fn}: the ranks hold different dense weights: {name!r} (tensor #{k}) differs in "
            f"{what}: {ranks_by_value(versions)}. Seed "
            f"every rank alike (torch.manual_seed) or load the same checkpoint before {fn}")


def _tensors(count: object) -> str:
    return f"{count} parameters and buffers"


def _all_gather_ints(mine: torch.Tensor, g: Group, device: torch.device) -> list[int]:
    out = torch.empty(g.size * mine.numel(), dtype=torch.int64, device=device)
    _comm.all_gather_into(out, mine.to(device), g, purpose="meta")
    values: list[int] = out.cpu().tolist()
    return values
