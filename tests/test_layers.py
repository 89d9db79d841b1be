"""Parallel layers against the dense layers with the same weights (TP sizes 1-4, uneven)."""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tensorpar as tp
from tensorpar.nn import (
    ColumnParallelLinear,
    Gather,
    ParallelEmbedding,
    ParallelRNG,
    RowParallelLinear,
    Scatter,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from tensorpar.testing import run_distributed

TP = [1, 2, 3, 4]


def rand(seed, *shape, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _close(dtype):
    return {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else \
        {"rtol": 1e-4, "atol": 1e-5}


def _column(gather_output, dtype_name, device="cpu"):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    dense = nn.Linear(10, 37).to(device, dtype)
    layer = ColumnParallelLinear.from_dense(dense, gather_output=gather_output)
    assert layer.weight.device == dense.weight.device
    s = layer.shard
    x_dense = rand(1, 5, 10, dtype=dtype).to(device).requires_grad_()
    x = rand(1, 5, 10, dtype=dtype).to(device).requires_grad_()
    w = rand(2, 5, 37, dtype=dtype).to(device)
    y_dense = dense(x_dense)
    (y_dense * w).sum().backward()
    y = layer(x)
    if gather_output:  # full output on every rank, one replicated loss
        torch.testing.assert_close(y, y_dense, **_close(dtype))
        (y * w).sum().backward()
    else:  # each rank's slice, the rank losses add up to the dense loss
        torch.testing.assert_close(y, y_dense[..., s.start: s.stop], **_close(dtype))
        (y * w[..., s.start: s.stop]).sum().backward()
    torch.testing.assert_close(x.grad, x_dense.grad, **_close(dtype))
    torch.testing.assert_close(layer.weight.grad, dense.weight.grad[s.start: s.stop],
                               **_close(dtype))
    torch.testing.assert_close(layer.bias.grad, dense.bias.grad[s.start: s.stop], **_close(dtype))
    return s.sizes


@pytest.mark.parametrize("world_size", TP)
@pytest.mark.parametrize("gather_output", [False, True])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_column_parallel_linear(world_size, gather_output, dtype):
    sizes = run_distributed(_column, world_size, gather_output, dtype)[0]
    assert sum(sizes) == 37 and len(sizes) == world_size


def _row(input_is_parallel, dtype_name, device="cpu"):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    dense = nn.Linear(37, 10).to(device, dtype)
    layer = RowParallelLinear.from_dense(dense, input_is_parallel=input_is_parallel)
    assert layer.weight.device == dense.weight.device
    s = layer.shard
    x_dense = rand(1, 5, 37, dtype=dtype).to(device).requires_grad_()
    x_full = rand(1, 5, 37, dtype=dtype).to(device)
    x = (x_full[..., s.start: s.stop] if input_is_parallel else x_full).clone().requires_grad_()
    w = rand(2, 5, 10, dtype=dtype).to(device)
    (dense(x_dense) * w).sum().backward()
    y = layer(x)
    torch.testing.assert_close(y, dense(x_dense.detach()), **_close(dtype))
    (y * w).sum().backward()  # one replicated loss
    expected_x = x_dense.grad[..., s.start: s.stop] if input_is_parallel else x_dense.grad
    torch.testing.assert_close(x.grad, expected_x, **_close(dtype))
    torch.testing.assert_close(layer.weight.grad, dense.weight.grad[:, s.start: s.stop],
                               **_close(dtype))
    torch.testing.assert_close(layer.bias.grad, dense.bias.grad, **_close(dtype))  # added once
    return True


@pytest.mark.parametrize("world_size", TP)
@pytest.mark.parametrize("input_is_parallel", [True, False])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_row_parallel_linear(world_size, input_is_parallel, dtype):
    assert all(run_distributed(_row, world_size, input_is_parallel, dtype))


def _embedding(kind):
    torch.manual_seed(0)
    dense = nn.Embedding(101, 10, padding_idx=3).double()
    cls = {"vocab": VocabParallelEmbedding, "dim": ParallelEmbedding}[kind]
    layer = cls.from_dense(dense)
    s = layer.shard
    ids = torch.randint(0, 101, (4, 7), generator=torch.Generator().manual_seed(5))
    ids[0, :3] = torch.tensor([0, 100, 3])
    w = rand(2, 4, 7, 10)
    (dense(ids) * w).sum().backward()
    y = layer(ids)
    torch.testing.assert_close(y, dense(ids), rtol=0, atol=0)
    (y * w).sum().backward()
    expected = dense.weight.grad.narrow(cls.shard_dim, s.start, s.length)
    torch.testing.assert_close(layer.weight.grad, expected, rtol=1e-12, atol=1e-12)
    return True


@pytest.mark.parametrize("world_size", TP)
@pytest.mark.parametrize("kind", ["vocab", "dim"])
def test_embeddings(world_size, kind):
    assert all(run_distributed(_embedding, world_size, kind))


def _dense_round_trip():
    torch.manual_seed(0)
    rank = dist.get_rank()
    dense_layers = [nn.Linear(10, 37), nn.Linear(37, 10), nn.Embedding(101, 10),
                    nn.Embedding(101, 10)]
    parallel = [ColumnParallelLinear.from_dense(dense_layers[0]),
                RowParallelLinear.from_dense(dense_layers[1]),
                VocabParallelEmbedding.from_dense(dense_layers[2]),
                ParallelEmbedding.from_dense(dense_layers[3])]
    dst = dist.get_world_size() - 1
    for dense, layer in zip(dense_layers, parallel, strict=True):
        back = layer.to_dense(dst=dst)
        if rank == dst:
            assert type(back) is type(dense)
            for name, value in dense.state_dict().items():
                assert torch.equal(back.state_dict()[name], value), name
        else:
            assert all(tp.is_placeholder(v) for v in back.values())
            assert back["weight"].shape == dense.weight.shape and back["weight"].owner == dst
    return True


@pytest.mark.parametrize("world_size", TP)
def test_to_dense_of_from_dense_is_identity(world_size):
    assert all(run_distributed(_dense_round_trip, world_size))


# -- vocab-parallel cross entropy ------------------------------------------------------------

def _cross_entropy(smoothing, reduction):
    rank, p = dist.get_rank(), dist.get_world_size()
    vocab = 101
    full = rand(3, 6, 5, vocab) * 4
    target = torch.randint(0, vocab, (6, 5), generator=torch.Generator().manual_seed(4))
    target[0, :2] = -100  # ignored
    target[1, 0] = vocab - 1
    dense_logits = full.clone().requires_grad_()
    expected = F.cross_entropy(dense_logits.transpose(1, 2), target, ignore_index=-100,
                               label_smoothing=smoothing, reduction=reduction)
    w = rand(8, *expected.shape)
    (expected * w).sum().backward()
    chunks = torch.tensor_split(full, p, -1)
    local = chunks[rank].clone().requires_grad_()
    before = local.detach().clone()
    loss = vocab_parallel_cross_entropy(local, target, label_smoothing=smoothing,
                                        reduction=reduction)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)
    (loss * w).sum().backward()
    start = sum(c.shape[-1] for c in chunks[:rank])
    torch.testing.assert_close(local.grad, dense_logits.grad[..., start: start + local.shape[-1]],
                               rtol=1e-10, atol=1e-10)
    assert torch.equal(local.detach(), before)  # inputs not modified
    return True


@pytest.mark.parametrize("world_size", TP)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy(world_size, smoothing, reduction):
    assert all(run_distributed(_cross_entropy, world_size, smoothing, reduction))


def _cross_entropy_in_half(autocast, dtype):
    """The loss and gradient dtypes of dense ``F.cross_entropy``, with and without autocast."""
    rank, p = dist.get_rank(), dist.get_world_size()
    full = (rand(5, 8, 50) * 3).to(dtype)
    target = torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(6))
    results = []
    for parallel in (False, True):
        logits = (torch.tensor_split(full, p, -1)[rank] if parallel else full).clone()
        logits.requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = (vocab_parallel_cross_entropy(logits, target) if parallel
                    else F.cross_entropy(logits, target))
        loss.backward()
        results.append((loss.dtype, logits.grad.dtype, float(loss)))
    (dense_dtype, dense_grad, dense), (dtype_, grad_dtype, value) = results
    return dense_dtype == dtype_ and dense_grad == grad_dtype and abs(dense - value) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "plain"])
