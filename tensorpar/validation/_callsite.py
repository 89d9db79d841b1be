"""Where a collective is called from: the call site validation mode compares across ranks.

A rank that skips a collective meets its peers at its *next* call, often one of the same
kind and shape (the same fingerprint otherwise), so the call site is part of the
fingerprint: the first two frames outside tensorpar and torch (the user's line and its
caller). Two ranks are at the same call site when both frames are the same lines, with
one exception, for programs where ranks legitimately reach a collective from different
lines: ranks in *different arms of one* ``if``/``elif``/``else`` *chain* agree, whether
that chain holds the call itself::

    if rank == 0:
        y = scatter(x, src=0)          # rank 0 here ...
    else:
        y = scatter(placeholder, src=0)  # ... and the others here: they agree

or the call of a helper (the caller's frame is in the chain: ``send()`` on rank 0,
``receive()`` elsewhere); ranks in different functions called from the same line agree too
(``send() if rank == 0 else receive()``). A rank that skipped a call, by contrast, is at
another line of the same function, or of its caller, that no arm of one chain explains, and
every rank raises. Ranks that reach one collective from two separate ``if`` statements
(``if rank == 0: ...`` then ``if rank != 0: ...``) are not told apart from a skip: write
such a call once (``scatter(x if rank == 0 else None, src=0)``) or in the arms of one
``if``/``else``.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import sys
import zlib
from collections.abc import Sequence
from types import CodeType, FrameType
from typing import NamedTuple

import torch

__all__ = ["SLOTS", "Site", "call_site", "sites_agree"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tensorpar/
_LIBRARIES = tuple(os.path.dirname(os.path.abspath(path)) + os.sep
                   for path in (_PACKAGE + os.sep + "__init__.py", torch.__file__))
_SELF_CHECKED = frozenset(os.path.join(_LIBRARIES[0], "ddp", name)
                          for name in ("reducer.py", "_sync.py"))
"""The modules whose collectives carry no call site (see `call_site`)."""
_NONE = -1
SLOTS = 7
"""Integers a site takes in the fingerprint: for the user's frame and its caller, the line,
and the ``if`` chain and arm it lies in (``-1``: none); then the user's frame's function."""


class Site(NamedTuple):
    """A call site: its fingerprint slots, the key its calls are counted under, its text."""

    slots: tuple[int, ...]
    count_key: int
    text: str


def call_site() -> Site | None:
    """The call site of the collective being called.

    ``None`` where there is no frame outside tensorpar and torch, and for the collectives the
    data-parallel reducer issues: it launches them from gradient hooks and, under ``Join``,
    from a rank that has run out of inputs, so their sites differ across correct ranks; the
    reducer fingerprints its own iteration, bucket and forward counts instead.
    """
    frame: FrameType | None = sys._getframe(1)
    places: list[tuple[CodeType, int]] = []
    while frame is not None and len(places) < 2:
        filename = frame.f_code.co_filename
        if not filename.startswith(_LIBRARIES):
            places.append((frame.f_code, frame.f_lineno))
        elif not places and filename in _SELF_CHECKED:
            return None
        frame = frame.f_back
    return _site(*places) if places else None


@functools.lru_cache(maxsize=4096)
def _site(*places: tuple[CodeType, int]) -> Site:
    """The `Site` of the user's frame and its caller, each a code object and a line."""
    slots: list[int] = []
    merged = []
    for code, line in places:
        name = f"{os.path.basename(code.co_filename)}:{getattr(code, 'co_qualname', code.co_name)}"
        arm = _branch_arms(code.co_filename).get(line)
        head = _NONE if arm is None else _key(f"{name}:if{arm[0]}")
        slots += [_key(f"{name}:{line}"), head, _NONE if arm is None else arm[1]]
        merged.append(slots[-3] if arm is None else head)
    slots += [_NONE] * (SLOTS - 1 - len(slots))
    first, line = places[0]
    slots.append(_key(f"{os.path.basename(first.co_filename)}:{first.co_firstlineno}"))
    # counted where the ranks agree: the outermost chain they may diverge in
    count_key = slots[4] if slots[4] != _NONE else _key(repr(merged))
    text = (f"{os.path.basename(first.co_filename)}:{line} in "
            f"{getattr(first, 'co_qualname', first.co_name)}")
    return Site(tuple(slots), count_key, text)


def sites_agree(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether two ranks' site slots (`Site.slots`) are the same call site (see above)."""
    if tuple(a) == tuple(b):
        return True
    _, head0, arm0, line1, head1, arm1, function = a
    _, ohead0, oarm0, other1, ohead1, oarm1, ofunction = b
    if head1 != _NONE and head1 == ohead1 and arm1 != oarm1:  # different arms, caller's frame
        return True
    if line1 != other1:
        return False
    return function != ofunction or (head0 != _NONE and head0 == ohead0 and arm0 != oarm0)


def _key(text: str) -> int:
    return zlib.crc32(text.encode())


@functools.lru_cache(maxsize=256)
def _branch_arms(filename: str) -> dict[int, tuple[int, int]]:
    """Every line of ``filename`` in an arm of an ``if`` chain with more than one arm.

    Maps the line to the chain's first line and the arm's index (0 for the ``if``, then one
    per ``elif``, then the ``else``); a line in nested chains gets the innermost one.
    Empty where the source cannot be read or parsed.
    """
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return {}
    arms: dict[int, tuple[int, int]] = {}
    _visit(tree, arms)
    return arms


def _visit(node: ast.AST, arms: dict[int, tuple[int, int]]) -> None:
    if isinstance(node, ast.If) and node.orelse:
        chain: list[list[ast.stmt]] = []
        link: ast.If = node
        while True:  # an elif is an If alone in its parent's else
            chain.append(link.body)
            rest = link.orelse
            if len(rest) == 1 and isinstance(rest[0], ast.If):
                link = rest[0]
                continue
            if rest:
                chain.append(rest)
            break
        for index, body in enumerate(chain):
            for stmt in body:
                for line in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1):
                    arms[line] = (node.lineno, index)
        for body in chain:  # nested chains mark their own lines after, so the innermost wins
            for stmt in body:
                _visit(stmt, arms)
        return
    for child in ast.iter_child_nodes(node):
        _visit(child, arms)
