"""ring_attention equals torch's SDPA over the whole sequence (float64, 1e-10)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tensorpar
from tensorpar.context import _blocks
from tensorpar.nn import ring_attention, ulysses_attention
from tensorpar.testing import run_distributed

TOL = 1e-10


def dense_mask(total, causal, window):
    pos = torch.arange(total)
    dist_ = pos.unsqueeze(1) - pos
    mask = dist_ >= 0 if causal else torch.ones(total, total, dtype=torch.bool)
    if window is not None:
        mask &= dist_.abs() < window
    return mask


def _compare(lengths, causal, heads=(4, 4), window=None, scale=None, kernel="auto",
             pass_lengths=False, batch=2, dim=5, fn=ring_attention, strided=False):
    """Every rank: its chunk of the output and of q/k/v's gradients against dense SDPA."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    total = sum(lengths)
    g = torch.Generator().manual_seed(7)
    hq, hkv = heads
    q, k, v = (torch.randn(batch, h, total, dim, generator=g, dtype=torch.float64)
               for h in (hq, hkv, hkv))
    dout = torch.randn(batch, hq, total, dim, generator=g, dtype=torch.float64)
    gqa = hq != hkv
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=dense_mask(total, causal, window),
                                         scale=scale, enable_gqa=gqa)
    ref.backward(dout)
    start = sum(lengths[:rank])
    mine = slice(start, start + lengths[rank])
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    # strided: each laid out (B, H, D, T) in memory, seen as (B, H, T, D): head dim stride T
    given = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in local] if strided \
        else local
    fused = _blocks._fused
    if kernel == "math":
        _blocks._fused = lambda t: False
    try:
        out = fn(*given, is_causal=causal, scale=scale, enable_gqa=gqa,
                             window=window, lengths=list(lengths) if pass_lengths else None)
        out.backward(dout[:, :, mine])
    finally:
        _blocks._fused = fused
    return chunk_errors(out, ref, local, leaves, mine)


def chunk_errors(out, ref, local, leaves, mine):
    """This rank's output and q/k/v gradients against the dense ones' rows ``mine``."""
    errors = {"out": (out - ref[:, :, mine]).abs().max().item() if out.numel() else 0.0}
    for name, loc, full in zip("qkv", local, leaves, strict=True):
        diff = loc.grad - full.grad[:, :, mine]
        errors["d" + name] = diff.abs().max().item() if diff.numel() else 0.0
    return errors


def _check(world, *args, **kwargs):
    for rank, errors in enumerate(run_distributed(_with_kwargs, world, args, kwargs,
                                                  timeout=240)):
        for name, err in errors.items():
            assert err < TOL, f"rank {rank}: {name} off by {err}"


def _with_kwargs(args, kwargs):
    return _compare(*args, **kwargs)


CASES = {2: [3, 4], 3: [5, 0, 8], 4: [3, 1, 4, 2]}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa(world, causal):
    _check(world, CASES[world], causal)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_four_ranks(causal):
    _check(4, CASES[4], causal)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lengths", [[1, 12], [12, 1], [5, 0, 8], [0, 0, 1], [0, 1, 0, 0],
                                     [0, 0, 0]])
@pytest.mark.parametrize("causal", [False, True])
def test_uneven_and_empty_chunks(lengths, causal):
    _check(len(lengths), lengths, causal)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_gqa_and_scale(world):
    _check(world, CASES[world], True, heads=(6, 2), scale=0.37)
    _check(world, CASES[world], False, heads=(6, 3), scale=1.9)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [1, 2, 4])
def test_sliding_window(world, causal, window):
    _check(world, [5, 1, 7][:world], causal, window=window)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_matmul_kernel(world, causal):
    """The kernel used off the CPU (plain matmul/softmax), forced here."""
    _check(world, CASES[world], causal, heads=(4, 2), window=3, kernel="math")
    _check(world, CASES[world], causal, kernel="math", pass_lengths=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_breadth(world):
    lengths = {2: [17, 6], 3: [9, 0, 14], 4: [6, 11, 0, 7]}[world]
    for causal in (False, True):
        for window in (None, 5):
            _check(world, lengths, causal, heads=(6, 2), window=window, scale=0.5)
            _check(world, lengths, causal, heads=(4, 4), window=window, kernel="math")


def test_single_rank_matches_sdpa():
    errors = _compare([6], True, heads=(4, 2))
    assert max(errors.values()) < TOL


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kernel", ["auto", "math"])
def test_inputs_strided_along_the_head_dim(kernel):
    """q, k, v whose last dim is not contiguous (a (B, H, D, T) buffer seen as (B, H, T, D));
    the CPU's fused kernel read such a q as if it were contiguous."""
    errors = _compare([6], True, heads=(4, 2), kernel=kernel, strided=True)
    assert max(errors.values()) < TOL, errors
    _check(3, [5, 0, 8], True, heads=(4, 2), window=4, kernel=kernel, strided=True)
    _check(2, [3, 4], False, kernel=kernel, strided=True, fn=ulysses_attention)


def _bad_rank(kind):
    rank = dist.get_rank()
    q = torch.zeros(1, 2, 3 + rank, 4)
    k = v = q
    fn, kwargs = ring_attention, {}
    if kind == "heads" and rank == 1:
        q = torch.zeros(1, 4, 4, 4)
    if kind == "ndim" and rank == 0:
        q = torch.zeros(2, 3, 4)
    if kind == "scale":
        kwargs["scale"] = 0.5 if rank == 0 else 0.25
    if kind == "function" and rank == 1:
        fn = ulysses_attention
    if kind in ("lengths", "lengths on one rank"):  # checked against the chunks when validating
        kwargs["lengths"] = [3, 4] if rank == 1 else [3, 6]
        if kind == "lengths on one rank" and rank == 1:
            del kwargs["lengths"]
    try:
        with tensorpar.validation(kind.startswith("lengths")):
            fn(q, k, v, is_causal=True, **kwargs)
    except tensorpar.TensorparError as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["heads", "ndim", "scale", "function", "lengths",
                                  "lengths on one rank"])
