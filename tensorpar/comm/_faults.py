"""Turning a backend's raw failure inside a collective into an error that says what happened.

gloo reports a peer that never arrives as ``Timed out waiting 10000ms for recv operation``
and a peer that died as ``Connection reset by peer`` / ``Connection closed by peer``,
without naming the collective, the group or the rank. `raise_translated` re-raises such
errors as `CollectiveTimeoutError` / `PeerLostError` naming the collective, its sequence
number on the group and the group size; other errors go through unchanged.

Which ranks are missing is learned through the process group's store (the rendezvous
key-value store, which outlives a dead peer unless that peer hosted it): every rank that
fails a collective writes a key for it, waits briefly for the others' keys, and names the
ranks that wrote none. That costs nothing until a collective has failed.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

from tensorpar._torch import store_of
from tensorpar.comm._group import Group
from tensorpar.errors import CollectiveTimeoutError, PeerLostError

__all__ = ["Pending", "raise_translated", "sequence_number", "wait_translated"]

_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe",
         "connection refused", "socket closed", "no route to host")
_TIMED_OUT = ("timed out", "timeout")
PROBE_S = 2.0
"""How long a failed rank waits to hear which of its peers failed the same collective."""


def sequence_number(group: Group) -> int:
    """The number of collectives issued on ``group`` so far (the backend's count; -1: unknown).

    Every rank that issued the same collectives has the same count.
    """
    handle = group.ref() if group.ref is not None else None
    counter = getattr(handle, "_get_sequence_number_for_group", None)
    if counter is None:
        return -1
    try:
        return int(counter())
    except RuntimeError:
        return -1


def raise_translated(exc: RuntimeError, kind: str, group: Group, seq: int | None = None
                     ) -> NoReturn:
    """Re-raise a backend failure of collective ``kind`` as a tensorpar error, if it is one.

    ``seq`` is the collective's sequence number when known (an asynchronous collective's
    number at launch); otherwise the group's count now.
    """
    lost = _lost(exc)
    number = sequence_number(group) if seq is None else seq
    missing = _missing_ranks(group, kind, number)
    where = f"{kind} #{number}" if number >= 0 else kind
    _raise(exc, lost, f"{where} on a group of {group.size} (this rank is "
                      f"{_rank_in(group, group.rank)})",
           _ranks(missing, group) if missing else None, several=len(missing) > 1)


def raise_translated_peer(exc: RuntimeError, kind: str, group: Group, peer: int) -> NoReturn:
    """`raise_translated` for a point-to-point transfer ``kind`` with rank ``peer``.

    ``peer`` is a rank within ``group``: the one that went away or did not arrive.
    """
    lost = _lost(exc)
    other = _rank_in(group, peer)
    _raise(exc, lost, f"{kind} with rank {other} on a group of {group.size} (this rank is "
                      f"{_rank_in(group, group.rank)})", f"rank {other}")


def _lost(exc: RuntimeError) -> bool:
    """Whether ``exc`` says a peer went away (else it timed out); re-raises any other."""
    lowered = str(exc).lower()
    lost = any(s in lowered for s in _LOST)
    if not lost and not any(s in lowered for s in _TIMED_OUT):
        raise exc
    return lost


def _raise(exc: RuntimeError, lost: bool, head: str, missing: str | None,
           several: bool = False) -> NoReturn:
    """`PeerLostError` (``lost``) or `CollectiveTimeoutError` for ``exc``; ``missing``: who.

    ``several``: ``missing`` names more than one rank that did not report the failure. One
    of them went away, but which is unknown: a live rank still waiting inside the collective
    (its wait on another peer not failed yet) does not report either.
    """
    text = str(exc)
    raw = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if lost:
        who = (f"{missing} did not report failing it within {PROBE_S:g} s: at least one of "
               f"them went away (a rank still waiting inside the collective does not report)"
               if several else f"{missing} went away" if missing else "a peer went away")
        raise PeerLostError(
            f"{head}: {who}: its connection closed mid-collective (the process died, was "
            f"killed or exited). The process group cannot be used again; restart the job and "
            f"resume from a checkpoint. Backend: {raw}") from exc
    who = f"{missing} did not arrive" if missing else "a peer did not arrive"
    raise CollectiveTimeoutError(
        f"{head}: timed out: {who} within the process group's timeout (it skipped this "
        f"collective or issued a different one, is stuck, or died). Turn on "
        f"tensorpar.validation(True) to compare the ranks' collectives. Backend: {raw}"
    ) from exc


def _ranks(ranks: list[int], group: Group) -> str:
    """``"rank 2"`` or ``"ranks 0,2"`` (of a subgroup: ``"rank 1 (global rank 3)"``)."""
    return f"rank{'s' if len(ranks) > 1 else ''} " + ",".join(_rank_in(group, r) for r in ranks)


def _rank_in(group: Group, rank: int) -> str:
    """A rank of ``group``, with its global rank where the two differ."""
    try:
        global_rank = group.global_rank(rank)
    except (RuntimeError, ValueError):  # (not readable: the group's rank alone)
        return str(rank)
    return str(rank) if global_rank == rank else f"{rank} (global rank {global_rank})"


def _store(group: Group) -> Any:
    """The group's rendezvous store, or None (private torch API: best effort)."""
    try:
        handle = group.handle
        return None if handle is None else store_of(handle)
    except Exception:  # a torch without these internals: no diagnosis, still a clear error
        return None


def _missing_ranks(group: Group, kind: str, seq: int) -> list[int]:
    """The ranks that did not report failing this collective within `PROBE_S` (best effort)."""
    store = _store(group)
    if store is None or seq < 0:
        return []
    prefix = f"tensorpar/failed/{kind}/{seq}"
    try:
        store.set(f"{prefix}/{group.rank}", "1")
        keys = [f"{prefix}/{r}" for r in range(group.size)]
        deadline = time.monotonic() + PROBE_S
        while True:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.05)
    except Exception:  # the store is gone too (its host died): nothing more to learn
        return []


def wait_translated(future: Any, kind: str, group: Group) -> Any:
    """``future.wait()`` (a ``torch.futures.Future``, a comm hook's), its failure translated.

    torch wraps an error raised inside a future's callback in a ``RuntimeError`` that quotes
    it; the backend's words are still in the text, so `raise_translated` recognises them.
    """
    try:
        return future.wait()
    except RuntimeError as exc:
        raise_translated(exc, kind, group)


class Pending:
    """A backend work handle whose ``wait`` names the collective if it fails.

    ``peer``: the other rank of a point-to-point transfer (within ``group``), else ``None``.
    Everything else (``is_completed``, ``get_future``, ...) is the work's own.
    """

    __slots__ = ("group", "kind", "peer", "seq", "work")

    def __init__(self, work: Any, kind: str, group: Group, peer: int | None = None) -> None:
        self.work = work
        self.kind = kind
        self.group = group
        self.peer = peer
        self.seq = sequence_number(group) if peer is None else -1

    def wait(self, *args: Any) -> bool:
        try:
            return bool(self.work.wait(*args))
        except RuntimeError as exc:
            if self.peer is not None:
                raise_translated_peer(exc, self.kind, self.group, self.peer)
            raise_translated(exc, self.kind, self.group, self.seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)
