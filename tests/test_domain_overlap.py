"""Convolutions on strips computed while the halo travels, and the general path beside it.

A gradient penalty (double backward) goes through the general path
(``double_backward=True``), equal to dense; the fast paths refuse it with a clear error.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tensorpar.nn import parallelize_domain
from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(300)
T = 240


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(),
                         nn.Conv2d(3, 1, 5, padding=2, padding_mode="circular")).double()


def _normed_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Tanh(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(),
                         nn.MaxPool2d(2, ceil_mode=True), nn.Conv2d(4, 1, 3, padding=1)
                         ).double()


def _penalty(double_backward, sizes, net=_net, linear=False):
    rank = dist.get_rank()
    dense = net()
    x = torch.randn(2, 2, sum(sizes), 7, dtype=torch.float64, generator=torch.Generator()
                    .manual_seed(1))
    par = parallelize_domain(copy.deepcopy(dense), dims=-2,
                             double_backward=double_backward)
    xd = x.clone().requires_grad_()
    def loss(y):  # (linear in the output: its gradient is a constant)
        return y.sum() if linear else y.square().sum()

    (gd,) = torch.autograd.grad(loss(dense(xd)), xd, create_graph=True)
    gd.square().sum().backward()
    tile = x.narrow(2, sum(sizes[:rank]), sizes[rank]).clone().requires_grad_()
    try:  # create_graph=True is refused at once by the overlapped path
        (g,) = torch.autograd.grad(loss(par(tile)), tile, create_graph=True)
    except RuntimeError as exc:
        return str(exc)
    worst = (g - gd.narrow(2, sum(sizes[:rank]), sizes[rank])).abs().max().item() \
        if g.numel() else 0.0
    g.square().sum().backward()
    for p, q in zip(par.parameters(), dense.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)  # (a bias the penalty does not reach)
        if q.grad is not None:
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    return worst


def test_double_backward_through_the_general_path_equals_dense():
    assert max(run_distributed(_penalty, 2, True, [9, 8], timeout=T)) < 1e-10
    assert max(run_distributed(_penalty, 3, True, [1, 9, 6], timeout=T)) < 1e-10


@pytest.mark.parametrize("sizes", [[1, 0, 9], [0, 1, 9]])
@pytest.mark.parametrize("net", [_net, _normed_net])
@pytest.mark.parametrize("linear", [False, True])
def test_double_backward_with_an_empty_tile_equals_dense(sizes, net, linear):
    # the empty rank's first-order gradient had no graph: its peers waited for its
    # exchanges in the penalty's backward (and it raised "does not require grad"); with a
    # loss linear in the output they ran their input halo's backward, it did not
    assert max(run_distributed(_penalty, 3, True, sizes, net, linear, timeout=T)) < 1e-10


def _in_place_after_a_convolution(sizes):
    import copy

    rank = dist.get_rank()
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(inplace=True),
                          nn.Conv2d(3, 1, 3, padding=1)).double()
    par = parallelize_domain(copy.deepcopy(dense), dims=-2)
    x = torch.randn(2, 2, sum(sizes), 6, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    par(x.narrow(2, sum(sizes[:rank]), sizes[rank])).sum().backward()
    dense(x).sum().backward()
    return max((p.grad - q.grad).abs().max().item()
               for p, q in zip(par.parameters(), dense.parameters(), strict=True))


@pytest.mark.parametrize("sizes", [[1, 8], [5, 0, 4]])
def test_an_in_place_layer_after_a_convolution_on_a_narrow_or_empty_tile(sizes):
    assert max(run_distributed(_in_place_after_a_convolution, len(sizes), sizes,
                               timeout=T)) < 1e-10


def test_double_backward_through_overlapped_convolutions_is_refused_clearly():
    for message in run_distributed(_penalty, 2, False, [9, 8], timeout=T):
        assert "double_backward=True" in message


@pytest.mark.parametrize("sizes", [[5, 0, 4], [1, 9, 6]])
@pytest.mark.parametrize("net", [_net, _normed_net])
def test_double_backward_on_the_fast_paths_is_refused_on_every_rank(sizes, net):
    # a rank with an empty or a narrow tile takes another path than its peers: it went on
    # to its exchanges and waited there for the peers that had refused
    for message in run_distributed(_penalty, 3, False, sizes, net, timeout=T):
        assert "double_backward=True" in message


def _float32_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(),
                         nn.MaxPool2d(2), nn.Upsample(scale_factor=2, mode="bilinear"),
                         nn.Conv2d(4, 4, 3, padding=1), nn.InstanceNorm2d(4, affine=True),
                         nn.SiLU(), nn.Conv2d(4, 1, 1))


def _float32(sizes):
    rank = dist.get_rank()
    dense = _float32_net()
    x = torch.randn(2, 2, sum(sizes), 10, generator=torch.Generator().manual_seed(2)) * 3 + 1
    par = parallelize_domain(copy.deepcopy(dense), dims=-2)
    start = sum(sizes[:rank])
    xd = x.clone().requires_grad_()
    out_d = dense(xd)
    (out_d.square().sum() / x.numel()).backward()
    tile = x.narrow(2, start, sizes[rank]).clone().requires_grad_()
    out = par(tile)
    (out.square().sum() / x.numel()).backward()

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()

    worst = max(rel(out, out_d.narrow(2, start, sizes[rank])),
                rel(tile.grad, xd.grad.narrow(2, start, sizes[rank])))
    # against the largest gradient: a bias before a norm has a gradient that is zero in
    # exact arithmetic, so only rounding noise to compare with itself
    scale = max(q.grad.abs().max().item() for q in dense.parameters())
    for p, q in zip(par.parameters(), dense.parameters(), strict=True):
        worst = max(worst, (p.grad - q.grad).abs().max().item() / scale)
    for b, c in zip(par.buffers(), dense.buffers(), strict=True):
        worst = max(worst, rel(b.float(), c.float()))
    return worst


def test_fast_norms_and_upsampling_in_float32_match_dense():
    # float32 takes the group-norm statistics kernel (float64 takes var_mean)
    assert max(run_distributed(_float32, 2, [9, 7], timeout=T)) < 5e-6
    assert max(run_distributed(_float32, 3, [6, 4, 6], timeout=T)) < 5e-6


def _bfloat16_tile(kind):
    torch.manual_seed(0)
    norm = {"group": nn.GroupNorm(2, 4), "instance": nn.InstanceNorm2d(4, affine=True),
            "batch": nn.BatchNorm2d(4)}[kind]
    dense = nn.Sequential(norm)  # float32 parameters
    par = parallelize_domain(copy.deepcopy(dense), dims=-2)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 4, 8, 6, generator=g) * 3 + 1).bfloat16()
    probe = torch.randn(2, 4, 8, 6, generator=g)  # a loss whose input gradient is not ~0
    xd = x.clone().requires_grad_()
    out_d = dense(xd)
    (out_d.float() * probe).sum().backward()
    rank = dist.get_rank()
    rows = slice(4 * rank, 4 * rank + 4)
    tile = x[:, :, rows].clone().requires_grad_()
    out = par(tile)
    (out.float() * probe[:, :, rows]).sum().backward()
    assert out.dtype == out_d.dtype == torch.bfloat16

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    scale = max(q.grad.abs().max().item() for q in dense.parameters())
    return max(rel(out, out_d[:, :, rows]), rel(tile.grad, xd.grad[:, :, rows]),
               *[(p.grad - q.grad).abs().max().item() / scale
                 for p, q in zip(par.parameters(), dense.parameters(), strict=True)])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["group", "instance", "batch"])
def test_fast_norms_take_a_bfloat16_tile_with_float32_parameters(kind):
    # torch's mixed-precision norm kernels, as dense: bfloat16 out, float32 statistics
    assert max(run_distributed(_bfloat16_tile, 2, kind, timeout=T)) < 2e-2


def _strided_stack():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(),  # stride 1
                         nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Tanh(),  # down-sampling
                         nn.Conv2d(4, 4, 5, stride=2, padding=2), nn.Tanh(),
                         nn.Conv2d(4, 3, 3, padding=2, dilation=2), nn.Tanh(),
                         nn.Conv2d(3, 2, 3, stride=3, padding=1))


def _strided(sizes):
    """Largest difference from dense, and how many convolutions took the overlapped path."""
    from tensorpar.domain._tiles import overlap as _overlap

    taken = [0]
    apply = _overlap._HaloConv.apply

    def counted(*args):
        taken[0] += 1
        return apply(*args)

    _overlap._HaloConv.apply = counted
    try:
        worst = check(_strided_stack, (2, 2, sum(sizes), 11), [-2], [sizes])
    finally:
        _overlap._HaloConv.apply = apply
    return worst, taken[0]


@pytest.mark.parametrize("sizes", [[20, 19], [13, 13, 13], [30, 9]])
def test_strided_and_dilated_convolutions_compute_while_the_halo_travels(sizes):
    results = run_distributed(_strided, len(sizes), sizes, timeout=T)
    assert max(worst for worst, _ in results) < 1e-10
    # the strided layers take the overlapped path too (not only the first, stride-1 one)
    assert max(taken for _, taken in results) >= 3


def _in_validation_mode(sizes):
    import tensorpar

    with tensorpar.validation(True):  # every rank's exchange fingerprinted, either path
        return check(_strided_stack, (2, 2, sum(sizes), 11), [-2], [sizes])


@pytest.mark.parametrize("sizes", [[10, 7], [9, 8], [15, 2]])
def test_validation_mode_agrees_whichever_path_each_rank_takes(sizes):
    # uneven strips: one rank overlapped, its neighbour on the general path, or both
    # overlapped with different window lengths at stride 2
    assert max(run_distributed(_in_validation_mode, 2, sizes, timeout=T)) < 1e-10


def _unbatched(sizes, stride):
    rank = dist.get_rank()
    torch.manual_seed(0)
    dense = nn.Conv2d(2, 3, 3, padding=1, stride=(stride, 1)).double()
    par = parallelize_domain(copy.deepcopy(dense), dims=-2)
    x = torch.randn(2, sum(sizes), 7, dtype=torch.float64)  # (C, H, W): no batch dim
    xd = x.clone().requires_grad_()
    yd = dense(xd)
    probe = torch.randn(yd.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (yd * probe).sum().backward()
    tile = x.narrow(1, sum(sizes[:rank]), sizes[rank]).clone().requires_grad_()
    y = par(tile)
    rows = [(n + stride - 1) // stride for n in sizes]  # the strips of the output
    start = sum(rows[:rank])
    (y * probe.narrow(1, start, rows[rank])).sum().backward()
    return max((y - yd.narrow(1, start, rows[rank])).abs().max().item(),
               (tile.grad - xd.grad.narrow(1, sum(sizes[:rank]), sizes[rank])).abs().max().item(),
               (par.weight.grad - dense.weight.grad).abs().max().item())


@pytest.mark.parametrize("stride", [1, 2])
def test_an_unbatched_image_takes_the_overlapped_path_exactly(stride):
    assert max(run_distributed(_unbatched, 2, [8, 8], stride, timeout=T)) < 1e-10


def _autocast(stride):
    rank = dist.get_rank()
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, stride=(stride, 1)), nn.Tanh(),
                          nn.Conv2d(4, 2, 3, padding=1))
    par = parallelize_domain(copy.deepcopy(dense), dims=-2)
    x = torch.randn(2, 2, 16, 6, generator=torch.Generator().manual_seed(1))
    tile = x.narrow(2, 8 * rank, 8).clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = par(tile)
        yd = dense(x)
    y.float().square().sum().backward()  # the overlapped backward used to mix dtypes here
    return (y.float() - yd.float().narrow(2, 8 * rank // stride, y.shape[2])).abs().max().item()


@pytest.mark.parametrize("stride", [1, 2])
def test_convolutions_under_autocast_run_forward_and_backward_as_dense(stride):
    assert max(run_distributed(_autocast, 2, stride, timeout=T)) == 0.0
