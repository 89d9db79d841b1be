"""ParallelExperts: experts spread over the ranks equal the dense experts module."""

import itertools

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar.nn import ParallelExperts
from tensorpar.testing import run_distributed

pytest.importorskip("transformers")

E, H, INTER, K = 8, 16, 12, 2
T = 240  # seconds per multi-rank call (transformers' import on a loaded machine)


def _dense(dtype=torch.float64, bias=False, transposed=False):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E,
                           experts_implementation="eager")
    torch.manual_seed(0)
    dense = MixtralExperts(config)
    if bias or transposed:  # a gpt-oss-like layout, through the same dense forward
        dense = _BiasedExperts(dense, bias, transposed)
    for p in dense.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return dense.to(dtype)


class _BiasedExperts(torch.nn.Module):
    """A reference experts module with biases and/or the transposed layout."""

    def __init__(self, base, bias, transposed):
        super().__init__()
        self.has_gate, self.has_bias, self.is_transposed = True, bias, transposed
        self.act_fn = base.act_fn
        shape = (lambda w: w.transpose(1, 2)) if transposed else (lambda w: w)
        self.gate_up_proj = torch.nn.Parameter(shape(base.gate_up_proj.detach()).clone())
        self.down_proj = torch.nn.Parameter(shape(base.down_proj.detach()).clone())
        if bias:
            self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(E, 2 * INTER))
            self.down_proj_bias = torch.nn.Parameter(torch.zeros(E, H))

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        for e in range(E):
            pos, tok = torch.where(e == index.T)
            w1 = self.gate_up_proj[e].T if self.is_transposed else self.gate_up_proj[e]
            w2 = self.down_proj[e].T if self.is_transposed else self.down_proj[e]
            h = torch.nn.functional.linear(x[tok], w1,
                                           self.gate_up_proj_bias[e] if self.has_bias else None)
            gate, up = h.chunk(2, dim=-1)
            y = torch.nn.functional.linear(self.act_fn(gate) * up, w2,
                                           self.down_proj_bias[e] if self.has_bias else None)
            out = out.index_add(0, tok, (y * weights[tok, pos, None]).to(x.dtype))
        return out


def _routing(kind, tokens, seed, k=K):
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    elif kind == "one_expert":  # every pair to expert 5 (and a second choice, expert 5 too)
        index = torch.full((tokens, k), 5)
    elif kind == "skip_last_rank":  # no token for the last rank's experts
        index = torch.randint(0, 4, (tokens, k), generator=g)
    else:
        raise AssertionError(kind)
    weights = torch.rand(tokens, k, generator=g, dtype=torch.float32)
    return index, weights


def _layer_vs_dense(tokens, routing, dtype_name, mode, bias=False, transposed=False, k=K,
                    weights_grad=True):
    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    dense = _dense(dtype, bias, transposed)
    layer = ParallelExperts.from_dense(_dense(dtype, bias, transposed), tokens=mode)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else \
        {"rtol": 1e-5, "atol": 1e-5}
    # the dense reference sees every rank's tokens (local mode: each rank has its own)
    n_ranks = world if mode == "local" else 1
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(tokens, H, generator=gen, dtype=dtype) for _ in range(n_ranks)]
    routes = [_routing(routing, tokens, seed, k) for seed in range(n_ranks)]
    grad_outs = [torch.randn(tokens, H, generator=gen, dtype=dtype) for _ in range(n_ranks)]
    me = rank if mode == "local" else 0
    x = xs[me].clone().requires_grad_()
    weights = routes[me][1].clone().requires_grad_(weights_grad)
    out = layer(x, routes[me][0], weights)
    out.backward(grad_outs[me])
    dense_x = [t.clone().requires_grad_() for t in xs]
    dense_w = [r[1].clone().requires_grad_() for r in routes]
    for t, r, w, go in zip(dense_x, routes, dense_w, grad_outs, strict=True):
        dense_out = dense(t, r[0], w)
        dense_out.backward(go)
        if t is dense_x[me]:
            torch.testing.assert_close(out, dense_out, **tol)
    torch.testing.assert_close(x.grad, dense_x[me].grad, **tol)
    if weights_grad:
        torch.testing.assert_close(weights.grad, dense_w[me].grad, **tol)
    else:
        assert weights.grad is None
    s = layer.shard
    n_local = 0
    for name, p in layer.named_parameters():
        full = getattr(dense, name)
        assert p.shape[0] == s.length == s.sizes[rank]
        torch.testing.assert_close(p.grad, full.grad[s.start:s.stop], **tol, msg=name)
        n_local += p.numel()
    return n_local, s.sizes


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("mode", ["replicated", "local"])
def test_layer_equals_dense_float64(world, mode):
    counts = run_distributed(_layer_vs_dense, world, 7, "uniform", "float64", mode, timeout=T)
    sizes = counts[0][1]
    assert sum(sizes) == E and max(sizes) - min(sizes) <= 1
    per_expert = 3 * INTER * H
    assert [c for c, _ in counts] == [n * per_expert for n in sizes]


