"""Exceptions raised by tensorpar.

Every error tensorpar raises on purpose derives from `TensorparError`, itself a
`RuntimeError`, so ``except RuntimeError`` keeps working for code written against
plain ``torch.distributed``. Errors about bad arguments also derive from ``ValueError`` or
``TypeError`` so they can be caught the usual way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = [
    "ClusterError",
    "CollectiveArgumentError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CollectiveTypeError",
    "PeerLostError",
    "PlaceholderError",
    "RankError",
    "RankTimeoutError",
    "ReducerError",
    "TensorparError",
    "UnresolvedCollectiveError",
    "WireFormatError",
]


class TensorparError(RuntimeError):
    """Base class of every error tensorpar raises on purpose."""


class PlaceholderError(TensorparError):
    """A `TensorPlaceholder` was used as data on a rank that holds none."""


class UnresolvedCollectiveError(TensorparError):
    """A `CollaborativeTensor` (the handle of an asynchronous collective) was used as data."""


class CollectiveArgumentError(TensorparError, ValueError):
    """The ranks of a collective disagree, or a rank passed a bad value.

    Raised on **every** rank of the collective with the same message, so that no rank is
    left waiting for a peer that gave up.
    """


class CollectiveTypeError(TensorparError, TypeError):
    """A rank passed an argument of the wrong kind (e.g. a tensor where a placeholder belongs).

    Like `CollectiveArgumentError`, raised on every rank when detected through the
    metadata exchange.
    """


class WireFormatError(TensorparError, ValueError):
    """A metadata header received from a peer is malformed or uses an unknown code."""


class ReducerError(TensorparError):
    """The data-parallel reducer was used in a way that would give wrong gradients or hang."""


class ClusterError(TensorparError):
    """A simulated cluster could not be built or its job did not finish.

    Raised by `tensorpar.testing.cluster` without root (or ``CAP_NET_ADMIN`` and
    ``CAP_SYS_ADMIN``), without iproute2's ``ip`` / ``tc``, when a network command fails, and
    when a job runs past its timeout.
    """


class RankError(TensorparError):
    """A rank of `tensorpar.testing.run_distributed` died or raised an unpicklable error."""


class RankTimeoutError(TensorparError, TimeoutError):
    """Ranks of `tensorpar.testing.run_distributed` did not finish within the timeout.

    The usual cause is a collective mismatch: a rank waits in a collective its peers skipped.
    """


class CollectiveTimeoutError(TensorparError, TimeoutError):
    """A collective did not complete: a peer did not arrive within the process group's timeout.

    The message names the collective, its sequence number on the group (the count of
    collectives issued on it, the same on every rank that issued the same ones), the group
    size, and, where the ranks could tell, which ranks did not arrive. The usual causes: a
    rank that skipped the collective or issued another one, a rank stuck in a long
    computation, a rank that died.
    """


class PeerLostError(CollectiveTimeoutError):
    """A peer's connection closed during a collective: that rank died or was stopped.

    The process group cannot be used again; a job restarts (e.g. ``torchrun``'s elastic
    restart) and resumes from its last checkpoint.
    """


class CollectiveMismatchError(CollectiveArgumentError):
    """The ranks issued different collectives, or the same one with different arguments.

    Raised on every rank by validation mode (`tensorpar.validation`), which compares a
    fingerprint of each collective across the ranks before it runs.
    """


def ranks_by_value(values: Sequence[object], show: Callable[[object], str] = str) -> str:
    """``"ranks 0,1,3 sum, rank 2 max"``: the ranks grouped by the value each one has."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(show(value), []).append(rank)
    return ", ".join(f"{'ranks' if len(ranks) > 1 else 'rank'} {','.join(map(str, ranks))} "
                     f"{text}" for text, ranks in groups.items())
