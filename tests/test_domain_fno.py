"""neuraloperator's FNO (2-D) domain-parallel along H against dense, and the distributed real
FFT under its spectral convolution.

The FNO's spectral convolution is complex64 only, so the model runs in float32: output,
input tile gradients and every parameter gradient within 1e-4 of each tensor's largest
entry. `distributed_rfft2_apply` itself is checked in float64 within 1e-10.
"""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

from tensorpar.nn import distributed_rfft2_apply, parallelize_domain
from tensorpar.testing import run_distributed

pytestmark = pytest.mark.timeout(600)
T = 300
TOL = 1e-4
TOL64 = 1e-10
W = 12


def _fno(n_modes, grid_2d=False, **kwargs):
    from neuralop.layers.embeddings import GridEmbedding2D
    from neuralop.models import FNO  # imported on the ranks too
    if grid_2d:
        kwargs["positional_embedding"] = GridEmbedding2D(in_channels=2)
    return FNO(n_modes=n_modes, in_channels=2, out_channels=1, hidden_channels=8, **kwargs)


def _rel(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    return float((a - b).abs().max() / b.abs().max()) if a.numel() else 0.0


def _check_fno(rows, n_modes, kwargs):
    """Worst relative error of this rank's output, input gradient and parameter gradients."""
    warnings.filterwarnings("ignore")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = _fno(n_modes, **kwargs)
    x = torch.randn(2, 2, sum(rows), W)
    dense = copy.deepcopy(model)
    par = parallelize_domain(copy.deepcopy(model), dims=-2)
    xd = x.clone().requires_grad_()
    out_d = dense(xd)
    gout = torch.randn_like(out_d)
    (out_d * gout).sum().backward()
    mine = slice(sum(rows[:rank]), sum(rows[:rank + 1]))
    xt = x[:, :, mine].clone().requires_grad_()
    out = par(xt)
    (out * gout[:, :, mine]).sum().backward()
    out, out_d = out.detach(), out_d.detach()
    # relative to the whole dense tensor's largest entry (a tile may hold only small ones)
    worst = {"output": float((out - out_d[:, :, mine]).abs().max() / out_d.abs().max())
             if out.numel() else 0.0,
             "input grad": float((xt.grad - xd.grad[:, :, mine]).abs().max()
                                 / xd.grad.abs().max()) if out.numel() else 0.0}
    grads = dict(dense.named_parameters())
    names = [n for n, _ in par.named_parameters()]
    assert names == list(grads), "parameter names changed"
    for name, p in par.named_parameters():
        assert p.grad is not None, f"{name}: no gradient"
        worst[name] = _rel(p.grad, grads[name].grad, f"grad of {name}")
    return worst


def _assert_close(results):
    for rank, worst in enumerate(results):
        bad = {k: v for k, v in worst.items() if not v < TOL}
        assert not bad, f"rank {rank}: {bad}"
    return max(max(w.values()) for w in results)


CASES = {
    "default": ((4, 4), {}),  # grid embedding, linear FNO skips, soft-gating MLP skips
    "odd_modes_norm": ((6, 5), {"norm": "group_norm", "n_layers": 2}),
    "separable": ((4, 4), {"separable": True, "n_layers": 2, "grid_2d": True}),
    "tucker": ((6, 4), {"factorization": "tucker", "rank": 0.5, "n_layers": 2}),
}


@pytest.mark.parametrize("rows", [[9, 8], [3, 14]])
def test_fno_two_ranks(rows):
    pytest.importorskip("neuralop")
    _assert_close(run_distributed(_check_fno, 2, rows, *CASES["default"], timeout=T))


@pytest.mark.parametrize("case", ["odd_modes_norm", "separable", "tucker"])
def test_fno_variants_two_ranks(case):
    pytest.importorskip("neuralop")
    _assert_close(run_distributed(_check_fno, 2, [10, 7], *CASES[case], timeout=T))


@pytest.mark.parametrize("rows", [[6, 5, 6], [7, 2, 8], [9, 0, 8]])
def test_fno_three_ranks(rows):
    pytest.importorskip("neuralop")
    _assert_close(run_distributed(_check_fno, 3, rows, *CASES["default"], timeout=T))


def test_fno_single_rank():
    pytest.importorskip("neuralop")
    _assert_close([_check_fno([17], *CASES["odd_modes_norm"])])


@pytest.mark.parametrize(("kwargs", "dims", "message"), [
    ({"domain_padding": 0.25}, -2, "domain_padding=None"),
    ({"complex_data": True}, -2, "complex_data=True"),
    ({"fno_block_precision": "mixed"}, -2, "fno_block_precision='mixed'"),
    ({"resolution_scaling_factor": 2}, -2, "resolution_scaling_factor"),
    ({"norm": "instance_norm"}, -2, "F.instance_norm"),
    ({}, -1, "splits H only"),
])
def test_refusals(kwargs, dims, message):
    pytest.importorskip("neuralop")
    with pytest.raises(ValueError, match="cannot convert") as err:
        parallelize_domain(_fno((4, 4), **kwargs), dims=dims)
    assert message in str(err.value)


def test_one_dimensional_is_refused():
    pytest.importorskip("neuralop")
    from neuralop.models import FNO
    with pytest.raises(ValueError, match="a 1-D spectral convolution"):
        parallelize_domain(FNO(n_modes=(4,), in_channels=1, out_channels=1,
                               hidden_channels=4), dims=-1)


def test_output_shape_is_refused():
    pytest.importorskip("neuralop")
    model = parallelize_domain(_fno((4, 4)), dims=-2)
    with pytest.raises(TypeError, match="output_shape"):  # resampling is not converted
        model.fno_blocks.convs[0](torch.randn(1, 8, 9, W), output_shape=(18, W))


# -- the distributed real FFT path, float64 ---------------------------------------------------

def _check_rfft(rows, width, columns, norm):
    """|distributed - dense| of irfft2(rfft2(x)[..., :K] (x) weight) and its gradients."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    g = torch.Generator().manual_seed(5)
    n, k = sum(rows), columns
    x = torch.randn(2, 3, n, width, generator=g, dtype=torch.float64)
    wt = torch.randn(3, 4, n, k, generator=g, dtype=torch.complex128)  # (C_in, C_out, N, K)
    gout = torch.randn(2, 4, n, width, generator=g, dtype=torch.float64)

    full, wd = x.clone().requires_grad_(), wt.clone().requires_grad_()
    spec = torch.fft.rfft2(full, norm=norm)[..., :k]
    ref = torch.fft.irfft2(torch.einsum("bixy,ioxy->boxy", spec, wd), s=(n, width), norm=norm)
    (ref * gout).sum().backward()

    mine = slice(sum(rows[:rank]), sum(rows[:rank + 1]))
    tile, wp = x[:, :, mine].clone().requires_grad_(), wt.clone().requires_grad_()
    c = -(-k // world)
    assert_start = rank * c

    def fn(s, start):
        assert start == assert_start and s.shape[-2:] == (n, c)
        w = wp[..., start:start + c]
        w = torch.cat([w, w.new_zeros(*w.shape[:-1], c - w.shape[-1])], dim=-1)  # padding
        return torch.einsum("bixy,ioxy->boxy", s, w)

    out = distributed_rfft2_apply(tile, fn, split_dim=2, other_dim=-1, columns=k, norm=norm)
    (out * gout[:, :, mine]).sum().backward()
    out, ref = out.detach(), ref.detach()
    err = float((out - ref[:, :, mine]).abs().max()) if out.numel() else 0.0
    gerr = float((tile.grad - full.grad[:, :, mine]).abs().max()) if out.numel() else 0.0
    return err, gerr, wp.grad, wd.grad, tuple(out.shape)


@pytest.mark.parametrize(("rows", "width", "columns", "norm"), [
    ([1, 12], 7, 4, None),         # every column (7 // 2 + 1)
    ([5, 0, 8], 7, 2, "forward"),  # an empty tile; rank 2's column block is all padding
    ([4, 4, 3], 10, 5, "ortho"),
])
def test_rfft2_apply_matches_dense(rows, width, columns, norm):
    results = run_distributed(_check_rfft, len(rows), rows, width, columns, norm, timeout=T)
    for rank, (err, gerr, _, _, shape) in enumerate(results):
        assert shape == (2, 4, rows[rank], width)
        assert err < TOL64 and gerr < TOL64, f"rank {rank}: output {err}, gradient {gerr}"
    # each rank's weight gradient covers its own columns: their sum is the dense one
    wgrad = sum(r[2] for r in results)
    assert float((wgrad - results[0][3]).abs().max()) < TOL64


def test_rfft2_apply_single_rank():
    err, gerr, wgrad, dense, _ = _check_rfft([6], 9, 3, None)
    assert err < TOL64 and gerr < TOL64 and float((wgrad - dense).abs().max()) < TOL64


def test_rfft2_apply_refuses_bad_columns():
    with pytest.raises(ValueError, match="columns=5, expected 1 to 4"):
        distributed_rfft2_apply(torch.randn(3, 6), lambda s, i: s, split_dim=0, other_dim=1,
                                columns=5)