def test_bad_arguments_raise_on_every_rank(kind):
    results = run_distributed(_bad_rank, 2, kind, timeout=60)
    assert all(r is not None and "attention" in r[1] for r in results), results


@pytest.mark.parametrize(("kwargs", "cls"), [
    ({"window": "3"}, tensorpar.CollectiveTypeError),
    ({"window": 2.0}, tensorpar.CollectiveTypeError),
    ({"scale": "x"}, tensorpar.CollectiveTypeError),
    ({"is_causal": "yes"}, tensorpar.CollectiveTypeError),
    ({"window": 0}, tensorpar.CollectiveArgumentError),
    ({"lengths": [2]}, tensorpar.CollectiveArgumentError),
])
def test_a_wrong_type_is_a_type_error_and_a_wrong_value_a_value_error(kwargs, cls):
    q = torch.zeros(1, 2, 3, 4)
    for fn in (ring_attention, ulysses_attention):
        with pytest.raises(cls):
            fn(q, q, q, **kwargs)


def test_ulysses_errors_name_it():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="ulysses_attention: lengths"):
        ulysses_attention(q, q, q, lengths=[2])
    with pytest.raises(ValueError, match="ulysses_attention: k and v"):
        ulysses_attention(q, q[:, :1], q[:, :1])


def test_lengths_checked():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="lengths"):
        ring_attention(q, q, q, lengths=[2])
    with pytest.raises(ValueError, match="enable_gqa"):
        ring_attention(q, q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match="window"):
        ring_attention(q, q, q, window=0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lengths", [[3, 4], [5, 0, 8], [1, 12], [3, 1, 4, 2]])
@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_matches_sdpa(lengths, causal):
    """The all-to-all variant: 6 heads (padded at 4 ranks), GQA, a window."""
    _check(len(lengths), lengths, causal, heads=(6, 3), fn=ulysses_attention)
    _check(len(lengths), lengths, causal, heads=(4, 4), window=3, scale=0.7,
           fn=ulysses_attention)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_math_kernel_half_precision_backward(dtype):
    """The matmul/softmax kernel (every device but the CPU) in half precision, both passes."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 9, 4, generator=g) for _ in range(3))
    dout = torch.randn(2, 2, 9, 4, generator=g)
    low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    fused = _blocks._fused
    _blocks._fused = lambda t: False
    try:
        out = ring_attention(*low, is_causal=True, window=5)
        out.backward(dout.to(dtype))
    finally:
        _blocks._fused = fused
    want = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*want, attn_mask=dense_mask(9, True, 5)).backward(dout)
    assert out.dtype == dtype
    for got, full in zip(low, want, strict=True):
        assert got.grad.dtype == dtype
        assert (got.grad.float() - full.grad).abs().max() < 5e-2


def _under_autocast(fn):
    """Float32 inputs under bfloat16 autocast: the output and gradients SDPA gives there."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 12, 8, generator=g) for _ in range(3))
    dense = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.scaled_dot_product_attention(*dense, is_causal=True)
    want.float().sum().backward()
    mine = [t.tensor_split(world, 2)[rank].clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(*mine, is_causal=True)
    out.float().sum().backward()
    chunk = want.tensor_split(world, 2)[rank]
    return (out.dtype, chunk.dtype, [t.grad.dtype for t in mine],
            float((out.float() - chunk.float()).abs().max()))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention], ids=["ring", "ulysses"])
def test_autocast_gives_sdpa_dtypes(fn):
    """Under autocast, SDPA computes in bfloat16: so do the ring and the all-to-all (their
    transfers half the bytes), and the float32 inputs get float32 gradients."""
    for got, want, grads, error in run_distributed(_under_autocast, 2, fn, timeout=100):
        assert got == want == torch.bfloat16
        assert grads == [torch.float32] * 3
        assert error < 3e-2  # two bfloat16 computations of the same attention


def _compiled_without_lengths(fn):
    """Without ``lengths`` the chunk lengths are exchanged: eagerly, one graph break."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 4, 7, 3, dtype=torch.float64, generator=g) for _ in range(3))
    chunks = [t.tensor_split(world, 2)[rank] for t in (q, k, v)]
    compiled = torch.compile(lambda a, b, c: fn(a, b, c, is_causal=True), backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in chunks]
    out = compiled(*leaves)
    out.sum().backward()
    eager = [t.clone().requires_grad_() for t in chunks]
    want = fn(*eager, is_causal=True)
    want.sum().backward()
    return max([float((out - want).abs().max())] +
               [float((a.grad - b.grad).abs().max()) for a, b in zip(leaves, eager, strict=True)])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention], ids=["ring", "ulysses"])
def test_compiled_without_lengths_equals_eager(fn):
    assert max(run_distributed(_compiled_without_lengths, 2, fn, timeout=240)) < 1e-12