@pytest.mark.parametrize("routing", ["one_expert", "skip_last_rank"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_layer_skewed_routing(world, routing):
    run_distributed(_layer_vs_dense, world, 5, routing, "float64", "local", timeout=T)
    run_distributed(_layer_vs_dense, world, 5, routing, "float64", "replicated", timeout=T)


def test_layer_fewer_tokens_than_ranks():
    # replicated: 2 tokens on 4 ranks, so two ranks dispatch nothing at all
    run_distributed(_layer_vs_dense, 4, 2, "uniform", "float64", "replicated", timeout=T)


@pytest.mark.parametrize("world", [2, 3])
def test_layer_float32_grouped(world):
    # float32 with 16-byte-aligned sizes takes torch's grouped matmul
    run_distributed(_layer_vs_dense, world, 9, "uniform", "float32", "local", timeout=T)


def test_layer_bias_and_transposed():
    run_distributed(_layer_vs_dense, 3, 6, "uniform", "float64", "local", True, True, timeout=T)


def _counted(mode):
    layer = ParallelExperts.from_dense(_dense(), tokens=mode)
    x = torch.randn(7, H, dtype=torch.float64, requires_grad=True)
    index, weights = _routing("uniform", 7, dist.get_rank() if mode == "local" else 0)
    weights.requires_grad_()
    with tp.CommCounter() as forward:
        out = layer(x, index, weights)
    with tp.CommCounter() as backward:
        out.sum().backward()
    kinds = [(r.kind, r.purpose) for r in forward.records]
    # replicated tokens: the tokens each rank's experts see (the rows it sends every peer)
    starts = [sum(layer.shard.sizes[:r]) for r in range(dist.get_world_size() + 1)]
    seen = [int(((index >= lo) & (index < hi)).any(1).sum())
            for lo, hi in itertools.pairwise(starts)]
    data = [c.nbytes("all_to_all", purpose="data") for c in (forward, backward)]
    return kinds, [(r.kind, r.purpose) for r in backward.records], data, seen


def test_comm_counter_local_tokens():
    # forward: the count exchange and one all-to-all each way, nothing else;
    # backward: the two mirrored all-to-alls
    for fwd, bwd, _, _ in run_distributed(_counted, 3, "local", timeout=T):
        assert fwd == [("all_gather", "meta"), ("all_to_all", "data"), ("all_to_all", "data")]
        assert bwd == [("all_to_all", "data"), ("all_to_all", "data")]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_comm_counter_replicated_tokens(world):
    # every rank holds every token: no dispatch (each rank's experts take their rows
    # locally); forward: the count exchange and one all-to-all that sends this rank's
    # per-token sums to every peer; backward: one all-to-all of the tokens' and the
    # weights' gradient rows. Nothing else, and no padding: exactly those rows travel.
    results = run_distributed(_counted, world, "replicated", timeout=T)
    for rank, (fwd, bwd, (fwd_bytes, bwd_bytes), seen) in enumerate(results):
        assert fwd == [("all_gather", "meta"), ("all_to_all", "data")]
        assert bwd == [("all_to_all", "data")]
        assert fwd_bytes == (world - 1) * seen[rank] * H * 8  # float64 tokens
        assert bwd_bytes == (world - 1) * seen[rank] * (H * 8 + K * 4)  # + float32 weights


def test_bad_expert_index_raises_on_every_rank():
    with pytest.raises(ValueError, match=r"outside \[0, 8\) on rank\(s\) \[1\]"):
        run_distributed(_bad_index, 3, timeout=T)


def _bad_index():
    layer = ParallelExperts.from_dense(_dense(), tokens="local")
    index, weights = _routing("uniform", 4, 0)
    if dist.get_rank() == 1:
        index[0, 0] = E
    layer(torch.randn(4, H, dtype=torch.float64), index, weights)


def _validated(tokens, mode):
    with tp.validation(True):
        return _layer_vs_dense(tokens, "uniform", "float64", mode)


@pytest.mark.parametrize("tokens, mode", [(5, "local"), (5, "replicated")])
def test_layer_in_validation_mode(tokens, mode):
    # the all-to-alls are fingerprinted across ranks in forward and backward
    run_distributed(_validated, 3, tokens, mode, timeout=T)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_layer_replicated_top3_uneven(world):
    # three experts a token: a token's sum spans ranks in more than two parts
    run_distributed(_layer_vs_dense, world, 11, "uniform", "float64", "replicated",
                    False, False, 3, timeout=T)


def test_layer_replicated_weights_without_grad():
    run_distributed(_layer_vs_dense, 3, 7, "uniform", "float64", "replicated",
                    False, False, K, False, timeout=T)


def _not_replicated(validate, what):
    layer = ParallelExperts.from_dense(_dense(), tokens="replicated")
    index, weights = _routing("uniform", 6, 0)
    x = torch.randn(6, H, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    if dist.get_rank() == 1:
        if what == "index":
            index[0] = torch.tensor([6, 7]) if index[0, 0] < 6 else torch.tensor([0, 1])
        else:
            x[0, 0] += 1.0
    with tp.validation(validate):
        layer(x, index, weights)


def test_replicated_tokens_with_different_routings_raise_on_every_rank():
    # the count exchange sees it (without validation mode): no rank goes on to a mismatched
    # all-to-all
    with pytest.raises(ValueError, match=r"routing \(top_k_index\) differs between ranks: "
                                         r"rank\(s\) \[1\]"):
        run_distributed(_not_replicated, 3, False, "index", timeout=T)


def test_replicated_tokens_that_differ_are_caught_by_validation():
    with pytest.raises(tp.CollectiveMismatchError, match="hidden_states"):
        run_distributed(_not_replicated, 3, True, "tokens", timeout=T)


def _few_experts(mode, n_experts):
    """Fewer experts than ranks: a rank holds none, and still joins both passes."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    rank = dist.get_rank()
    torch.manual_seed(0)
    dense = MixtralExperts(MixtralConfig(hidden_size=4, intermediate_size=4,
                                         num_local_experts=n_experts,
                                         experts_implementation="eager")).double()
    for p in dense.parameters():
        torch.nn.init.normal_(p)
    layer = ParallelExperts(dense, tokens=mode)
    gen = torch.Generator().manual_seed(1 + (rank if mode == "local" else 0))
    x = torch.randn(3, 4, dtype=torch.float64, generator=gen).requires_grad_()
    index = torch.randint(0, n_experts, (3, 1), generator=gen)
    weights = torch.rand(3, 1, dtype=torch.float64, generator=gen).requires_grad_()
    out = layer(x, index, weights)
    (out + x).sum().backward()  # a residual: x's gradient has a path around the experts
    dense.zero_grad()
    dx, dw = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    ref = dense(dx, index, dw)
    (ref + dx).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, dx.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights.grad, dw.grad, rtol=1e-12, atol=1e-12)
    return layer.shard.sizes


@pytest.mark.parametrize("mode", ["local", "replicated"])
def test_fewer_experts_than_ranks(mode):
    # the rank with no expert kept its output in the graph: before, its input gradient
    # missed the experts' part (off by 30) and the other ranks waited for it in backward
    sizes = run_distributed(_few_experts, 3, mode, 2, timeout=T)
    assert sizes[0] == (1, 1, 0)


class _TwoBiasedExperts(torch.nn.Module):
    """Two experts with biases (gpt-oss's layout), written out as the dense reference."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.has_gate, self.has_bias, self.is_transposed = True, True, False
        self.act_fn = torch.nn.functional.silu
        self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 8, 8, dtype=torch.float64))
        self.down_proj = torch.nn.Parameter(torch.randn(2, 8, 4, dtype=torch.float64))
        self.gate_up_proj_bias = torch.nn.Parameter(torch.randn(2, 8, dtype=torch.float64))
        self.down_proj_bias = torch.nn.Parameter(torch.randn(2, 8, dtype=torch.float64))

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        for e in range(2):
            pos, tok = torch.where(e == index.T)
            h = torch.nn.functional.linear(x[tok], self.gate_up_proj[e],
                                           self.gate_up_proj_bias[e])
            gate, up = h.chunk(2, dim=-1)
            y = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e],
                                           self.down_proj_bias[e])
            out = out.index_add(0, tok, y * weights[tok, pos, None])
        return out


