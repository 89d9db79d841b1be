"""Split arithmetic shared by the collectives: chunk sizes, validation and flat transport.

Uneven chunks travel flattened and padded to the largest chunk's element count, so the
same code runs on gloo (whose scatter/gather need equal sizes) and NCCL.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tensorpar.comm._group import Group
from tensorpar.errors import CollectiveArgumentError, CollectiveTypeError

__all__ = ["RootSpec", "SplitSpec", "balanced_sizes", "check_sizes", "sizes_or_balanced"]


def balanced_sizes(length: int, parts: int) -> tuple[int, ...]:
    """Chunk lengths of ``torch.tensor_split(x, parts)`` along a dim of ``length``.

    Example:
        >>> balanced_sizes(10, 3)
        (4, 3, 3)
    """
    # one expression per chunk, without a branch on the remainder: traced at a symbolic
    # length, the chunks stay expressions of it (Dynamo does not fix the length's value)
    return tuple((length + parts - 1 - r) // parts for r in range(parts))


def check_sizes(fn: str, sizes: object, parts: int) -> tuple[int, ...]:
    """Validate a ``sizes=`` argument's form: one non-negative int per rank."""
    if not isinstance(sizes, (list, tuple)):
        raise CollectiveTypeError(
            f"{fn}: sizes must be a list of ints (one per rank), "
            f"got {type(sizes).__name__}")
    if len(sizes) != parts:
        raise CollectiveArgumentError(
            f"{fn}: sizes={list(sizes)} has {len(sizes)} entries, expected one per "
            f"rank of the group ({parts})")
    for s in sizes:  # a plain loop: this runs on every call that passes sizes
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise CollectiveArgumentError(f"{fn}: sizes={list(sizes)} must hold non-negative ints")
    return tuple(sizes)


def check_total(fn: str, sizes: Sequence[int], length: int, dim: int, what: str) -> None:
    """Raise (on every rank: the inputs are the same everywhere) if sizes don't sum to length."""
    if sum(sizes) != length:
        raise CollectiveArgumentError(
            f"{fn}: sizes={list(sizes)} sum to {sum(sizes)}, but {what} has length {length} "
            f"along dim {dim}")


def sizes_or_balanced(fn: str, sizes: tuple[int, ...] | None, length: int, dim: int,
                      parts: int, what: str) -> tuple[int, ...]:
    """``sizes`` checked against ``length``, or the balanced split of ``length``."""
    if sizes is None:
        return balanced_sizes(length, parts)
    check_total(fn, sizes, length, dim, what)
    return sizes


@dataclass(frozen=True)
class RootSpec:
    """A full tensor's metadata and the rank that owns it (``root=-1``: every rank).

    Shared by a collective and its dual, so no metadata is exchanged in backward.
    """

    group: Group
    root: int
    full_shape: torch.Size
    dtype: torch.dtype

    @property
    def is_root(self) -> bool:
        return self.group.rank == self.root


@dataclass(frozen=True)
class SplitSpec(RootSpec):
    """How a full tensor is split into per-rank chunks along ``dim`` (``sizes[r]`` each)."""

    dim: int
    sizes: tuple[int, ...]

    def chunk_shape(self, rank: int) -> torch.Size:
        shape = list(self.full_shape)
        shape[self.dim] = self.sizes[rank]
        return torch.Size(shape)

    @property
    def numels(self) -> tuple[int, ...]:
        """Elements in each rank's chunk."""
        per_row = math.prod(d for i, d in enumerate(self.full_shape) if i != self.dim)
        return tuple(s * per_row for s in self.sizes)

    @property
    def is_even(self) -> bool:
        return len(set(self.sizes)) == 1

    @property
    def leading_is_one(self) -> bool:
        """True when every dim before ``dim`` has length 1: chunks are contiguous slices."""
        return math.prod(self.full_shape[: self.dim]) == 1


# dtypes every backend moves natively; the rest (bool, complex, float8, ...) travel as bytes
NATIVE_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16,
                           torch.int8, torch.uint8, torch.int32, torch.int64})


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat view of a contiguous tensor for pure data movement.

    Its own dtype where every backend handles it (the backends' fastest path), raw bytes
    otherwise, so any dtype can be scattered, gathered or exchanged.
    """
    flat = t if t.ndim == 1 else t.reshape(-1)
    return flat if flat.dtype in NATIVE_DTYPES else flat.view(torch.uint8)
