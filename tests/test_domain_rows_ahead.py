"""Halo rows sent ahead with a norm's statistics, for the convolution after it.

From the second forward on, a convolution fed by a norm through pointwise calls takes its
halo rows from the norm's exchange (forward) and sends their gradient home in the norm's
exchange of sums (backward): two exchanges fewer per such pair and step. Every case is
held to dense over several SGD steps (the rows are sent from the second step on), so a
row dropped, a gradient not added back or a chain applied wrongly shows as a difference;
where the rows cannot go ahead (a call that is not pointwise, an in-place change, another
window) the convolution exchanges its own, still equal to dense.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tensorpar
from tensorpar.nn import parallelize_domain
from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(300)
T = 240


_BETWEEN = {
    "silu": F.silu,
    "relu_gelu": lambda y: F.gelu(F.relu(y)),
    "relu_inplace": lambda y: F.relu(y, inplace=True),
    "dropout0_leaky": lambda y: F.leaky_relu(F.dropout(y, 0.0, True), 0.1),  # MONAI's order
    "scaled": lambda y: 2 * y + 1,  # pointwise, but not a call the rows are carried through
    "inplace_add": lambda y: F.silu(y.add_(0.5)),  # an in-place change is not carried
}


class _Net(nn.Module):
    """Two norm -> pointwise calls -> convolution pairs; ``kind``: the calls of the first."""

    def __init__(self, kind, norm):
        super().__init__()
        self.kind = kind
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4) if norm == "batch" else \
            nn.GroupNorm(2, 4) if norm == "group" else nn.InstanceNorm2d(4, affine=True)
        self.conv2 = nn.Conv2d(4, 3, 3, padding=1)
        self.gn = nn.GroupNorm(3, 3)
        self.conv3 = nn.Conv2d(3, 2, 5, padding=2)

    def forward(self, x):
        y = _BETWEEN[self.kind](self.norm(self.conv1(x)))
        return self.conv3(torch.tanh(self.gn(self.conv2(y))))


def _build(kind, norm):
    torch.manual_seed(0)
    return _Net(kind, norm)


def _block(kind, norm="batch"):
    return functools.partial(_build, kind, norm)


def _circular():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU(),
                         nn.Conv2d(4, 3, 5, padding=2, padding_mode="circular"),
                         nn.InstanceNorm2d(3), nn.ReLU(),
                         nn.Conv2d(3, 2, 3, stride=2, padding=1))


@pytest.mark.parametrize("kind", ["silu", "relu_gelu", "relu_inplace", "dropout0_leaky", "scaled",
                                  "inplace_add"])
@pytest.mark.parametrize("norm", ["batch", "group", "instance"])
def test_a_norm_then_pointwise_calls_then_a_convolution_equals_dense(kind, norm):
    worst = run_distributed(check, 3, _block(kind, norm), (2, 2, 17, 6), (-2,),
                            ([6, 5, 6],), None, 3, timeout=T)
    assert max(worst) < 1e-10


@pytest.mark.parametrize("sizes", [[1, 9, 6], [7, 0, 9], [2, 2, 2, 10]])
def test_rows_ahead_from_two_ranks_away_and_past_an_empty_tile_equal_dense(sizes):
    worst = run_distributed(check, len(sizes), _block("silu"), (2, 2, sum(sizes), 5), (-2,),
                            (sizes,), None, 3, timeout=T)
    assert max(worst) < 1e-10


def test_rows_ahead_for_a_circular_and_a_strided_convolution_equal_dense():
    for sizes in ([9, 8], [5, 6, 6]):
        worst = run_distributed(check, len(sizes), _circular, (2, 2, sum(sizes), 6), (-2,),
                                (sizes,), None, 3, timeout=T)
        assert max(worst) < 1e-10


class _TwoConvs(nn.Module):
    """One norm before a 3 x 3 and a 5 x 5 convolution.

    ``shared``: called twice, once before each (the 3 x 3 one's output normed again);
    else its one output read by both.
    """

    def __init__(self, shared):
        super().__init__()
        self.shared = shared
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.conv_a = nn.Conv2d(4, 4 if shared else 2, 3, padding=1)
        self.conv_b = nn.Conv2d(4, 2, 5, padding=2)

    def forward(self, x):
        y = F.silu(self.norm(self.conv1(x)))
        if self.shared:
            return self.conv_b(F.silu(self.norm(self.conv_a(y))))
        return self.conv_a(y) + self.conv_b(y)


class _Switch(nn.Module):
    """A norm feeding a 3 x 3 convolution, or (``late``) a 1 x 1 one that needs no halo."""

    def __init__(self):
        super().__init__()
        self.late = False
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.conv = nn.Conv2d(4, 2, 3, padding=1)
        self.point = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        y = F.silu(self.norm(self.conv1(x)))
        return (self.point if self.late else self.conv)(y)


_MODELS = {"shared": functools.partial(_TwoConvs, True),
           "two_convs": functools.partial(_TwoConvs, False), "switch": _Switch}


def _counts_and_error(model, sizes, heights, late_from=None):
    """Exchanges and bytes per step, and the largest difference from dense, over steps.

    ``model``: a kind of `_Net` or one of `_MODELS`; a step of height ``heights[i]`` each;
    from step ``late_from`` on, ``late`` set on both models.
    """
    rank = dist.get_rank()
    torch.manual_seed(0)
    dense = (_MODELS[model]() if model in _MODELS else _Net(model, "batch")).double()
    par = parallelize_domain(copy.deepcopy(dense), dims=-2)
    counts, sent, worst = [], [], 0.0
    for step, h in enumerate(heights):
        if step == late_from:
            dense.late = par.late = True
        split = [h // len(sizes) + (r < h % len(sizes)) for r in range(len(sizes))] \
            if h != sum(sizes) else sizes
        x = torch.randn(2, 2, h, 6, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(step))
        start = sum(split[:rank])
        xd = x.clone().requires_grad_()
        dense(xd).square().sum().backward()
        tile = x.narrow(2, start, split[rank]).clone().requires_grad_()
        with tensorpar.CommCounter() as counter:
            par(tile).square().sum().backward()
        counts.append(counter.count())
        sent.append(counter.nbytes())
        worst = max(worst, (tile.grad - xd.grad.narrow(2, start, split[rank])).abs().max().item())
        for p, q in zip(par.parameters(), dense.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None)
            if q.grad is not None:  # (``_Switch`` leaves one convolution unused)
                worst = max(worst, (p.grad - q.grad).abs().max().item())
        par.zero_grad(set_to_none=True)
        dense.zero_grad(set_to_none=True)
    return counts, sent, worst


def test_the_rows_go_ahead_from_the_second_step_two_exchanges_fewer_per_norm_and_conv():
    # two norm -> pointwise -> convolution pairs: four exchanges fewer a step
    for counts, _, worst in run_distributed(_counts_and_error, 2, "silu", [9, 8], [17, 17, 17],
                                         timeout=T):
        assert worst < 1e-10
        assert counts[1] == counts[2] == counts[0] - 4, counts


def test_a_dropout_of_zero_is_carried():
    for counts, _, worst in run_distributed(_counts_and_error, 2, "dropout0_leaky", [9, 8],
                                         [17, 17], timeout=T):
        assert worst < 1e-10
        assert counts[1] == counts[0] - 4, counts


def test_a_call_that_is_not_carried_leaves_the_exchanges_as_they_were():
    for counts, _, worst in run_distributed(_counts_and_error, 2, "scaled", [9, 8], [17, 17],
                                         timeout=T):
        assert worst < 1e-10
        assert counts[1] == counts[0] - 2, counts  # the second pair only


def test_a_new_height_each_step_plans_the_rows_for_its_own_tiles():
    for counts, _, worst in run_distributed(_counts_and_error, 3, "silu", [6, 5, 6],
                                         [17, 23, 12, 17], timeout=T):
        assert worst < 1e-10
        assert counts[1:] == [counts[0] - 4] * 3, counts


def test_a_norm_called_twice_sends_each_call_the_rows_of_its_own_convolution():
    for counts, _, worst in run_distributed(_counts_and_error, 2, "shared", [9, 8],
                                            [17, 17, 17, 17], timeout=T):
        assert worst < 1e-10
        assert counts[1:] == [counts[0] - 4] * 3, counts


def test_an_output_read_by_two_convolutions_sends_the_rows_of_one_and_keeps_to_it():
    for counts, _, worst in run_distributed(_counts_and_error, 2, "two_convs", [9, 8],
                                            [17, 17, 17, 17], timeout=T):
        assert worst < 1e-10
        assert counts[1:] == [counts[0] - 2] * 3, counts


def test_rows_no_convolution_took_stop_being_sent():
    # steps 0-1: a 3 x 3 convolution after the norm (its rows go ahead from step 1);
    # steps 2-3: a 1 x 1 one, which takes none: step 2 still sends them, step 3 does not
    for counts, sent, worst in run_distributed(_counts_and_error, 2, "switch", [9, 8],
                                               [17, 17, 17, 17], 2, timeout=T):
        assert worst < 1e-10
        assert counts[1] == counts[0] - 2 and counts[2] == counts[3], counts
        assert sent[3] < sent[2], sent


def test_a_norm_that_goes_takes_its_requests_with_it():
    # requests are held by the norm object, not its address: a functional norm's layer
    # lives for one call, and a new object at a reused address on one rank (CPython reuses
    # them) must find no request there, as on every other rank (else the ranks' exchanges
    # differ: gloo aborted a rank on a functional group norm over tiles [4, 0, 8])
    from tensorpar.domain._tiles.ahead import Ahead, Rows

    class Norm:
        pass

    ahead, norm, window = Ahead(), Norm(), (2, ((2, 1, 1, 1, False),) * 2, "zeros")
    t = torch.zeros(3)
    ahead.offer(t, Rows(None, None, ahead.source(norm), t._version))
    assert ahead.take(t, window, True) is None  # (nothing sent yet: asks for the next forward)
    ahead.finish()
    assert ahead.request((norm, 0)) == window
    address = id(norm)
    del norm
    others = [Norm() for _ in range(64)]  # (one of them usually gets ``address``)
    assert all(ahead.request((o, 0)) is None for o in others), \
        [id(o) == address for o in others]


def _evaluated(norm, train, inference):
    """A forward (after a training step taught the norms their requests) under no_grad or
    inference_mode, equal to dense; then a training step still equal to dense."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dense = _build("silu", norm).double()
    par = parallelize_domain(copy.deepcopy(dense), dims=-2)
    worst = 0.0
    for step in range(3):
        x = torch.randn(2, 2, 11, 5, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(step))
        tile = x.tensor_split(world, -2)[rank]
        if step == 1:
            for m in (dense, par):
                m.train(train)
            with torch.inference_mode() if inference else torch.no_grad():
                got, want = par(tile), dense(x).tensor_split(world, -2)[rank]
            worst = max(worst, float((got - want).abs().max()))
            for m in (dense, par):
                m.train()
            continue
        dense.zero_grad()
        par.zero_grad()
        dense(x).square().sum().backward()
        par(tile).square().sum().backward()
        for p, q in zip(par.parameters(), dense.parameters(), strict=True):
            worst = max(worst, float((p.grad - q.grad).abs().max()))
    return worst


@pytest.mark.parametrize("inference", [True, False], ids=["inference_mode", "no_grad"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("norm", ["batch", "group", "instance"])
def test_an_evaluation_between_steps_equals_dense(norm, train, inference):
    """Inference tensors carry no version counter, which the rows sent ahead are kept by."""
    assert max(run_distributed(_evaluated, 2, norm, train, inference, timeout=T)) < 1e-10


def _mixed_modes():
    par = parallelize_domain(_build("silu", "group").double(), dims=-2)
    tile = torch.randn(1, 2, 4, 5, dtype=torch.float64)
    with torch.inference_mode() if dist.get_rank() == 0 else torch.no_grad():
        try:
            par(tile)
        except tensorpar.CollectiveArgumentError as e:
            return str(e)
    return "no error"


def test_inference_mode_on_some_ranks_only_raises_on_every_rank():
    for message in run_distributed(_mixed_modes, 2, timeout=T):
        assert "inference" in message, message
