"""Validation mode: every rank checks that its peers issue the same collective, before it runs.

Off by default, and then free: each collective entry point tests one flag. On
(`validation`, or ``TENSORPAR_VALIDATE=1`` in the environment), before each collective and
each backward collective (and wherever a caller such as the data-parallel reducer asks,
`check`), the ranks all-gather a fixed-size int64 fingerprint (on CPU it travels as one
all-to-all step): a per-group sequence number, the operation, forward or backward, the
reduce op, the backward mode, dims, dtype, shape or chunk lengths, ``requires_grad`` where
the ranks must agree on it, src/dst, the call site (`tensorpar.validation._callsite`), a
checksum of an input that must be the same on every rank (`copy_to_group`,
`split_to_group`, and so every column-parallel layer and embedding), and integer counters the caller
names. On any difference every rank raises the same `CollectiveMismatchError`, e.g.
``all_reduce #12 on a group of 4: op differs: ranks 0,1,3 "sum", rank 2 "max"``.

A rank that skipped a collective, or issued another one, is caught at the next
collective it shares with its peers, before data pairs with the wrong call.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from tensorpar.comm import _comm
from tensorpar.comm._group import Group
from tensorpar.comm._switch import VALIDATE
from tensorpar.errors import CollectiveMismatchError
from tensorpar.placeholder import _DTYPE_TO_CODE, MAX_NDIM, TensorPlaceholder
from tensorpar.validation._callsite import Site, call_site
from tensorpar.validation._fingerprint import (
    LENGTH,
    MAGIC,
    MAX_COUNTERS,
    MAX_SIZES,
    MODES,
    NAME_SLOTS,
    NO_DIM,
    NONE,
    OTHER,
    REDUCE_OPS,
    TEXT_SLOTS,
    Counter,
    compare,
    pack,
    put,
)

__all__ = ["validation", "validation_enabled"]

SWITCH = VALIDATE  # the switch itself lives in `tensorpar.comm._switch`, readable by every layer


@dataclass
class _Counts:
    """What validation mode counts per process group while it is on."""

    checked: int = 0
    """Collectives checked on the group: every rank counts alike."""
    sites: dict[tuple[int, bool], int] = field(default_factory=dict)
    """Calls per call site (forward or backward), shown in messages."""
    last_site: Site | None = None
    """The site of the last checked call: a Function's forward records it for its backward."""


# Weakly held, so that a destroyed group takes its counts with it.
_COUNTS: weakref.WeakKeyDictionary[dist.ProcessGroup, _Counts] = weakref.WeakKeyDictionary()


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



