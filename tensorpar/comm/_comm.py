"""The one internal layer through which tensorpar calls ``torch.distributed``.

Every collective tensorpar issues goes through a function here, so counting
(`CommCounter`), argument checks and timeouts live in one place. Functions take a resolved
`Group` and group ranks; they never run on a single-rank group (callers take the fast path
before reaching this layer). The common collectives call the process group's own method
directly (`_direct`), without torch.distributed's wrapper; a backend failure still surfaces
as a `CollectiveTimeoutError` / `PeerLostError` naming the collective (a ``try`` costs
nothing until something raises).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from tensorpar._torch import C10D_WORLD
from tensorpar.comm._faults import Pending, raise_translated, sequence_number
from tensorpar.comm._group import Group

__all__ = ["CollectiveRecord", "CommCounter"]

Purpose = Literal["data", "meta"]
Scope = Literal["intra", "inter", "mixed"]
_META = "all_gather (a metadata exchange)"


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective issued by tensorpar on this rank.

    Attributes:
        kind: the ``torch.distributed`` operation, e.g. ``"scatter"``, ``"all_gather"``. A
            metadata exchange counts as an ``"all_gather"`` (on CPU it travels as one
            all-to-all step, faster than gloo's all-gather ring for a few bytes).
        group_size: number of ranks in the group it ran on.
        nbytes: payload this rank handed to the collective (its input buffers), in bytes.
            A rank that only receives (a non-source rank of a scatter) records 0.
        purpose: ``"data"`` for tensor payload, ``"meta"`` for a metadata header exchange.
        scope: where the group's ranks live, once a `tensorpar.Topology` has described
            them: ``"intra"`` (all on one machine), ``"inter"`` (each on a different machine:
            every byte crosses the network, like the rails of a hierarchical all-reduce),
            ``"mixed"`` (several machines, some holding several of the ranks: a flat
            collective over a multi-machine job), or ``None`` (no topology covers the group).
    """

    kind: str
    group_size: int
    nbytes: int
    purpose: Purpose
    scope: Scope | None = None


class CommCounter:
    """Context manager that records every collective tensorpar issues on this rank.

    Collectives issued while the counter is active, in forward or backward and from any
    thread, are appended to `records`. Counters nest: each active counter sees every
    collective.

    Example:
        >>> import torch, tensorpar
        >>> with tensorpar.CommCounter() as counter:
        ...     chunk = tensorpar.scatter(torch.arange(4.0))   # one rank: no collective
        >>> counter.count()
        0
    """

    def __init__(self) -> None:
        self.records: list[CollectiveRecord] = []

    def __enter__(self) -> CommCounter:
        with _LOCK:
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _LOCK:
            _ACTIVE.remove(self)

    def count(self, kind: str | None = None, *, purpose: Purpose | None = None,
              scope: Scope | None = None) -> int:
        """Number of recorded collectives matching ``kind``, ``purpose`` and ``scope``.

        Each filter left at ``None`` matches every record; see `CollectiveRecord`.
        """
        return sum(1 for r in self._select(kind, purpose, scope))

    def nbytes(self, kind: str | None = None, *, purpose: Purpose | None = None,
               scope: Scope | None = None) -> int:
        """Total payload bytes of the recorded collectives matching the filters of `count`.

        ``nbytes(scope="intra")`` and ``nbytes(scope="inter")`` tell the bytes handed to
        collectives within one machine from those handed to collectives across machines.
        """
        return sum(r.nbytes for r in self._select(kind, purpose, scope))

    def ring_bytes(self, kind: str | None = None, *, purpose: Purpose | None = None,
                   scope: Scope | None = None) -> float:
        """Bytes this rank sends for the matching collectives, as ring algorithms move them.

        `nbytes` counts what each call is handed, which makes an all-reduce of ``n`` bytes
        look like a reduce-scatter of ``n`` plus an all-gather of ``n / p``. On the wire
        (ring algorithms, ``p`` ranks) an all-reduce sends ``2 (p - 1) / p * n``, a
        reduce-scatter ``(p - 1) / p * n`` and an all-gather ``(p - 1) * chunk``: an
        all-reduce costs exactly a reduce-scatter plus an all-gather of the same tensor.
        Other collectives count their payload.
        """
        total = 0.0
        for r in self._select(kind, purpose, scope):
            p = r.group_size
            share = {"all_reduce": 2 * (p - 1) / p, "reduce_scatter": (p - 1) / p,
                     "all_gather": float(p - 1)}.get(r.kind, 1.0)
            total += share * r.nbytes
        return total

    def _select(self, kind: str | None, purpose: Purpose | None, scope: Scope | None
                ) -> Iterator[CollectiveRecord]:
        for r in self.records:
            if (kind is None or r.kind == kind) and (purpose is None or r.purpose == purpose) \
                    and (scope is None or r.scope == scope):
                yield r

    def __repr__(self) -> str:
        kinds: dict[str, int] = {}
        for r in self.records:
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
        return f"CommCounter({kinds})"