def test_cross_entropy_follows_autocast_like_dense(autocast, dtype):
    assert all(run_distributed(_cross_entropy_in_half, 2, autocast, dtype))


def _cross_entropy_stable():
    rank = dist.get_rank()
    local = torch.full((2, 3), 1e4 * (rank + 1))  # exp() would overflow without the shift
    loss = vocab_parallel_cross_entropy(local, torch.tensor([0, 1]))
    return bool(torch.isfinite(loss))


def test_cross_entropy_is_stable_for_large_logits():
    assert all(run_distributed(_cross_entropy_stable, 2))


def test_cross_entropy_rejects_bad_input():
    with pytest.raises(ValueError, match="reduction='avg'"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long),
                                     reduction="avg")
    with pytest.raises(ValueError, match=r"expected target of shape \(2,\)"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))


# -- scatter / gather modules, RNG ------------------------------------------------------------

def _sequential():
    rank = dist.get_rank()
    model = nn.Sequential(Scatter(dim=0, src=0), nn.Tanh(), Gather(dim=0, dst=0))
    x = rand(0, 7, 3).requires_grad_() if rank == 0 else None
    out = model(x)
    (out.sum() if not tp.is_placeholder(out) else out).backward()
    if rank:
        return tp.is_placeholder(out)
    return torch.allclose(out, torch.tanh(x)) and torch.allclose(x.grad, 1 - torch.tanh(x) ** 2)