def check(operation: str, g: Group, *, backward: bool = False, dtype: object = None,
          shape: Sequence[int] | None = None, shape_skips: Sequence[int] = (),
          op: object = None, mode: object = None, dim: object = None, dim2: object = None,
          sizes: Sequence[int] | None = None, against_sizes: int | None = None,
          requires_grad: bool | None = None, root: object = -1,
          counters: Sequence[Counter] = (), values: torch.Tensor | None = None,
          site: Site | None = None, label: str = "") -> bool:
    """Compare this collective's fingerprint with every rank's; raise on every rank if any differ.

    Outside validation mode, and on a group of one rank, it compares nothing and returns
    False (so callers need not ask first). Every argument but ``operation`` and ``g`` is
    optional: what is not given is not compared.

    Args:
        operation: the name in messages (up to 40 characters travel).
        g: the group.
        backward: issued by a backward pass.
        dtype: the tensor's dtype.
        shape: the tensor's shape.
        shape_skips: dims of ``shape`` whose length may legitimately differ across ranks
            (e.g. the concatenation dim of an all-gather).
        op: the reduce op.
        mode: the backward mode (`tensorpar.all_reduce`'s ``backward``).
        dim: the collective's dim (an all-to-all's ``split_dim``).
        dim2: an all-to-all's ``concat_dim``.
        sizes: the chunk lengths.
        root: ``src`` or ``dst``.
        against_sizes: this rank's chunk length minus ``sizes[rank]`` (0 when they agree).
        requires_grad: where every rank must agree on it (e.g. with ``sizes=``).
        counters: ``(name, value, hint)`` for up to four integers the caller keeps (for
            instance the data-parallel reducer's iteration), compared and named in messages.
        values: a tensor whose values must be the same on every rank: its checksum is
            compared (bit for bit).
        site: the call site (`tensorpar.validation._callsite.call_site`); a backward passes its
            forward's.
        label: what the call is part of, for messages (e.g. ``"the input of
            ColumnParallelLinear"``).

    Returns:
        Whether the ranks compared (True: they agree).

    Raises:
        CollectiveMismatchError: the ranks' fingerprints differ (the same error on every rank).
    """
    if not VALIDATE[0] or g.size == 1:
        return False
    fp = [NONE] * LENGTH
    fp[0] = MAGIC
    put(fp, "operation", pack(operation, NAME_SLOTS))
    put(fp, "forward/backward", [int(backward)])
    put(fp, "op", [_code(op, REDUCE_OPS)])
    put(fp, "backward mode", [_code(mode, MODES)])
    if isinstance(dtype, torch.dtype):
        put(fp, "dtype", [_DTYPE_TO_CODE.get(dtype, OTHER)])
    ndim = None if shape is None else len(shape)
    put(fp, "dim", [_dim(dim, ndim), _dim(dim2, ndim)])
    if shape is not None:
        skips = {_dim(d, ndim) for d in shape_skips}
        dims = [NONE if i in skips else int(n) for i, n in enumerate(list(shape)[:MAX_NDIM])]
        put(fp, "shape", [len(shape), *dims])
    if sizes is not None:
        shown = [n if isinstance(n, int) and not isinstance(n, bool) else OTHER
                 for n in list(sizes)[:MAX_SIZES]]
        put(fp, "chunk lengths", [len(sizes), zlib.crc32(repr(list(sizes)).encode()), *shown])
    if against_sizes is not None:
        put(fp, "this rank's chunk against sizes", [against_sizes])
    if requires_grad is not None:
        put(fp, "requires_grad", [int(requires_grad)])
    put(fp, "src/dst", [root if isinstance(root, int) else OTHER])
    if counters:
        names = "|".join(name for name, _, _ in counters)
        put(fp, "counters", [zlib.crc32(names.encode()),
                              *(value for _, value, _ in counters[:MAX_COUNTERS])])
    if values is not None:
        put(fp, "input values", checksum(values))
    state = _state(g)
    if site is not None:
        key = (site.count_key, backward)
        calls = state.sites[key] = state.sites.get(key, 0) + 1
        put(fp, "call site", [*site.slots, calls, *pack(site.text, TEXT_SLOTS)])
    state.last_site = site
    state.checked += 1
    fp[-1] = state.checked
    every = _exchange(g, fp)
    try:
        compare(operation, g.size, every, counters, label)
    except CollectiveMismatchError:
        state.sites.clear()  # every rank raises here: the counts start afresh together
        raise
    return True


def last_site(g: Group) -> Site | None:
    """The call site of the last collective checked on ``g`` (for a Function's backward).

    ``None`` outside validation mode (nothing is checked there).
    """
    if not VALIDATE[0]:
        return None
    handle = g.handle
    counts = None if handle is None else _COUNTS.get(handle)
    return None if counts is None else counts.last_site


def checksum(t: torch.Tensor) -> list[int]:
    """Two int64s that change when any bit of ``t`` changes, or when values move around.

    ``t``'s bytes are read as int64s, in rows of 64: the 64 column sums and the 64 sums of
    consecutive blocks (one pass each, no copy, no widening), combined with weights by
    position. Integer sums wrap exactly and do not depend on the order of summation, so
    equal tensors give equal checksums on any device and thread count.
    """
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    raw = x.contiguous().view(-1)
    if raw.numel() == 0:
        return [0, 0]
    raw = raw.view(torch.uint8)
    whole = raw.numel() - raw.numel() % 512  # 64 int64s a row
    try:
        words = raw[:whole].view(torch.int64)
    except RuntimeError:  # a storage offset that is no multiple of 8 bytes
        words = raw[:whole].clone().view(torch.int64)
    parts = [raw[whole:].to(torch.int64)]  # the last < 512 bytes
    if whole:
        parts += [words.view(-1, 64).sum(0), words.view(64, -1).sum(1)]
    values = torch.cat(parts).tolist()
    total = weighted = 0
    for i, v in enumerate(values):
        total += v
        weighted += v * (2 * i + 1)
    return [_int64(total), _int64(weighted)]


def _int64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _code(value: object, names: Sequence[str]) -> int:
    if value is None:
        return NONE
    return names.index(value) if value in names else OTHER


def _dim(dim: object, ndim: int | None) -> int:
    if dim is None:
        return NO_DIM
    if isinstance(dim, bool) or not isinstance(dim, int):
        return OTHER
    if ndim and -ndim <= dim < ndim:
        return dim % ndim
    return dim


def _state(g: Group) -> _Counts:
    handle = g.handle
    if handle is None:
        return _Counts()
    state = _COUNTS.get(handle)
    if state is None:
        state = _COUNTS[handle] = _Counts()
    return state


def _exchange(g: Group, fp: list[int]) -> list[list[int]]:
    return _comm.exchange_ints(g, fp)


# -- the collectives' fingerprints ----------------------------------------------------------