# Counters are diagnostics that must see collectives issued from autograd threads too, so
# they are registered process-wide rather than per context.
_ACTIVE: list[CommCounter] = []
_LOCK = threading.Lock()


def _record(kind: str, group: Group, sent: Sequence[torch.Tensor] | None, purpose: Purpose
            ) -> None:
    """Tell every active counter; ``sent`` is what this rank hands over (None: nothing).

    Callers check ``_ACTIVE`` first, so a call without a counter builds nothing.
    """
    record = CollectiveRecord(kind, group.size, _nbytes(sent or []), purpose, _scope(group))
    with _LOCK:
        for counter in _ACTIVE:
            counter.records.append(record)


_MACHINE_OF: dict[int, int] = {}
"""Global rank -> a label of its machine, as topologies describe them."""


def note_machines(machine_of: Mapping[int, int]) -> None:
    """Record each global rank's machine, any label per machine (by `tensorpar.Topology`)."""
    _MACHINE_OF.update(machine_of)


def _scope(group: Group) -> Scope | None:
    """Where ``group``'s ranks live (see `CollectiveRecord.scope`); only counters ask."""
    handle = group.ref() if group.ref is not None else None
    if handle is None or not _MACHINE_OF:
        return None
    try:
        ranks = dist.get_process_group_ranks(handle)
    except (RuntimeError, ValueError, KeyError):  # a group torch.distributed does not list
        return None
    if any(r not in _MACHINE_OF for r in ranks):
        return None
    machines = {_MACHINE_OF[r] for r in ranks}
    if len(machines) == 1:
        return "intra"
    return "inter" if len(machines) == len(ranks) else "mixed"


def _pg(group: Group) -> dist.ProcessGroup | None:
    """The handle to pass to torch.distributed (``None`` for the default group).

    The default group's explicit handle takes a slower path through torch's argument checks
    (~0.1 ms a call).
    """
    handle = group.ref() if group.ref is not None else None  # (Group.handle, inlined)
    if handle is None:
        return group.handle  # None if torch.distributed is not initialised; raises if destroyed
    return None if handle is dist.group.WORLD else handle


# The process group's own methods: what torch.distributed's functions call after checks that
# tensorpar has made already (a resolved group this rank belongs to, matching tensors).
# Called directly they save the wrapper's microseconds on every collective. Anything unusual
# (a tensor subclass, complex numbers, a coalescing block, a torch without these methods)
# takes torch.distributed's function instead.
_c10d: Any = dist.distributed_c10d if dist.is_available() else None
_C10D_WORLD = C10D_WORLD
_PG = dist.ProcessGroup if dist.is_available() else None
_PG_ALL_GATHER = getattr(_PG, "all_gather_single", None) or getattr(_PG, "_allgather_base", None)
_PG_REDUCE_SCATTER = getattr(_PG, "reduce_scatter_single", None) \
    or getattr(_PG, "_reduce_scatter_base", None)
_PG_ALL_TO_ALL = getattr(_PG, "all_to_all_single", None) or getattr(_PG, "alltoall_base", None)
_DIRECT = _C10D_WORLD is not None and hasattr(_c10d.AllreduceOptions(), "asyncOp")