def test_scatter_gather_modules_in_sequential():
    assert all(run_distributed(_sequential, 3))


def _rng():
    rank = dist.get_rank()
    rng = ParallelRNG(seed=7)
    torch.manual_seed(123)
    global_before = torch.get_rng_state()
    with rng.replicated():
        a1 = torch.rand(8)
    with rng.replicated():
        a2 = torch.rand(8)  # the stream advanced
    with rng.sharded():
        b = torch.rand(8)
    untouched = torch.equal(torch.get_rng_state(), global_before)
    everyone = [torch.empty(3, 8) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, torch.stack([a1, a2, b]))
    same_replicated = all(torch.equal(e[:2], everyone[0][:2]) for e in everyone)
    distinct_sharded = len({tuple(e[2].tolist()) for e in everyone}) == len(everyone)
    return untouched, not torch.equal(a1, a2), same_replicated, distinct_sharded, rank


def test_parallel_rng_streams():
    for untouched, advanced, same, distinct, _ in run_distributed(_rng, 3):
        assert untouched and advanced and same and distinct


def _rng_resumed():
    rng = ParallelRNG(seed=7)
    with rng.sharded():
        torch.rand(3)
    saved = rng.state_dict()
    want = []
    for stream in (rng.replicated, rng.sharded):
        with stream():
            want.append(torch.rand(5))
    restarted = ParallelRNG(seed=99)  # another process's, seeded otherwise
    restarted.load_state_dict(saved)
    got = []
    for stream in (restarted.replicated, restarted.sharded):
        with stream():
            got.append(torch.rand(5))
    with pytest.raises(ValueError, match=r"replicated\.cpu"):
        restarted.load_state_dict({"sharded.cpu": saved["sharded.cpu"]})
    return all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_parallel_rng_state_resumes_both_streams():
    # (a run resumed from a checkpoint draws the masks the uninterrupted run would)
    assert all(run_distributed(_rng_resumed, 2))


# -- parallelize: plan validation ---------------------------------------------------------------

def test_plan_problems_are_reported_together():
    model = nn.Sequential(nn.Linear(4, 10), nn.ReLU(), nn.Linear(10, 4), nn.Embedding(5, 4))
    plan = {"0": tp.nn.Colwise(multiple_of=3), "1": "colwise", "9": "rowwise",
            "3": "vocab", "2": "sideways"}
    with pytest.raises(ValueError) as info:
        tp.parallelize(model, plan)
    message = str(info.value)
    assert "'0': out_features=10 is not a multiple of multiple_of=3 (10 % 3 = 1)" in message
    assert "'1' is a ReLU; style Colwise splits an nn.Linear" in message
    assert "'9' matches no module" in message
    assert "unknown style 'sideways'" in message
    assert len(re.findall(r"\n  - ", message)) == 4
    assert type(model[0]) is nn.Linear  # nothing was replaced


# -- the column-parallel backward: all-reduce overlapped with the weight gradient ----------------

def _mlp_pair():
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(10, 37), nn.Tanh(), nn.Linear(37, 10)).double()
    parallel = nn.Sequential(ColumnParallelLinear.from_dense(dense[0]), nn.Tanh(),
                             RowParallelLinear.from_dense(dense[2]))
    return dense, parallel


