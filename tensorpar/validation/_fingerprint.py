"""Validation mode's fingerprint: its layout, and how differences between ranks are told.

A fingerprint is a fixed-size list of int64s that every rank all-gathers before a collective
(`tensorpar.validation.check` builds and exchanges it). This module knows where each field
lies and how to show it; it knows nothing about collectives or about who calls it.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from tensorpar.errors import CollectiveMismatchError, ranks_by_value
from tensorpar.placeholder import _DTYPE_TO_CODE, MAX_NDIM
from tensorpar.validation._callsite import SLOTS, sites_agree

__all__ = ["LAYOUT", "LENGTH", "MAGIC", "MAX_COUNTERS", "MAX_SIZES", "MODES", "NAME_SLOTS", "NONE",
           "NO_DIM", "OTHER", "REDUCE_OPS", "TEXT_SLOTS", "Counter", "compare", "pack", "put"]

REDUCE_OPS = ("sum", "mean", "max", "min")
MODES = ("sum", "identity")
MAX_SIZES = 16
MAX_COUNTERS = 4
NAME_SLOTS = 5  # the operation's name, 8 bytes a slot
TEXT_SLOTS = 8  # the call site's text
MAGIC = 0x7470_5600  # "tpV"
NONE = -1
OTHER = -2  # a value the fingerprint has no code for (the call raises on every rank later)
NO_DIM = -1000
# (name, slots), in the order the fingerprint holds them and differences are reported
LAYOUT = (("magic", 1), ("operation", NAME_SLOTS), ("forward/backward", 1), ("op", 1),
           ("backward mode", 1), ("dtype", 1), ("dim", 2), ("shape", 1 + MAX_NDIM),
           ("chunk lengths", 2 + MAX_SIZES), ("this rank's chunk against sizes", 1),
           ("requires_grad", 1), ("src/dst", 1), ("counters", 1 + MAX_COUNTERS),
           ("input values", 2), ("call site", SLOTS + 1 + TEXT_SLOTS),
           ("sequence number", 1))
WIDTH = dict(LAYOUT)
START = {name: sum(width for _, width in LAYOUT[:i]) for i, (name, _) in enumerate(LAYOUT)}
LENGTH = sum(WIDTH.values())

Counter = tuple[str, int, str]
"""A caller's counter: its name in messages, its value, and a hint shown when it differs."""

def pack(text: str, slots: int) -> list[int]:
    raw = text.encode()[: 8 * slots].ljust(8 * slots, b"\0")
    return [int.from_bytes(raw[8 * i: 8 * i + 8], "little", signed=True) for i in range(slots)]


def unpack(values: Sequence[int]) -> str:
    raw = b"".join(v.to_bytes(8, "little", signed=True) for v in values)
    return raw.rstrip(b"\0").decode(errors="replace")




# -- comparing and reporting --------------------------------------------------------------

def put(fp: list[int], name: str, values: Sequence[int]) -> None:
    """Write ``values`` into the field ``name`` of the fingerprint ``fp``."""
    start = START[name]
    fp[start: start + len(values)] = values


def compare(operation: str, size: int, every: list[list[int]], counters: Sequence[Counter],
            label: str) -> None:
    """Raise the same `CollectiveMismatchError` on every rank if the fingerprints differ.

    ``every``: every rank's fingerprint, in rank order; ``counters``: this rank's, for
    their names and hints; ``label``: what the call is part of.
    """
    first = every[0]
    if all(row == first for row in every):
        return
    if any(row[0] != MAGIC for row in every):
        raise CollectiveMismatchError(
            f"{operation} on a group of {size}: validation mode is on on some ranks only: "
            + ranks_by_value(["on" if row[0] == MAGIC else "off" for row in every])
            + "; switch it alike on every rank")
    counts = [row[-1] for row in every]
    name = unpack(slots(first, "operation"))
    where = f" ({label})" if label else ""
    head = f"{name} #{counts[0]}{where}" if len(set(counts)) == 1 else \
        f"{name} (#{counts[0]} on rank 0){where}"
    head += f" on a group of {size}"
    backward = all(row[START["forward/backward"]] == 1 for row in every)
    for field_name, _ in LAYOUT[1:]:
        values = [tuple(slots(row, field_name)) for row in every]
        if field_name == "call site":
            if not all(sites_agree(v[:SLOTS], values[0][:SLOTS]) for v in values):
                sites = [_show_site(v, backward) for v in values]
                raise CollectiveMismatchError(
                    f"{head}: call site differs: {ranks_by_value(sites)} (a rank skipped a "
                    f"collective or issued another one; ranks may call from different lines "
                    f"only in different arms of one if/elif/else)")
            continue
        if len(set(values)) == 1:
            continue
        if field_name == "counters":
            _compare_counters(head, values, counters)
        shown = ranks_by_value([_show(field_name, v) for v in values])
        verb = "differ" if field_name.endswith("values") else "differs"
        raise CollectiveMismatchError(
            f"{head}: {field_name} {verb}: {shown}{_HINTS.get(field_name, '')}")