def _make_options(kind: str, op: Any, async_op: bool) -> Any:
    opts = getattr(_c10d, kind)()
    if op is not None:
        opts.reduceOp = op
    opts.asyncOp = async_op
    return opts


# The option objects of the direct calls, built once: the backend reads them (by const
# reference) and never writes them, so one object per (kind, op, async_op) serves every call
# (building one and setting two fields costs about a microsecond on every collective).
_OPTIONS: dict[tuple[str, Any, bool], Any] = {
    (kind, op, async_op): _make_options(kind, op, async_op)
    for kind, ops in (("AllreduceOptions", (dist.ReduceOp.SUM, dist.ReduceOp.MAX,
                                            dist.ReduceOp.MIN)),
                      ("ReduceScatterOptions", (dist.ReduceOp.SUM, dist.ReduceOp.MAX,
                                                dist.ReduceOp.MIN)),
                      ("AllgatherOptions", (None,)), ("AllToAllOptions", (None,)))
    for op in ops for async_op in (False, True)} if _DIRECT else {}


def _options(kind: str, op: Any, async_op: bool) -> Any:
    """The options of a direct call: the prebuilt object, or a new one for a rarer op."""
    try:
        return _OPTIONS[kind, op, async_op]
    except (KeyError, TypeError):  # (TypeError: an op that does not hash)
        return _make_options(kind, op, async_op)


def _direct(group: Group, *tensors: torch.Tensor) -> dist.ProcessGroup | None:
    """The process group to call directly, or ``None``: use torch.distributed's function."""
    handle = group.ref() if _DIRECT and group.ref is not None else None
    if handle is None:
        return None  # also a destroyed group: torch.distributed's path raises clearly
    for t in tensors:
        if type(t) is not torch.Tensor or t.dtype.is_complex:
            return None
    if handle in _C10D_WORLD.pg_coalesce_state:
        return None
    return handle


def _done(work: Any, async_op: bool) -> Any:
    """What a direct call returns: the work if asynchronous, else ``None`` once it is done."""
    if async_op:
        return work
    if work is not None:
        work.wait()
    return None


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# torch 2.13 renamed the flat collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

Work = Any
"""A ``torch.distributed`` work handle (``.wait()``), returned when ``async_op=True``."""


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Group,
                    purpose: Purpose = "data", async_op: bool = False,
                    one_step: bool = False) -> Work:
    """``out`` (size * inp.numel() elements, contiguous) receives every rank's ``inp``.

    ``one_step``: on CPU, one all-to-all step rather than a ring (for a few bytes; always
    so for ``purpose="meta"``). Every rank must pass the same.
    """
    if _ACTIVE:  # the common case: no counter, nothing to count
        _record("all_gather", group, [inp], purpose)
    try:
        if (one_step or purpose == "meta") and not async_op and inp.device.type == "cpu":
            _all_gather_in_one_step(out, inp, group)
            return None
        pg = _direct(group, out, inp)
        if pg is not None and _PG_ALL_GATHER is not None:
            opts = _options("AllgatherOptions", None, async_op)
            work = _done(_PG_ALL_GATHER(pg, out, inp, opts), async_op)
        else:
            work = _all_gather_flat(out, inp, group=_pg(group), async_op=async_op)
    except RuntimeError as exc:
        raise_translated(exc, _META if purpose == "meta" else "all_gather", group)
    return Pending(work, "all_gather", group) if async_op else None


def exchange_ints(group: Group, values: Sequence[int] | torch.Tensor,
                  device: torch.device | None = None) -> list[list[int]]:
    """Every rank's ``values`` (a few int64s, the same count on every rank), in rank order.

    The one metadata exchange of small integers: an `all_gather_into` with
    ``purpose="meta"`` (one all-to-all step on CPU, recorded as an ``"all_gather"``).

    Args:
        group: the group to exchange over (more than one rank).
        values: this rank's integers, a sequence or a 1-D int64 tensor.
        device: where the data lives, a hint for the buffers' device (see
            `Group.comm_device`); ``None``: the group's own choice.

    Returns:
        ``rows[r]`` is rank ``r``'s ``values``.
    """
    where = group.comm_device(device)
    mine = values.to(where, torch.int64) if isinstance(values, torch.Tensor) else \
        torch.tensor(values, dtype=torch.int64, device=where)
    out = torch.empty(group.size * mine.numel(), dtype=torch.int64, device=where)
    all_gather_into(out, mine, group, purpose="meta")
    rows: list[list[int]] = out.view(group.size, mine.numel()).tolist()
    return rows


