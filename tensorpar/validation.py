"""Validation mode: every rank checks that its peers issue the same collective, before it runs.

Off by default, and then free: each collective entry point tests one flag. On
(`validation`, or ``TENSORPAR_VALIDATE=1`` in the environment), before each collective, each
backward collective, each bucket the data-parallel reducer launches and its end-of-backward
synchronisation, the ranks all-gather a fixed-size int64 fingerprint (on CPU it travels
as one all-to-all step): a per-group sequence number, the operation, forward or backward,
the reduce op, the backward mode, dims, dtype, shape or chunk lengths, src/dst, and the
reducer's iteration, bucket and ``no_sync`` count. On any difference every rank raises the
same `CollectiveMismatchError`, e.g.
``all_reduce #12 on a group of 4: op differs: ranks 0,1,3 "sum", rank 2 "max"``.

A rank that skipped a collective, or issued another one, is caught at the next
collective it shares with its peers, before data pairs with the wrong call.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from tensorpar import _comm
from tensorpar._group import Group
from tensorpar._meta import ranks_by_value
from tensorpar._switch import VALIDATE
from tensorpar.errors import CollectiveMismatchError
from tensorpar.placeholder import _DTYPE_TO_CODE, MAX_NDIM

__all__ = ["validation", "validation_enabled"]

SWITCH = VALIDATE  # the switch itself lives in `tensorpar._switch`, readable by every layer
# While validation is on: the number of checked collectives per process group (weakly held,
# so a destroyed group takes its count with it). Every rank counts alike, so a rank that
# skipped a collective shows a different number.
_COUNTS: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()


class validation:  # lower case: it reads as a call, tensorpar.validation(True)
    """Turn validation mode on or off: a global switch, and a context manager that restores.

    ``tensorpar.validation(True)`` switches it on for the process from then on;
    ``with tensorpar.validation(True): ...`` switches it on for the block and restores the
    previous setting after. Every rank must switch alike, at the same point of its program.
    ``TENSORPAR_VALIDATE=1`` in the environment switches it on at import.

    Args:
        enabled: on (default) or off.

    Example:
        >>> import tensorpar
        >>> with tensorpar.validation(True):
        ...     tensorpar.validation_enabled()
        True
        >>> tensorpar.validation_enabled()
        False
    """

    def __init__(self, enabled: bool = True) -> None:
        self._previous = SWITCH[0]
        SWITCH[0] = bool(enabled)

    def __enter__(self) -> validation:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        SWITCH[0] = self._previous

    def __repr__(self) -> str:
        return f"validation({SWITCH[0]})"


def validation_enabled() -> bool:
    """Whether validation mode is on (see `validation`)."""
    return SWITCH[0]


# -- the fingerprint --------------------------------------------------------------------

OPERATIONS = ("scatter", "gather", "broadcast", "reduce", "all_gather", "reduce_scatter",
              "all_reduce", "all_to_all", "copy_to_group", "reduce_from_group",
              "split_to_group", "gather_from_group", "BucketedAllReduce bucket",
              "BucketedAllReduce end of backward", "BucketedAllReduce forward")
_REDUCE_OPS = ("sum", "mean", "max", "min")
_MODES = ("sum", "identity")
_MAX_SIZES = 16
_MAGIC = 0x7470_5600  # "tpV"
_TAIL = 11 + MAX_NDIM + _MAX_SIZES  # the first of the scalar fields after the chunk lengths
_TAIL_FIELDS = ("src/dst", "no_sync backward passes since the last synchronised one",
                "reducer forward passes", "reducer iteration", "reducer bucket",
                "sequence number")
# (name, first slot, slots), in the order differences are reported
_FIELDS = (("operation", 1, 1), ("forward/backward", 2, 1), ("op", 3, 1),
           ("backward mode", 4, 1), ("dtype", 5, 1), ("dim", 6, 2), ("shape", 8, 1 + MAX_NDIM),
           ("chunk lengths", 9 + MAX_NDIM, 2 + _MAX_SIZES),
           *((name, _TAIL + i, 1) for i, name in enumerate(_TAIL_FIELDS)))
LENGTH = _TAIL + len(_TAIL_FIELDS)
_NONE = -1
_OTHER = -2  # a value the fingerprint has no code for (the call raises on every rank later)


def _code(value: object, names: Sequence[str]) -> int:
    if value is None:
        return _NONE
    return names.index(value) if value in names else _OTHER


def check(operation: str, g: Group, *, backward: bool = False, dtype: object = None,
          shape: Sequence[int] | None = None, shape_skips: Sequence[int] = (),
          op: object = None, mode: object = None, dim: object = None, dim2: object = None,
          sizes: Sequence[int] | None = None, root: object = -1, forwards: int = -1,
          iteration: int = -1, bucket: int = -1, unsynced: int = -1) -> None:
    """Compare this collective's fingerprint with every rank's; raise on every rank if any differ.

    ``shape_skips``: dims of ``shape`` whose length may legitimately differ across ranks
    (e.g. the concatenation dim of an all-gather). Call only when validation is on and
    ``g`` has more than one rank.

    Raises:
        CollectiveMismatchError: the ranks' fingerprints differ (the same error on every rank).
    """
    fp = [_NONE] * LENGTH
    fp[0] = _MAGIC
    fp[1] = _code(operation, OPERATIONS)
    fp[2] = int(backward)
    fp[3] = _code(op, _REDUCE_OPS)
    fp[4] = _code(mode, _MODES)
    if isinstance(dtype, torch.dtype):
        fp[5] = _DTYPE_TO_CODE.get(dtype, _OTHER)
    ndim = None if shape is None else len(shape)
    fp[6], fp[7] = _dim(dim, ndim), _dim(dim2, ndim)
    if shape is not None:
        skips = {_dim(d, ndim) for d in shape_skips}
        fp[8] = len(shape)
        for i, n in enumerate(list(shape)[:MAX_NDIM]):
            fp[9 + i] = _NONE if i in skips else int(n)
    if sizes is not None:
        base = 9 + MAX_NDIM
        fp[base] = len(sizes)
        fp[base + 1] = zlib.crc32(repr(list(sizes)).encode())
        for i, n in enumerate(list(sizes)[:_MAX_SIZES]):
            fp[base + 2 + i] = n if isinstance(n, int) and not isinstance(n, bool) else _OTHER
    fp[_TAIL: LENGTH] = [root if isinstance(root, int) else _OTHER, unsynced, forwards,
                         iteration, bucket, _next_count(g)]
    _compare(operation, g, _exchange(g, fp))


def check_call(fn: str, g: Group, x: object, dim: object, op: object, backward: object,
               sizes: object, root: object) -> None:
    """The fingerprint of a public collective, from its arguments as passed (before checks)."""
    tensor = x if isinstance(x, torch.Tensor) else None
    skips: tuple[object, ...] = ()
    if fn in ("all_gather", "gather", "gather_from_group") and sizes is None:
        skips = (dim,)
    seq = list(sizes) if isinstance(sizes, (list, tuple)) else None
    check(fn, g, dtype=None if tensor is None else tensor.dtype,
          shape=None if tensor is None else tensor.shape,
          shape_skips=[d for d in skips if isinstance(d, int)], op=op, mode=backward, dim=dim,
          sizes=seq, root=root)


def _dim(dim: object, ndim: int | None) -> int:
    if dim is None:
        return -1000
    if isinstance(dim, bool) or not isinstance(dim, int):
        return _OTHER
    if ndim and -ndim <= dim < ndim:
        return dim % ndim
    return dim


def _next_count(g: Group) -> int:
    handle = g.handle
    if handle is None:
        return 0
    count = _COUNTS.get(handle, 0) + 1
    _COUNTS[handle] = count
    return count


def _exchange(g: Group, fp: list[int]) -> list[list[int]]:
    return _comm.exchange_ints(g, fp)


def _compare(operation: str, g: Group, every: list[list[int]]) -> None:
    first = every[0]
    if all(row == first for row in every):
        return
    if any(row[0] != _MAGIC for row in every):
        raise CollectiveMismatchError(
            f"{operation} on a group of {g.size}: validation mode is on on some ranks only: "
            + ranks_by_value(["on" if row[0] == _MAGIC else "off" for row in every])
            + "; switch it alike on every rank")
    seq_slot = _FIELDS[-1][1]
    counts = [row[seq_slot] for row in every]
    label = f"{_show_op(first[1])} #{counts[0]}" if len(set(counts)) == 1 else \
        f"{_show_op(first[1])} (#{counts[0]} on rank 0)"
    for name, start, width in _FIELDS:
        values = [tuple(row[start: start + width]) for row in every]
        if len(set(values)) == 1:
            continue
        shown = [_show(name, v) for v in values]
        hint = _HINTS.get(name, "")
        raise CollectiveMismatchError(
            f"{label} on a group of {g.size}: {name} differs: {ranks_by_value(shown)}{hint}")


_HINTS = {
    "operation": " (a rank skipped a collective or issued another one)",
    "sequence number": " (a rank skipped or added a collective earlier)",
    "reducer forward passes": " (a rank skipped a batch, or ran an extra forward)",
    "reducer iteration": " (a rank skipped or repeated a backward pass)",
    "no_sync backward passes since the last synchronised one": " (no_sync() on some ranks only)",
}


def _show_op(code: int) -> str:
    return OPERATIONS[code] if 0 <= code < len(OPERATIONS) else "an unknown operation"


def _show(name: str, value: tuple[int, ...]) -> str:
    v = value[0]
    if name == "operation":
        return f'"{_show_op(v)}"'
    if name == "forward/backward":
        return "backward" if v else "forward"
    if name in ("op", "backward mode"):
        names = _REDUCE_OPS if name == "op" else _MODES
        return f'"{names[v]}"' if 0 <= v < len(names) else ("none" if v == _NONE else "other")
    if name == "dtype":
        return next((str(d).removeprefix("torch.") for d, c in _DTYPE_TO_CODE.items()
                     if c == v), "none")
    if name == "dim":  # (split_dim, concat_dim) for all_to_all
        shown = [str(d) for d in value if d != -1000]
        return ("dim=" + ",".join(shown)) if shown else "no dim"
    if name == "src/dst":
        return "no src/dst" if v == _NONE else f"src/dst={v}"
    if name == "shape":
        return "none" if v == _NONE else "[" + ", ".join(
            "*" if d == _NONE else str(d) for d in value[1: 1 + v]) + "]"
    if name == "chunk lengths":
        return "none" if v == _NONE else str(list(value[2: 2 + min(v, _MAX_SIZES)]))
    return "none" if v == _NONE else str(v)


def check_backward(operation: str, g: Group, spec: Any = None, grad: torch.Tensor | None = None,
                   *, op: str | None = None, mode: str | None = None) -> None:
    """The fingerprint of a collective a backward pass issues (``operation``, the dual's name).

    ``spec`` (a `RootSpec`, `SplitSpec` or `AllToAllSpec`) supplies what every rank shares;
    without one, ``grad``'s dtype and shape (which every rank's must match).
    """
    if g.size == 1:
        return
    if spec is None:
        assert grad is not None
        check(operation, g, backward=True, dtype=grad.dtype, shape=grad.shape, op=op, mode=mode)
        return
    if hasattr(spec, "split_dim"):  # all_to_all: shapes may differ; dims and dtype may not
        check(operation, g, backward=True, dim=spec.split_dim, dim2=spec.concat_dim)
        return
    check(operation, g, backward=True, dtype=spec.dtype, shape=spec.full_shape, op=op,
          mode=mode, dim=getattr(spec, "dim", None), sizes=getattr(spec, "sizes", None),
          root=spec.root)
