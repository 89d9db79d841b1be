"""Expert parallelism: a transformers experts module with its experts spread over the ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from tensorpar.comm._compiling import compiling
from tensorpar.comm._group import GroupLike
from tensorpar.nn._expert_route import (
    exchange_counts,
    exchange_rows,
    gather_sum,
    grouped_linear,
    sum_grads_over_ranks,
)
from tensorpar.nn.layers.linear import ShardedLayer
from tensorpar.nn.state._shards import shard_of
from tensorpar.nn.state.replica_check import mark_sharded_layer
from tensorpar.validation import check, checksum

__all__ = ["ExpertParallel", "ParallelExperts", "experts_problem"]

Tokens = Literal["replicated", "local"]
_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
_BIASES = ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
_NONE_BAD, _BAD_INDEX = 0, 1


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _run_experts_eagerly(layer: ParallelExperts, hidden_states: torch.Tensor,
                         top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """``layer``'s forward outside the compiled graph (dynamo breaks the graph around it)."""
    out: torch.Tensor = layer(hidden_states, top_k_index, top_k_weights)
    return out


@dataclass(frozen=True)
class ExpertParallel:
    """Spread a transformers experts module's experts over the ranks (`ParallelExperts`).

    Attributes:
        tokens: ``"replicated"``: every rank holds every token and the same routing (the
            input of a tensor-parallel block); nothing is dispatched, each rank's experts
            take their rows locally and one all-to-all sends the rank's per-token sums to
            every peer. ``"local"``: every rank holds its own tokens (a sequence- or
            data-parallel input); each dispatches all of them and keeps its own outputs.
    """

    tokens: Tokens = "replicated"