def _all_gather_in_one_step(out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
    """A small all-gather on CPU as one all-to-all of ``inp`` repeated once per rank.

    gloo's all-gather is a ring: size - 1 steps, each waiting for the last. For the few bytes
    of a metadata exchange each step is pure latency; every rank sending to every rank at
    once is one step. Measured here on gloo (40 int64s, median per call): 3.4 ms against
    0.92 ms on 4 ranks, 0.34 ms against 0.26 ms on 2. (Only on CPU: on NCCL an all-to-all
    would open a connection to every peer.)
    """
    send = torch.cat([inp] * group.size)
    pg = _direct(group, out, send)
    if pg is not None and _PG_ALL_TO_ALL is not None:
        _done(_PG_ALL_TO_ALL(pg, out, send, [], [], _options("AllToAllOptions", None, False)),
              False)
    else:
        dist.all_to_all_single(out, send, group=_pg(group))


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, op: dist.ReduceOp, group: Group,
                        async_op: bool = False) -> Work:
    """Rank r's ``out`` receives slice r of the reduction of every rank's flat ``inp``."""
    if _ACTIVE:
        _record("reduce_scatter", group, [inp], "data")
    try:
        pg = _direct(group, out, inp)
        if pg is not None and _PG_REDUCE_SCATTER is not None:
            opts = _options("ReduceScatterOptions", op, async_op)
            work = _done(_PG_REDUCE_SCATTER(pg, out, inp, opts), async_op)
        else:
            work = _reduce_scatter_flat(out, inp, op=op, group=_pg(group), async_op=async_op)
    except RuntimeError as exc:
        raise_translated(exc, "reduce_scatter", group)
    return Pending(work, "reduce_scatter", group) if async_op else None


def all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: Group, async_op: bool = False) -> Work:
    """In-place all-reduce of ``t``."""
    if _ACTIVE:
        _record("all_reduce", group, [t], "data")
    try:
        pg = _direct(group, t)
        if pg is not None:
            work = _done(pg.allreduce([t], _options("AllreduceOptions", op, async_op)), async_op)
        else:
            work = dist.all_reduce(t, op=op, group=_pg(group), async_op=async_op)
    except RuntimeError as exc:
        raise_translated(exc, "all_reduce", group)
    return Pending(work, "all_reduce", group) if async_op else None


def broadcast(t: torch.Tensor, src: int, group: Group, async_op: bool = False) -> Work:
    """In-place broadcast of ``t`` from group rank ``src``."""
    if _ACTIVE:
        _record("broadcast", group, [t] if group.rank == src else None, "data")
    try:
        work = dist.broadcast(t, src=group.global_rank(src), group=_pg(group), async_op=async_op)
    except RuntimeError as exc:
        raise_translated(exc, "broadcast", group)
    return Pending(work, "broadcast", group) if async_op else None