_CONCATENATIONS = ("all_gather", "gather", "gather_from_group")
_REPLICATED_INPUT = ("copy_to_group", "split_to_group")
_ROOTED_SOURCE = ("scatter", "broadcast")  # given x only without the metadata exchange
_NO_BACKWARD_COLLECTIVE = ("reduce_from_group",)  # its backward passes the gradient through


def check_call(fn: str, g: Group, x: object, dim: object, op: object, backward: object,
               sizes: object, root: object, label: str = "") -> None:
    """The fingerprint of a public collective, from its arguments as passed (before checks).

    ``x``: the tensor (or, for a rooted collective without a metadata exchange, the
    placeholder) whose dtype and shape every rank must agree on; ``None`` for nothing.
    Unless a concatenation's header exchange tells them (no ``sizes``), the ranks must also
    agree on ``requires_grad`` where the backward communicates, which they cannot learn
    from each other (a rank without it would skip the backward's collective); a region's
    replicated input must hold the same
    values on every rank. Outside validation mode (or on one rank) it does nothing.
    """
    if not VALIDATE[0] or g.size == 1:
        return
    tensor = x if isinstance(x, torch.Tensor) else None
    described = tensor if tensor is not None else x if isinstance(x, TensorPlaceholder) else None
    seq = list(sizes) if isinstance(sizes, (list, tuple)) else None
    concat = fn in _CONCATENATIONS
    skips = [dim] if concat and isinstance(dim, int) else []
    requires_grad = against = None
    # compared unless the header exchange shares it or the backward has no collective
    shared = concat and seq is None
    silent = fn in _NO_BACKWARD_COLLECTIVE or backward == "identity" or op in ("max", "min")
    if described is not None and not shared and not silent:
        requires_grad = described.requires_grad and torch.is_grad_enabled()
    if tensor is not None and seq is not None and concat:
        against = _against_sizes(tensor, dim, seq, g.rank)
    check(fn, g, dtype=None if described is None else described.dtype,
          shape=None if described is None else described.shape, shape_skips=skips, op=op,
          mode=backward, dim=dim, sizes=seq, against_sizes=against,
          requires_grad=requires_grad, root=root,
          values=tensor if fn in _REPLICATED_INPUT else None, site=call_site(), label=label)


def _against_sizes(x: torch.Tensor, dim: object, sizes: list[object], rank: int) -> int | None:
    """This rank's chunk length minus ``sizes[rank]`` (``None`` where either is malformed)."""
    d = _dim(dim, x.ndim)
    expected = sizes[rank] if rank < len(sizes) else None
    if not 0 <= d < x.ndim or not isinstance(expected, int) or isinstance(expected, bool):
        return None
    return int(x.shape[d]) - expected


def check_all_to_all(g: Group, x: object, split_dim: object, concat_dim: object,
                     sizes: Sequence[int] | None) -> None:
    """The fingerprint of `tensorpar.all_to_all` (its dims play the part of ``dim``).

    Outside validation mode (or on one rank) it does nothing.
    """
    if not VALIDATE[0] or g.size == 1:
        return
    tensor = x if isinstance(x, torch.Tensor) else None
    check("all_to_all", g, dtype=getattr(tensor, "dtype", None),
          shape=getattr(tensor, "shape", None),
          shape_skips=(split_dim, concat_dim) if sizes is None else (),  # type: ignore[arg-type]
          dim=split_dim, dim2=concat_dim, sizes=sizes,
          requires_grad=None if sizes is None or tensor is None
          else tensor.requires_grad and torch.is_grad_enabled(), site=call_site())


def check_backward(operation: str, g: Group, spec: Any = None, grad: torch.Tensor | None = None,
                   *, op: str | None = None, mode: str | None = None,
                   site: Site | None = None) -> None:
    """The fingerprint of a collective a backward pass issues (``operation``, the dual's name).

    ``spec`` (a `RootSpec`, `SplitSpec` or `AllToAllSpec`) supplies what every rank shares;
    without one, ``grad``'s dtype and shape (which every rank's must match). ``site``: the
    forward call's site (a backward runs inside autograd, where the user's frames tell
    nothing about which call it belongs to). Outside validation mode it does nothing.
    """
    if not VALIDATE[0] or g.size == 1:
        return
    if spec is None:
        assert grad is not None
        check(operation, g, backward=True, dtype=grad.dtype, shape=grad.shape, op=op,
              mode=mode, site=site)
        return
    if hasattr(spec, "split_dim"):  # all_to_all: shapes may differ; dims and dtype may not
        check(operation, g, backward=True, dim=spec.split_dim, dim2=spec.concat_dim, site=site)
        return
    check(operation, g, backward=True, dtype=spec.dtype, shape=spec.full_shape, op=op,
          mode=mode, dim=getattr(spec, "dim", None), sizes=getattr(spec, "sizes", None),
          root=spec.root, site=site)