class ParallelExperts(ShardedLayer):
    """A stacked-experts module whose experts live on their own ranks, tokens moved to them.

    Each rank holds a contiguous block of the experts (balanced like
    ``torch.tensor_split``: 8 experts on 3 ranks are 3/3/2) and computes only them. A
    forward pass sorts this rank's token-expert pairs by expert, exchanges the per-expert
    counts once (one small all-gather of ints: every split size of the layer, forward and
    backward, comes from it), sends every pair's row to the rank of its expert with one
    uneven all-to-all, runs the local experts grouped (``torch.nn.functional.grouped_mm``
    where it takes the dtype, else one matmul per local expert), sends the results back
    with the mirrored all-to-all and sums them with the routing weights. Nothing is
    dropped or padded: an expert, or a whole rank, may receive no row. Backward mirrors
    the two all-to-alls. Expert gradients are the dense ones (each pair is computed once,
    on one rank), never scaled by the number of ranks.

    With ``tokens="replicated"`` (every rank holds the same tokens and routing) nothing
    is dispatched: each rank's experts take their pairs from the tokens at hand, the
    count exchange checks that the routing is the same on every rank, and one uneven
    all-to-all sends the rank's per-token partial sums to every peer, which add them
    rank by rank (the same bits on every rank). Backward: one all-to-all of the
    gradient rows of the tokens and of the routing weights.

    Called like the module it replaces: ``experts(hidden_states, top_k_index,
    top_k_weights)``.

    Args:
        experts: the dense experts module (transformers' stacked ``gate_up_proj``
            ``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)``, or ``up_proj`` without a gate;
            biases and the transposed layout as its ``has_bias``/``is_transposed`` say).
            Every rank passes the same one.
        group: the expert-parallel group (``None``: the default group).
        tokens: ``"replicated"`` (every rank holds the same tokens, e.g. inside a
            tensor-parallel model) or ``"local"`` (each rank its own); see
            `ExpertParallel`.

    Raises:
        ValueError: a module with a layout this layer does not know (a custom gate, a
            post-expert norm), or an unknown ``tokens``; in forward, an expert id out of
            range or (replicated tokens) a routing that differs between ranks, raised on
            every rank.

    Shape:
        ``hidden_states``: ``(T, H)``; ``top_k_index``, ``top_k_weights``: ``(T, K)``;
        output: ``(T, H)``.

    Example:
        >>> import torch
        >>> from transformers import MixtralConfig
        >>> from transformers.models.mixtral.modeling_mixtral import MixtralExperts
        >>> config = MixtralConfig(hidden_size=8, intermediate_size=16, num_local_experts=4)
        >>> dense = MixtralExperts(config)
        >>> _ = torch.nn.init.normal_(dense.gate_up_proj), torch.nn.init.normal_(dense.down_proj)
        >>> layer = ParallelExperts(dense)   # one rank: every expert
        >>> x, index = torch.randn(5, 8), torch.randint(0, 4, (5, 2))
        >>> weights = torch.rand(5, 2)
        >>> torch.allclose(layer(x, index, weights), dense(x, index, weights), atol=1e-5)
        True
    """

    sharded_dims: ClassVar[dict[str, int]] = {name: 0 for name in _WEIGHTS + _BIASES}

    def __init__(self, experts: nn.Module, *, group: GroupLike = None,
                 tokens: Tokens = "replicated") -> None:
        super().__init__()
        fn = "ParallelExperts"
        if tokens not in ("replicated", "local"):
            raise ValueError(f"{fn}: tokens={tokens!r}; expected 'replicated' or 'local'")
        self.has_gate = bool(getattr(experts, "has_gate", True))
        self.has_bias = bool(getattr(experts, "has_bias", False))
        self.is_transposed = bool(getattr(experts, "is_transposed", False))
        problem = _layout_problem(experts)
        if problem:
            raise ValueError(f"{fn}: {problem}")
        first = "gate_up_proj" if self.has_gate else "up_proj"
        weight = getattr(experts, first)
        self.num_experts = int(weight.shape[0])
        self.tokens = tokens
        self.shard = shard_of(fn, self.num_experts, group)
        self.act_fn = experts.act_fn
        leaves = [first, "down_proj"] + ([first + "_bias", "down_proj_bias"]
                                         if self.has_bias else [])
        with torch.no_grad():
            for leaf in leaves:
                dense = getattr(experts, leaf)
                local = self.shard.take(dense.detach(), 0).clone()
                self.register_parameter(leaf, nn.Parameter(local,
                                                           requires_grad=dense.requires_grad))
        if not self.shard.group.is_single:
            mark_sharded_layer(self, leaves)

    @classmethod
    def from_dense(cls, experts: nn.Module, *, group: GroupLike = None,
                   tokens: Tokens = "replicated") -> ParallelExperts:
        """This rank's experts of ``experts`` (every rank passes the same dense module)."""
        return cls(experts, group=group, tokens=tokens)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for every token, as the dense module computes it.

        Under ``torch.compile`` the layer runs eagerly, one graph break per call: the split
        sizes of its all-to-alls are the routing's counts, known only once they are exchanged.
        """
        if compiling():
            out: torch.Tensor = _run_experts_eagerly(self, hidden_states, top_k_index,
                                                     top_k_weights)
            return out
        g = self.shard.group
        if self.tokens == "local" or g.is_single:
            return self._dispatch(hidden_states, top_k_index, top_k_weights)
        return self._replicated(hidden_states, top_k_index, top_k_weights)

    def _replicated(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
                    ) -> torch.Tensor:
        """Every rank holds every token: no dispatch, one all-to-all to make it whole.

        This rank's experts take their rows from the tokens it holds; its per-token partial
        sums go to every peer in one all-to-all (`gather_sum`).
        """
        g, n_experts = self.shard.group, self.num_experts
        total, k = index.shape[0], index.shape[-1]
        # validation mode: the routing and the tokens must be the same on every rank
        for what, t in (("top_k_index", index), ("hidden_states", x)):
            check("ParallelExperts", g, dtype=t.dtype, shape=t.shape, values=t,
                  label=f"the replicated {what} of ParallelExperts")
        flat = index.reshape(-1)
        valid = (flat >= 0) & (flat < n_experts)
        counts = torch.bincount(torch.where(valid, flat, n_experts), minlength=n_experts + 1)
        owner = torch.repeat_interleave(torch.arange(g.size, device=flat.device),
                                        torch.tensor(self.shard.sizes, device=flat.device))
        pair_owner = owner[flat.clamp(0, n_experts - 1)]
        touched = torch.zeros(g.size, total, dtype=torch.bool, device=flat.device)
        touched[pair_owner[valid], torch.div(torch.arange(flat.numel(), device=flat.device),
                                             k, rounding_mode="floor")[valid]] = True
        # one small exchange: every rank must hold the same routing, or the split sizes
        # below would differ between ranks; all raise together if not
        # (and a checksum of the routing: other tokens for the same counts)
        table = exchange_counts(torch.cat([counts, touched.sum(1), torch.tensor(
            checksum(index), device=flat.device)]), g)
        _check_replicated_table(table, n_experts)
        starts = _starts(self.shard.sizes)
        lo, hi = starts[g.rank], starts[g.rank + 1]
        below = table[0][:lo]
        order = torch.argsort(flat, stable=True)  # pairs sorted by expert
        sel = order[sum(below):sum(below) + sum(table[0][lo:hi])]  # this rank's experts' pairs
        token = torch.div(sel, k, rounding_mode="floor")
        tokens = tuple(row.nonzero().squeeze(1) for row in touched)  # ascending, per rank
        mine = tokens[g.rank]
        where = torch.full((total,), -1, dtype=torch.long, device=flat.device)
        where[mine] = torch.arange(mine.numel(), device=flat.device)
        x, weights = sum_grads_over_ranks(x, weights, tokens, g)
        out_rows = self._experts(x.index_select(0, token), table[0][lo:hi])
        pair_weights = weights.reshape(-1).index_select(0, sel)
        weighted = (out_rows * pair_weights.unsqueeze(-1)).to(x.dtype)
        # this rank's experts' sum for each token it touched, pair by pair in expert order
        partial = x.new_zeros((mine.numel(), x.shape[-1])).index_add(0, where[token], weighted)
        return gather_sum([partial], tokens, total, g)[0]

    def _dispatch(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
                  ) -> torch.Tensor:
        """This rank's tokens through their experts, wherever those live."""
        g, n_experts = self.shard.group, self.num_experts
        k = index.shape[-1]
        flat = index.reshape(-1)
        valid = (flat >= 0) & (flat < n_experts)
        counts = torch.bincount(torch.where(valid, flat, n_experts), minlength=n_experts + 1)
        order = torch.argsort(flat, stable=True)  # pairs sorted by expert
        token = order // k
        rows = x.index_select(0, token)  # (S, H)
        table = [counts.tolist()] if g.is_single else exchange_counts(counts, g)
        bad = [r for r, row in enumerate(table) if row[n_experts] != _NONE_BAD]
        if bad:  # every rank sees every rank's count of bad indices: all raise together
            raise ValueError(f"ParallelExperts: top_k_index holds expert ids outside [0, "
                             f"{n_experts}) on rank(s) {bad}: "
                             + ", ".join(f"rank {r}: {table[r][n_experts]} of them"
                                         for r in bad))
        out_rows = self._route(rows, table)
        pair_weights = weights.reshape(-1).index_select(0, order)
        weighted = (out_rows * pair_weights.unsqueeze(-1)).to(x.dtype)
        # summed pair by pair in expert order, as the dense module adds them
        return torch.zeros_like(x).index_add(0, token, weighted)

    def _route(self, rows: torch.Tensor, table: list[list[int]]) -> torch.Tensor:
        """Rows sorted by expert (this rank's pairs) -> the experts' outputs, same order."""
        g, starts = self.shard.group, _starts(self.shard.sizes)
        lo, hi = starts[g.rank], starts[g.rank + 1]
        if g.is_single:
            return self._experts(rows, table[0][lo:hi])
        send = tuple(sum(table[g.rank][starts[r]:starts[r + 1]]) for r in range(g.size))
        blocks = [row[lo:hi] for row in table]  # (source rank, local expert) counts
        recv = tuple(sum(b) for b in blocks)
        arrived = exchange_rows(rows, send, recv, g)  # source by source, experts sorted within
        per_expert = [sum(b[e] for b in blocks) for e in range(hi - lo)]
        perm = None
        if hi - lo > 1 and sum(1 for n in recv if n) > 1:  # regroup expert by expert
            ids = torch.arange(hi - lo).repeat(g.size)
            lengths = torch.tensor([n for b in blocks for n in b])
            perm = torch.argsort(torch.repeat_interleave(ids, lengths), stable=True
                                 ).to(rows.device)
            arrived = arrived.index_select(0, perm)
        done = self._experts(arrived, per_expert)
        if perm is not None:  # back to source by source
            done = done.index_select(0, torch.argsort(perm))
        return exchange_rows(done, recv, send, g)

    def _experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on rows grouped by local expert (``counts`` rows each)."""
        first = "gate_up_proj" if self.has_gate else "up_proj"
        w1, w2 = self._param(first), self._param("down_proj")
        b1 = self._param(first + "_bias") if self.has_bias else None
        b2 = self._param("down_proj_bias") if self.has_bias else None
        act = self.act_fn
        assert callable(act)
        h = grouped_linear(x, w1, counts, b1, self.is_transposed)
        if self.has_gate:
            gate, up = h.chunk(2, dim=-1)
            h = act(gate) * up
        else:
            h = act(h)
        return grouped_linear(h, w2, counts, b2, self.is_transposed)

    def _param(self, leaf: str) -> torch.Tensor:
        value = getattr(self, leaf)
        assert isinstance(value, torch.Tensor)
        return value

    def extra_repr(self) -> str:
        """The expert count, with this rank's block."""
        start, n = _starts(self.shard.sizes)[self.shard.group.rank], self.shard.length
        return (f"num_experts={self.num_experts} (this rank: {n} from {start}), "
                f"tokens={self.tokens!r}")


