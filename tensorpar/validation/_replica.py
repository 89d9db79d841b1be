"""Replica checks: do the ranks hold the same model?

`check_and_broadcast_replicas` (the data-parallel reducer) compares the parameters' names,
dtypes and shapes and then broadcasts rank 0's values; `check_same_weights` (`parallelize`)
compares hashes of the values and raises where they differ.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from tensorpar.comm import _comm
from tensorpar.comm._group import Group, GroupLike, resolve_group
from tensorpar.errors import CollectiveArgumentError, ReducerError, ranks_by_value

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
    lengths = [row[0] for row in _comm.exchange_ints(group, [len(mine)], device)]
    width = max(lengths)
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[: len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
    every = torch.empty(group.size * width, dtype=torch.uint8, device=device)
    _comm.all_gather_into(every, padded, group, purpose="meta")
    rows = every.view(group.size, width).cpu()
    signatures = [bytes(rows[r, : lengths[r]].tolist()).decode().split("\n")
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


SEGMENT_BYTES = 1 << 20
"""The unit of the weight check's hash: each tensor's bytes, in row-major order, are hashed in
segments of this size (in parallel, and never more than a few segments copied at a time)."""


def _fingerprints(tensors: list[tuple[str, torch.Tensor]]) -> list[int]:
    """Three int64s per tensor: its name, dtype and shape (crc32), and a hash of its values.

    The values' part is 128 bits of a SHA-1 of the tensor's bytes in row-major order,
    whatever its strides, so any difference in any bit, and any permutation, shows (short of
    a hash collision). It needs no copy of a whole tensor: CPU tensors are hashed where they
    lie, and only a segment (`SEGMENT_BYTES`) at a time is copied from a strided or
    accelerator tensor. The segments of all tensors are hashed on a few threads (``hashlib``
    releases the GIL).
    """
    jobs = [(k, t, start) for k, (_, t) in enumerate(tensors)
            for start in range(0, t.numel(), max(1, SEGMENT_BYTES // t.element_size()))]
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda job: _segment_digest(*job[1:]), jobs))
    per_tensor: list[list[bytes]] = [[] for _ in tensors]
    for (k, _, _), digest in zip(jobs, digests, strict=True):
        per_tensor[k].append(digest)
    out: list[int] = []
    for (name, t), parts in zip(tensors, per_tensor, strict=True):
        digest = hashlib.sha1(b"".join(parts), usedforsecurity=False).digest()
        out += [zlib.crc32(f"{name} {t.dtype} {list(t.shape)}".encode()),
                int.from_bytes(digest[:8], "little", signed=True),
                int.from_bytes(digest[8:16], "little", signed=True)]
    return out


def _segment_digest(t: torch.Tensor, start: int) -> bytes:
    """SHA-1 of the elements ``[start, start + segment)`` of ``t`` in row-major order."""
    stop = min(t.numel(), start + max(1, SEGMENT_BYTES // t.element_size()))
    sha = hashlib.sha1(usedforsecurity=False)
    for part in _row_major(t.detach(), start, stop):
        sha.update(part.cpu().view(torch.uint8).numpy().data)
    return sha.digest()


def _row_major(t: torch.Tensor, start: int, stop: int) -> Iterator[torch.Tensor]:
    """Elements ``[start, stop)`` of ``t.reshape(-1)``, as contiguous 1-D pieces in order.

    Views where ``t`` is contiguous; otherwise copies of at most ``stop - start`` elements
    (one piece at a time), never of the whole tensor.
    """
    if t.is_contiguous():
        yield t.reshape(-1)[start:stop]
    elif t.dim() == 1:
        yield t[start:stop].contiguous()
    else:
        row = t[0].numel()
        first, last = start // row, (stop - 1) // row
        if first == last:
            yield from _row_major(t[first], start - first * row, stop - first * row)
            return
        yield from _row_major(t[first], start - first * row, row)
        if last > first + 1:
            yield t[first + 1: last].reshape(-1)
        yield from _row_major(t[last], 0, stop - last * row)


def check_same_weights(fn: str, module: nn.Module, group: GroupLike) -> None:
    """Raise on every rank of ``group`` unless every rank holds the same dense weights.

    Compares a hash of every parameter and buffer (two small int64 exchanges: the count,
    then three int64s per tensor), so it costs one pass over the weights and a few MiB of
    memory at most, whatever their size (`_fingerprints`).

    Raises:
        CollectiveArgumentError: the ranks differ; names the first differing parameter or
            buffer and which ranks hold which version.
    """
    g = resolve_group(group, fn)
    if g.is_single:
        return
    tensors = _dense_tensors(module)
    device = g.comm_device(next((t.device for _, t in tensors), None))
    counts = [row[0] for row in _comm.exchange_ints(g, [len(tensors)], device)]
    if counts.count(counts[0]) != g.size:
        raise CollectiveArgumentError(
            f"{fn}: the ranks hold different models: {ranks_by_value(counts, _tensors)}; "
            f"build the same dense model on every rank")
    every = torch.tensor(_comm.exchange_ints(g, _fingerprints(tensors), device)
                         ).view(g.size, -1, 3)
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