def _double_backward():
    """A gradient penalty (create_graph=True) through a column -> row pair equals the dense one."""
    dense, parallel = _mlp_pair()
    results = []
    for model in (dense, parallel):
        x = rand(1, 4, 10).requires_grad_()
        (gx,) = torch.autograd.grad((model(x) * rand(2, 4, 10)).sum(), x, create_graph=True)
        gx.square().sum().backward()
        results.append((gx.detach(), x.grad, [p.grad for p in model.parameters()]))
    (gx_d, xg_d, pg_d), (gx_p, xg_p, pg_p) = results
    torch.testing.assert_close(gx_p, gx_d, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(xg_p, xg_d, rtol=1e-10, atol=1e-10)
    s = parallel[0].shard
    expected = [pg_d[0][s.start: s.stop], pg_d[1][s.start: s.stop], pg_d[2][:, s.start: s.stop],
                pg_d[3]]
    for got, want in zip(pg_p, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_column_row_double_backward_matches_dense(world_size):
    assert all(run_distributed(_double_backward, world_size))


def _all_reduce_before_weight_grad():
    from tensorpar.nn.layers import _column_fn

    torch.manual_seed(0)
    layer = ColumnParallelLinear(6, 8).double()
    x = rand(1, 3, 6).requires_grad_()
    y = layer(x)
    rows, log = _column_fn._rows, []

    def logged(t):  # folds the operands of the weight and bias gradients
        log.append(counter.count("all_reduce"))
        return rows(t)

    _column_fn._rows = logged
    try:
        with tp.CommCounter() as counter:
            y.backward(rand(2, *y.shape))
    finally:
        _column_fn._rows = rows
    return log, counter.count("all_reduce"), x.grad is not None


def test_column_backward_launches_all_reduce_before_weight_gradient():
    for log, reduces, has_grad in run_distributed(_all_reduce_before_weight_grad, 2):
        # the weight and bias gradients are computed while the all-reduce is in flight
        assert has_grad and reduces == 1 and log and all(n == 1 for n in log), log


def test_direct_apply_is_function_apply():
    """The layers' shortcut to a Function's C++ apply records the same node and gradients,
    and under a functorch transform is ``Function.apply`` itself (here: the same refusal)."""
    from tensorpar.collectives._autograd import direct_apply

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, k):
            ctx.k = k
            return x * k

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.k, None

    apply = direct_apply(Scale)
    x = torch.randn(3, requires_grad=True)
    y = apply(x, 2.0)
    assert type(y.grad_fn).__name__ == "ScaleBackward"
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    refusals = []
    for fn in (Scale.apply, apply):
        with pytest.raises(RuntimeError) as info:
            torch.func.vmap(lambda t, fn=fn: fn(t, 2.0))(torch.randn(2, 3))
        refusals.append(str(info.value))
    assert refusals[0] == refusals[1]


def _under_autocast():
    """Autocast takes the plain composition; results follow the dense layer under autocast."""
    torch.manual_seed(0)
    dense = nn.Linear(10, 37)
    layer = ColumnParallelLinear.from_dense(dense, gather_output=True)
    x_dense, x = rand(1, 5, 10, dtype=torch.float32), rand(1, 5, 10, dtype=torch.float32)
    x_dense.requires_grad_(), x.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_dense, y = dense(x_dense), layer(x)
    y_dense.float().sum().backward()
    y.float().sum().backward()
    torch.testing.assert_close(y, y_dense, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad, x_dense.grad, rtol=2e-2, atol=2e-2)
    return y.dtype == torch.bfloat16


def test_column_parallel_linear_under_autocast():
    assert all(run_distributed(_under_autocast, 2))


def _zero_width_shard():
    """out_features < ranks: some ranks hold no output column and still join the backward."""
    torch.manual_seed(0)
    dense = nn.Linear(6, 1).double()
    layer = ColumnParallelLinear.from_dense(dense, gather_output=True)
    x_dense, x = rand(1, 3, 6).requires_grad_(), rand(1, 3, 6).requires_grad_()
    (dense(x_dense) * 2).sum().backward()
    y = layer(x)
    torch.testing.assert_close(y, dense(x_dense.detach()), rtol=1e-10, atol=1e-10)
    (y * 2).sum().backward()
    torch.testing.assert_close(x.grad, x_dense.grad, rtol=1e-10, atol=1e-10)
    return layer.shard.length


def test_column_parallel_linear_with_an_empty_shard():
    assert sorted(run_distributed(_zero_width_shard, 2)) == [0, 1]


def _on_meta():
    layer = ColumnParallelLinear(4, 6, device="meta")
    y = layer(torch.empty(3, 4, device="meta", requires_grad=True))
    return tuple(y.shape), y.device.type


def test_column_parallel_linear_on_meta_tensors():
    assert run_distributed(_on_meta, 2) == [((3, 3), "meta")] * 2