def _few_biased_experts(mode):
    rank = dist.get_rank()
    dense = _TwoBiasedExperts()
    layer = ParallelExperts(_TwoBiasedExperts(), tokens=mode)
    gen = torch.Generator().manual_seed(1 + (rank if mode == "local" else 0))
    x = torch.randn(3, 8, dtype=torch.float64, generator=gen)
    index = torch.randint(0, 2, (3, 2), generator=gen)
    weights = torch.rand(3, 2, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(layer(x, index, weights), dense(x, index, weights),
                               rtol=1e-12, atol=1e-12)
    return layer.shard.sizes


@pytest.mark.parametrize("mode", ["local", "replicated"])
def test_fewer_experts_than_ranks_with_biases(mode):
    # the rank with no expert built its empty bias rows from a float tensor of counts:
    # "repeat_interleave_cpu" not implemented for 'Float', its peers blocked
    assert run_distributed(_few_biased_experts, 3, mode, timeout=T)[0] == (1, 1, 0)


class _UnequalExperts(torch.nn.Module):
    """Six experts up, four down (transformers' LongcatFlash adds identity experts so)."""

    def __init__(self):
        super().__init__()
        self.act_fn = torch.nn.functional.silu
        self.gate_up_proj = torch.nn.Parameter(torch.randn(6, 8, 4))
        self.down_proj = torch.nn.Parameter(torch.randn(4, 4, 4))


def _unequal():
    ParallelExperts(_UnequalExperts())


def test_unequal_expert_counts_refused_on_every_rank():
    from tensorpar.nn.experts import experts_problem

    assert "6 experts in gate_up_proj, 4 in down_proj" in experts_problem("e", _UnequalExperts())
    with pytest.raises(ValueError, match="6 experts in gate_up_proj, 4 in down_proj"):
        run_distributed(_unequal, 2, timeout=T)


def _permuted_routing():
    layer = ParallelExperts.from_dense(_dense(), tokens="replicated")
    index, weights = _routing("uniform", 6, 0)
    x = torch.randn(6, H, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    if dist.get_rank() == 1:
        index = index[[1, 0, 3, 2, 5, 4]]  # the same counts per expert, other tokens
    layer(x, index, weights)


def test_replicated_routing_that_differs_with_the_same_counts_raises():
    # before: no error, the output off by 3.2 on rank 0
    with pytest.raises(ValueError, match=r"routing \(top_k_index\) differs between ranks"):
        run_distributed(_permuted_routing, 2, timeout=T)
