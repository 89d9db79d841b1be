"""``torch.compile`` of a domain-parallel model: the converted layers (halo exchanges,
statistics over the domain, functional pads and resizes) run eagerly between graphs, the
rest compiles; outputs, gradients, running statistics and SGD steps equal the dense model
(float64, within 1e-10), at 2 and 3 ranks, with uneven and narrow tiles."""

import pytest
import torch

from tensorpar.testing import run_distributed
from tests._domain_check import check
from tests.test_domain_layers import BUILDERS, DIMS, SHAPES

pytestmark = pytest.mark.timeout(900)
T = 600
TOL = 1e-10


def _run(name, sizes, backend, steps=0):
    torch._dynamo.reset()
    shape = list(SHAPES.get(name, (2, 2, None, 6)))
    shape[shape.index(None)] = sum(sizes)
    return check(BUILDERS[name], shape, (DIMS.get(name, -2),), (sizes,), steps=steps,
                 replicated=name == "head", compile_backend=backend)


@pytest.mark.parametrize("name", ["norms", "padding", "resample", "head"])
def test_compiled_layers_two_ranks(name):
    assert max(run_distributed(_run, 2, name, [9, 8], "aot_eager", 2, timeout=T)) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_compiled_layers_three_ranks_narrow_tile(name):
    sizes = [5, 1, 11] if name not in ("volume", "line") else [3, 1, 4]
    assert max(run_distributed(_run, 3, name, sizes, "aot_eager", 2, timeout=T)) < TOL


@pytest.mark.slow
def test_compiled_with_inductor():
    assert max(run_distributed(_run, 2, "norms", [9, 8], "inductor", 2, timeout=T)) < TOL


def _compiled_blocks(sizes):
    """The padding model with each of its blocks compiled on its own after conversion."""
    import copy

    import torch.distributed as dist

    from tensorpar.nn import domain_layout, parallelize_domain
    from tests._domain_check import tile_of
    from tests.test_domain_layers import Pad

    torch._dynamo.reset()
    torch.manual_seed(0)
    dense = BUILDERS["padding"]().double()
    par = parallelize_domain(copy.deepcopy(dense), dims=-2)
    blocks = [m for m in par.modules() if isinstance(m, Pad)]
    for m in blocks:
        m.compile(backend="aot_eager")
    x = torch.randn(2, 2, sum(sizes), 6, dtype=torch.float64)
    xd = x.clone().requires_grad_(True)
    out_d = dense(xd)
    out_d.square().sum().backward()
    xt = tile_of(x, [-2], [sizes], [dist.get_rank()]).clone().requires_grad_(True)
    out = par(xt)
    out.square().sum().backward()
    want = tile_of(out_d, [-2], [domain_layout(par)[0][out_d.shape[-2]]], [dist.get_rank()])
    assert out.shape == want.shape, (out.shape, want.shape)
    worst = float((out - want).abs().max())
    worst = max(worst, float((xt.grad - tile_of(xd.grad, [-2], [sizes],
                                                  [dist.get_rank()])).abs().max()))
    pd = dict(dense.named_parameters())
    for name, p in par.named_parameters():
        worst = max(worst, float((p.grad - pd[name].grad).abs().max()))
    return worst, len(blocks)


def test_compiled_submodules_run_eagerly_inside_the_model():
    """A block compiled on its own would pad every tile as if it were the whole domain."""
    for worst, blocks in run_distributed(_compiled_blocks, 2, [9, 8], timeout=T):
        assert blocks == 4
        assert worst < TOL