def reduce(t: torch.Tensor, dst: int, op: dist.ReduceOp, group: Group,
           async_op: bool = False) -> Work:
    """Reduce ``t`` into rank ``dst``'s ``t``; other ranks' ``t`` may be used as scratch."""
    if _ACTIVE:
        _record("reduce", group, [t], "data")
    try:
        work = dist.reduce(t, dst=group.global_rank(dst), op=op, group=_pg(group),
                           async_op=async_op)
    except RuntimeError as exc:
        raise_translated(exc, "reduce", group)
    return Pending(work, "reduce", group) if async_op else None


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None,
               in_splits: list[int] | None, group: Group, async_op: bool = False,
               native: bool = False) -> Work:
    """Flat all-to-all: ``inp[in_splits[r]]`` goes to rank r (``None``: equal splits).

    Uneven splits of CPU tensors on gloo go point to point (`_p2p_all_to_all`) unless
    ``native``: then, as on every other backend, through the backend's own split-list
    all-to-all. (The dim-0 exchange with ``sizes`` passes ``native``: the collectives
    benchmark measures gloo's own split-list call within a few percent of the equal-split
    one, and the point-to-point messages 1.2x-1.5x slower at 1 MiB; so do the halo
    exchanges of domain parallelism, see `tensorpar.domain._tiles.rows.start_exchange`.)
    Every rank must pass the same ``native``.
    """
    if _ACTIVE:
        _record("all_to_all", group, [inp], "data")
    if not native and in_splits is not None and out_splits is not None \
            and inp.device.type == "cpu":
        handle = group.handle
        if handle is not None and handle.name() == "gloo":
            return _p2p_all_to_all(out.split(out_splits), inp.split(in_splits), group, handle,
                                   async_op)
    try:
        pg = _direct(group, out, inp)
        if pg is not None and _PG_ALL_TO_ALL is not None and out.dtype == inp.dtype:
            opts = _options("AllToAllOptions", None, async_op)
            work = _done(_PG_ALL_TO_ALL(pg, out, inp, out_splits or [], in_splits or [], opts),
                         async_op)
        else:
            work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=_pg(group),
                                          async_op=async_op)
    except RuntimeError as exc:
        raise_translated(exc, "all_to_all", group)
    return Pending(work, "all_to_all", group) if async_op else None


_P2P_TAG = 0x7470  # "tp": tensorpar's point-to-point messages


class _Works:
    """Several works waited on as one (a failure names the all-to-all)."""

    def __init__(self, works: list[Any], group: Group) -> None:
        self.works = works
        self.group = group
        self.seq = sequence_number(group)

    def wait(self) -> bool:
        try:
            for work in self.works:
                work.wait()
        except RuntimeError as exc:
            raise_translated(exc, "all_to_all (point to point)", self.group, self.seq)
        return True


def _p2p_all_to_all(out_parts: Sequence[torch.Tensor], in_parts: Sequence[torch.Tensor],
                    group: Group, handle: dist.ProcessGroup, async_op: bool) -> Work:
    """Uneven all-to-all as one send and one receive per peer, and a local copy of our part.

    Only peers with a non-empty part are messaged (both sides know every length).

    The process group's own ``send``/``recv`` (group ranks) are what ``dist.isend`` and
    ``dist.irecv`` call after their argument checks; the parts here are contiguous views of
    checked buffers, so the checks are skipped. The messages carry their own tag, so they
    never match a receive the caller has posted with torch's default tag (0).
    """
    n, rank = group.size, group.rank
    peers = [(rank + k) % n for k in range(1, n)]  # each rank starts with a different peer
    # every receive first: a sender's data can only leave once its receive is posted
    works = [handle.recv([out_parts[p]], p, _P2P_TAG) for p in peers if out_parts[p].numel()]
    works += [handle.send([in_parts[p]], p, _P2P_TAG) for p in peers if in_parts[p].numel()]
    out_parts[rank].copy_(in_parts[rank])  # while the transfers run
    pending = _Works(works, group)
    if async_op:
        return pending
    pending.wait()
    return None


def scatter(out: torch.Tensor, chunks: list[torch.Tensor] | None, src: int, group: Group) -> None:
    """Rank ``src`` (a group rank) sends ``chunks[r]`` to rank ``r``; equal sizes required."""
    if _ACTIVE:
        _record("scatter", group, chunks, "data")
    try:
        dist.scatter(out, chunks, src=group.global_rank(src), group=_pg(group))
    except RuntimeError as exc:
        raise_translated(exc, "scatter", group)


def gather(chunk: torch.Tensor, out: list[torch.Tensor] | None, dst: int, group: Group) -> None:
    """Rank ``dst`` (a group rank) receives every rank's ``chunk``; equal sizes required."""
    if _ACTIVE:
        _record("gather", group, [chunk], "data")
    try:
        dist.gather(chunk, out, dst=group.global_rank(dst), group=_pg(group))
    except RuntimeError as exc:
        raise_translated(exc, "gather", group)