def _compare_counters(head: str, values: list[tuple[int, ...]],
                      counters: Sequence[Counter]) -> None:
    if len({v[0] for v in values}) > 1 or not counters:
        return  # other counters: the generic message says so
    for i, (name, _, hint) in enumerate(counters[:MAX_COUNTERS]):
        column = [v[1 + i] for v in values]
        if len(set(column)) > 1:
            raise CollectiveMismatchError(
                f"{head}: {name} differs: {ranks_by_value(column)}"
                + (f" ({hint})" if hint else ""))


def slots(row: list[int], name: str) -> list[int]:
    start = START[name]
    return row[start: start + WIDTH[name]]


_HINTS = {
    "operation": " (a rank skipped a collective or issued another one)",
    "sequence number": " (a rank skipped or added a collective earlier)",
    "input values": " (an input every rank of a tensor-parallel group must hold alike is not "
                    "the same: give every rank of the group the same batch, and the same "
                    "random state for dropout before the region)",
    "requires_grad": " (a collective without a metadata exchange (all_reduce, reduce_scatter, "
                     "sizes=, exchange_meta=False) cannot tell the ranks: every rank's tensor "
                     "or placeholder must require grad, or none, or the backward hangs)",
    "this rank's chunk against sizes": " (a chunk's length along dim must be sizes[rank])",
}


def _show_site(value: tuple[int, ...], backward: bool) -> str:
    if value[0] == NONE:
        return "no call site"
    text, calls = unpack(value[SLOTS + 1:]), value[SLOTS]
    if backward:
        return f"the backward of {text} (backward {calls} there)"
    return f"{text} (call {calls} there)"


def _show(name: str, value: tuple[int, ...]) -> str:
    v = value[0]
    if name == "operation":
        return f'"{unpack(value)}"'
    if name == "forward/backward":
        return "backward" if v else "forward"
    if name in ("op", "backward mode"):
        names = REDUCE_OPS if name == "op" else MODES
        return f'"{names[v]}"' if 0 <= v < len(names) else ("none" if v == NONE else "other")
    if name == "dtype":
        return next((str(d).removeprefix("torch.") for d, c in _DTYPE_TO_CODE.items()
                     if c == v), "none")
    if name == "dim":  # (split_dim, concat_dim) for all_to_all
        shown = [str(d) for d in value if d != NO_DIM]
        return ("dim=" + ",".join(shown)) if shown else "no dim"
    if name == "src/dst":
        return "no src/dst" if v == NONE else f"src/dst={v}"
    if name == "shape":
        return "none" if v == NONE else "[" + ", ".join(
            "*" if d == NONE else str(d) for d in value[1: 1 + v]) + "]"
    if name == "chunk lengths":
        return "none" if v == NONE else str(list(value[2: 2 + min(v, MAX_SIZES)]))
    if name == "this rank's chunk against sizes":
        return "as in sizes" if v == 0 else f"{v:+d} along dim"
    if name == "requires_grad":
        return "none" if v == NONE else str(bool(v))
    if name == "input values":
        raw = b"".join(x.to_bytes(8, "little", signed=True) for x in value)
        return f"checksum {zlib.crc32(raw):08x}"
    if name == "counters":
        return " ".join(str(x) for x in value[1:] if x != NONE) or "none"
    return "none" if v == NONE else str(v)


