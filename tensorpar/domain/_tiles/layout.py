"""The per-forward layout of a domain-parallel model: every tile's size along each split dim.

At the model's entry one small all-gather per split dim tells every rank every tile's size
(`DomainContext.begin`). From then on each converted layer works out its output's split with
the same arithmetic on every rank, so no layer asks anyone for sizes again.

One rule keeps the tiles of different tensors compatible (a U-Net concatenates an encoder
tensor with an up-sampled one): within a forward, **a global length has one split**. The
first tensor of global length ``N`` along a split dim defines the split of ``N``; a later
layer whose output has ``N`` rows produces exactly those tiles (it fetches the input rows
the tiles need, wherever they are). A new length is split by ownership: output row ``o``
belongs to the rank that owns its *anchor*, the input row at the centre of its window
(rounded down), clamped to the domain. A stride-1 convolution with symmetric padding keeps
the split; a stride-2 one gives each rank the outputs centred on its rows.

In validation mode every layer exchanges its tile sizes instead and checks them against
the recorded splits (an unconverted call that changed the tiles raises on every rank), and
every halo exchange compares its fingerprint across the ranks.

A layer finds its input's split from its tile's local size. That is unique when, for every
rank, the splits recorded so far give that rank different sizes (the common case); when it
is not (an empty tile is 0 rows long in every split), the layer asks for the sizes (one
small all-gather). The decision depends only on the recorded splits, which every rank holds
identically, so every rank takes the same path.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from tensorpar._torch import current_graph_task_id, saved_tensors_hooks_active
from tensorpar.comm._comm import exchange_ints
from tensorpar.comm._group import Group
from tensorpar.domain._tiles.ahead import Ahead
from tensorpar.domain._tiles.marks import POOLED, TILE, Kind, Marks
from tensorpar.domain._tiles.rows import RowPlan, offsets, plan_rows
from tensorpar.errors import CollectiveArgumentError
from tensorpar.validation import validation_enabled

__all__ = ["DomainContext", "anchor_sizes"]


class DomainContext:
    """The domain of one converted model: split dims, their groups, this forward's splits.

    Args:
        dims: the split dims as the user gave them (negative: from the end).
        groups: one resolved group per split dim.
    """

    def __init__(self, dims: Sequence[int], groups: Sequence[Group]) -> None:
        self.user_dims = tuple(dims)
        self.dims = tuple(d for d in dims if d < 0)  # negative form; set again by `begin`
        self.groups = tuple(groups)
        self.layouts: list[dict[int, tuple[int, ...]]] = [{} for _ in dims]
        self.poolings = 0  # global poolings made this forward
        self.dense = False  # the running converted layer's input is not a tile: it runs as dense
        self.on_pooled = False  # ... and is pooled: its parameters give shares (`shares`)
        self.layer_weights: frozenset[int] = frozenset()  # ids of that layer's parameters
        self.ndim = 0  # the image input's number of dims (this forward)
        self.ran: set[int] = set()  # id(module) of the modules the last forward used
        self.owners: dict[int, set[int]] = {}  # id(parameter) -> id(module)s holding it
        self.active = False
        self.params: list[torch.Tensor] = []  # every hooked parameter, once, in order
        self.kept: dict[int, torch.Tensor] = {}  # parameter index -> partial gradient
        self.finish_queued = False
        self.handed_over = False  # a data-parallel reducer sums the gradients instead
        self.fast = True  # once-differentiable fast paths (overlapped convs, fused norms)
        self.fsdp = False  # fully_shard_domain: FSDP2's reduction sums over the domain
        self.internal = False  # a converted layer's own functional calls are running
        self.modes: list[Any] = []  # functional-call conversions entered by forwards
        self.marks = Marks()  # this forward's tiles and pooled features (`marks`)
        self.ahead = Ahead()  # halo rows sent with a norm's statistics (`ahead`)
        self._plans: dict[Any, RowPlan] = {}

    @contextlib.contextmanager
    def own_calls(self) -> Iterator[None]:
        """Tensorpar's own functional calls: the functional-call conversion lets them through."""
        before, self.internal = self.internal, True
        try:
            yield
        finally:
            self.internal = before

    def used(self, params: Iterable[torch.Tensor]) -> None:
        """Count the modules holding ``params`` as used in this forward.

        A module's forward marks it as used; this covers a parameter used without its
        module's forward (``nn.MultiheadAttention`` passes its ``out_proj``'s weight to the
        functional call), whose partial gradient would otherwise not be summed.
        """
        for p in params:
            self.ran.update(self.owners.get(id(p), ()))

    @property
    def reduced(self) -> bool:
        """Whether this forward has made a global pooling."""
        return self.poolings > 0

    def pooled(self, kind: Kind | None) -> bool:
        """Whether a tensor of this kind is pooled features (the layer taking it runs dense).

        Unmarked tensors (made from nothing in the forward) count as tiles before the
        forward's first global pooling and as pooled features after it.
        """
        return kind == POOLED or (kind is None and self.reduced)

    @property
    def strips(self) -> bool:
        """Strips over one group of several ranks, in a forward that may send rows ahead.

        A norm may then send the next convolution's halo rows with its statistics
        (`ahead`). Not in validation mode (it fingerprints each exchange as the layer's
        own), in inference mode (inference tensors have no version to tell an in-place
        change by) or under saved-tensor hooks (a checkpoint's recomputation must save
        what its forward saved, after later forwards learnt where rows could go).
        """
        return len(self.groups) == 1 and not self.groups[0].is_single and \
            not validation_enabled() and not torch.is_inference_mode_enabled() and \
            not saved_tensors_hooks_active()

    @property
    def domain_size(self) -> int:
        """The number of tiles (the product of the split dims' group sizes)."""
        size = 1
        for g in self.groups:
            size *= g.size
        return size

    # -- gradient sums (tensorpar.ddp._partial_sums.PartialSums) ----------------------------
    def sum_groups(self) -> tuple[Group, ...]:
        """The groups the parameters' partial gradients are summed over."""
        return self.groups

    def hand_over(self) -> None:
        """Leave the sums to a data-parallel reducer (see `_hook_parameters`)."""
        if self.handed_over:
            raise ValueError("parallelize_domain: the model's gradients are already summed by "
                             "another data-parallel reducer")
        self.handed_over = True

    # -- entry -----------------------------------------------------------------------------
    def begin(self, x: torch.Tensor, training: int = 0) -> None:
        """Start a forward: record every tile's size along each split dim of ``x``.

        The same exchange compares what must not differ between the ranks' tiles: their
        other dims, their dtype, ``training`` (the model's modules in training mode) and
        inference mode.
        A difference raises on every rank: the first exchange of rows would otherwise
        pair messages of other sizes (gloo aborts the process) or wait for a rank that
        raised. On a mesh the verdict of each dim's group goes on in the next one's
        exchange, then back over the groups before the last (one flag each), so every
        rank of the mesh takes it.
        """
        ndim = x.dim()
        dims = []
        for d in self.user_dims:
            nd = d - ndim if d >= 0 else d
            if not -ndim <= nd < 0:
                raise ValueError(f"parallelize_domain: split dim {d} is out of range for the "
                                 f"model's {ndim}-D input of shape {tuple(x.shape)}")
            dims.append(nd)
        self.dims = tuple(dims)
        self.ndim = ndim
        differ = False
        for i, (d, g) in enumerate(zip(self.dims, self.groups, strict=False)):
            n = x.shape[d]
            if g.is_single:
                sizes: tuple[int, ...] = (n,)
            else:
                # (the ranks of this dim's group share every other dim: on a mesh, also
                # the other split dims' sizes)
                other = tuple(x.shape[e] for e in range(ndim) if e - ndim != d)
                signature = [ndim, zlib.crc32(repr((other, str(x.dtype))).encode()), training,
                             int(torch.is_inference_mode_enabled()),
                             int(saved_tensors_hooks_active())]
                rows = exchange_ints(g, [n, int(differ), *signature], x.device)
                sizes = tuple(r[0] for r in rows)
                differ = differ or any(r[1] or r[2:] != signature for r in rows)
            self.layouts[i] = {sum(sizes): sizes}
        busy = [g for g in self.groups if not g.is_single]
        for g in busy[:-1]:  # a difference seen in a later group's exchange, back over the
            differ = any(r[0] for r in exchange_ints(g, [int(differ)], x.device))  # mesh
        if differ:
            raise CollectiveArgumentError(
                f"parallelize_domain: the ranks' tiles differ where they must not (the dims "
                f"their group does not split), in their dtype, in train/eval mode, in "
                f"inference mode or under activation checkpointing (saved-tensor hooks): "
                f"this rank has a {ndim}-D {x.dtype} tile of shape "
                f"{tuple(x.shape)}, {training} module(s) in training mode and inference mode "
                f"{'on' if torch.is_inference_mode_enabled() else 'off'}. Every rank's tile "
                f"is its slice of the same dense input, and every rank calls the model in "
                f"the same mode")
        self.poolings = 0
        self.marks.clear()
        self.marks.mark(x, TILE)
        self.ahead.clear()
        self.ran.clear()
        self.active = True

    # -- lookups ---------------------------------------------------------------------------
    def sizes_of(self, i: int, n: int, where: str, device: torch.device | None = None
                 ) -> tuple[int, ...]:
        """The split of the tensor whose tile has ``n`` rows along split dim ``i``."""
        if not self.active:
            if current_graph_task_id() != -1:  # (a recomputation in the backward pass)
                raise RuntimeError(
                    f"{where}: a domain-parallel layer ran in the backward pass, outside the "
                    f"model's forward: activation checkpointing inside a domain-parallel "
                    f"model (torch.utils.checkpoint) is not supported; checkpoint the whole "
                    f"converted model (checkpoint(model, tile)) or none of it")
            raise RuntimeError(f"{where}: a domain-parallel layer ran outside the forward of "
                               f"the model it was converted with (its entry records the "
                               f"tiles' sizes); call the converted model itself")
        table, g = self.layouts[i], self.groups[i]
        if validation_enabled() and not g.is_single:
            # ask every time, and decide from what every rank sees alike
            sizes = tuple(r[0] for r in exchange_ints(g, [n], device))
            if table.get(sum(sizes)) != sizes:
                raise RuntimeError(
                    f"{where}: the tiles have {list(sizes)} rows along dim {self.dims[i]}, "
                    f"which is no split of this forward ({sorted(table.values())}); a call "
                    f"that is not converted (a functional resize, pad or slice?) changed them")
            return sizes
        if self._unique(i):
            for sizes in table.values():
                if sizes[g.rank] == n:
                    return sizes
            known = sorted(s[g.rank] for s in table.values())
            raise RuntimeError(
                f"{where}: this rank's tile has {n} rows along dim {self.dims[i]}, which no "
                f"split of this forward gives it (known: {known}); a call that is not converted "
                f"(a functional resize or pad?) changed the tile")
        sizes = tuple(r[0] for r in exchange_ints(g, [n], device))
        known_sizes = table.setdefault(sum(sizes), sizes)
        if known_sizes != sizes:
            raise RuntimeError(f"{where}: tiles of {list(sizes)} rows along dim "
                               f"{self.dims[i]} do not match this forward's split of "
                               f"{sum(sizes)} rows, {list(known_sizes)}")
        return sizes

    def _unique(self, i: int) -> bool:
        splits = list(self.layouts[i].values())
        return all(len({s[q] for s in splits}) == len(splits)
                   for q in range(self.groups[i].size))

    def out_sizes(self, i: int, m: int, natural: Callable[[], tuple[int, ...]]
                  ) -> tuple[int, ...]:
        """The split of an output of ``m`` rows: the recorded one, else ``natural()``."""
        table = self.layouts[i]
        if m not in table:
            table[m] = natural()
        return table[m]

    def plan(self, sizes: Sequence[int], wants: Sequence[tuple[int, int]], rank: int,
             mode: str) -> RowPlan:
        """`plan_rows`, remembered (the same requests recur every forward)."""
        key = (tuple(sizes), tuple(wants), rank, mode)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 4096:
                self._plans.clear()
            plan = self._plans[key] = plan_rows(sizes, wants, rank, mode)
        return plan

    def owned(self, i: int, sizes: Sequence[int]) -> tuple[int, int]:
        """This rank's rows ``[start, end)`` in the split ``sizes`` of split dim ``i``."""
        r = self.groups[i].rank
        start = sum(sizes[:r])
        return start, start + sizes[r]


def anchor_sizes(sizes_in: Sequence[int], m: int, below: Callable[[int], int]
                 ) -> tuple[int, ...]:
    """Split ``m`` output rows by the owner of each row's anchor (see the module doc).

    ``below(b)`` counts the outputs whose anchor is before input row ``b`` (for
    ``0 < b < n``); outputs anchored before the domain go to the first tile that has rows,
    those anchored after it to the last.
    """
    off = offsets(sizes_in)
    n = off[-1]
    ends: list[int] = []
    for b in off[1:]:
        e = 0 if b <= 0 else m if b >= n else min(max(below(b), 0), m)
        ends.append(max(e, ends[-1]) if ends else e)
    return tuple(e - s for s, e in zip([0, *ends[:-1]], ends, strict=False))
