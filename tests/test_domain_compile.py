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


def _two_convs():
    return torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1),
                               torch.nn.Sequential(torch.nn.Conv2d(2, 1, 3, padding=1)))


def test_forward_keeps_its_signature_and_any_callable_forward_converts():
    import functools
    import inspect

    from tensorpar.nn import parallelize_domain

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 1, 3, padding=1)

        def forward(self, sample, timestep=None, return_dict: bool = True):
            """The model's own docstring."""
            return self.conv(sample)

    net = parallelize_domain(Net(), dims=-2)
    assert list(inspect.signature(net.forward).parameters) == ["sample", "timestep",
                                                               "return_dict"]
    assert net.forward.__doc__ == "The model's own docstring."
    wrapped = _two_convs()
    wrapped.forward = functools.partial(type(wrapped).forward, wrapped)  # as accelerate does
    x = torch.randn(1, 1, 5, 4)
    want = wrapped(x)
    torch.testing.assert_close(parallelize_domain(wrapped, dims=-2)(x), want)


def test_a_deep_copy_is_refused_with_the_way_out():
    import copy

    from tensorpar.nn import parallelize_domain

    net = parallelize_domain(_two_convs(), dims=-2)
    with pytest.raises(TypeError, match=r"cannot be deep-copied.*state_dict"):
        copy.deepcopy(net)
    dense = _two_convs()
    twin = parallelize_domain(copy.deepcopy(dense), dims=-2)
    twin.load_state_dict(net.state_dict())  # the documented way: same names
    x = torch.randn(1, 1, 5, 4)
    assert torch.equal(twin(x), net(x))


def test_a_compiled_submodule_is_refused_where_torch_cannot_switch_it_off(monkeypatch):
    from tensorpar.domain import parallelize as domain_parallelize
    from tensorpar.nn import parallelize_domain

    net = parallelize_domain(_two_convs(), dims=-2)
    net[1].compile(backend="aot_eager")
    monkeypatch.setattr(domain_parallelize, "FORCE_EAGER", False)  # as on torch < 2.6
    with pytest.raises(RuntimeError, match="1 is compiled"):
        net(torch.randn(1, 1, 5, 4))
    net[1]._compiled_call_impl = None
    net.compile(backend="aot_eager")  # the whole model: its forward runs between graphs
    assert net(torch.randn(1, 1, 5, 4)).shape == (1, 1, 5, 4)
