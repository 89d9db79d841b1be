"""Exceptions raised by tensorpar.

Every error tensorpar raises on purpose derives from `TensorparError`, itself a
`RuntimeError`, so ``except RuntimeError`` keeps working for code written against
plain ``torch.distributed``. Errors about bad arguments also derive from ``ValueError`` or
``TypeError`` so they can be caught the usual way.
"""

from __future__ import annotations

__all__ = [
    "CollectiveArgumentError",
    "CollectiveTypeError",
    "PlaceholderError",
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