def experts_problem(name: str, module: nn.Module) -> str | None:
    """Why ``module`` (named ``name`` in its model) cannot be split by expert, or ``None``."""
    problem = _layout_problem(module)
    return f"{name!r}: {problem} (style ExpertParallel)" if problem else None


def _layout_problem(experts: nn.Module) -> str | None:
    cls = type(experts)
    has_gate = bool(getattr(experts, "has_gate", True))
    problems = []
    names = ("gate_up_proj" if has_gate else "up_proj", "down_proj")
    if not all(getattr(getattr(experts, n, None), "ndim", 0) == 3 for n in names):
        problems.append(f"stacked (3-D) {names[0]} and {names[1]} parameters")
    elif (counts := [getattr(experts, n).shape[0] for n in names])[0] != counts[1]:
        problems.append(f"as many experts in {names[0]} as in {names[1]} (not "
                        f"{counts[0]} experts in {names[0]}, {counts[1]} in {names[1]})")
    if getattr(experts, "has_post_expert_norm", False):
        problems.append("no post-expert norm")
    if not getattr(experts, "is_concatenated", True):
        problems.append("a concatenated [gate; up] (not interleaved)")
    gate = getattr(cls, "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
        problems.append(f"the default gate (act(gate) * up), not {cls.__name__}._apply_gate")
    if not callable(getattr(experts, "act_fn", None)):
        problems.append("an act_fn")
    if not problems:
        return None
    return f"{cls.__name__} cannot be split by expert: expected " + ", ".join(problems)


def _check_replicated_table(table: list[list[int]], n_experts: int) -> None:
    """Raise (on every rank: each sees the same table) on a bad or non-replicated routing."""
    fn = "ParallelExperts(tokens='replicated')"
    if any(row != table[0] for row in table):
        differ = [r for r, row in enumerate(table) if row != table[0]]
        raise ValueError(f"{fn}: the routing (top_k_index) differs between ranks: rank(s) "
                         f"{differ} route other tokens to the experts than rank 0; expected the "
                         f"same tokens and routing on every rank (else use tokens='local')")
    if table[0][n_experts] != _NONE_BAD:
        raise ValueError(f"{fn}: top_k_index holds {table[0][n_experts]} expert id(s) outside "
                         f"[0, {n_experts}) on every rank")


def _starts(sizes: tuple[int, ...]) -> list[int]:
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out
