"""A partial-gradient parameter replaced by another tensor (what ``fully_shard`` does) gets
its gradient sum too; under ``torch.compile(fullgraph=True)`` an unhooked replacement is
refused, never silently left unsummed."""

import pytest
import torch
from torch import nn

from tensorpar.nn.state.partial_grad import install_partial_grad, partial_grad_group
from tensorpar.testing import run_distributed


def _replace_weight(norm: nn.LayerNorm) -> None:
    norm.weight = nn.Parameter(norm.weight.detach().clone())


def test_a_replaced_parameter_is_hooked_at_the_next_forward():
    norm = nn.LayerNorm(4)
    install_partial_grad(norm)
    _replace_weight(norm)
    assert partial_grad_group(norm.weight) is None
    norm(torch.randn(2, 4)).sum().backward()
    assert partial_grad_group(norm.weight) is not None
    assert partial_grad_group(norm.bias) is not None  # the untouched one keeps its hook


@pytest.mark.timeout(120)
def test_a_replaced_parameter_under_fullgraph_compile_is_refused():
    norm = nn.LayerNorm(4)
    install_partial_grad(norm)
    _replace_weight(norm)
    compiled = torch.compile(norm, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="replaced"):
        compiled(torch.randn(2, 4))
    torch._dynamo.reset()


@pytest.mark.timeout(120)
def test_a_replaced_parameter_under_compile_is_hooked_eagerly():
    norm = nn.LayerNorm(4)
    install_partial_grad(norm)
    _replace_weight(norm)
    torch.compile(norm, backend="aot_eager")(torch.randn(2, 4)).sum().backward()
    assert partial_grad_group(norm.weight) is not None
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------
# the sum itself, on 2 and 3 ranks: each rank's rows are its part of the dense batch
# ---------------------------------------------------------------------------------------

def _rows(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(rank + 2, 5, generator=g, dtype=torch.float64)  # uneven parts


def _norm():
    torch.manual_seed(0)
    norm = nn.LayerNorm(5).double()
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    return norm


def _loss(out, rank):
    g = torch.Generator().manual_seed(100 + rank)
    return (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()


def _partial_sum(mode):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    norm = _norm()
    install_partial_grad(norm)
    if mode != "eager":
        _replace_weight(norm)  # hooked again at the next forward (eagerly under compile)
    run = torch.compile(norm, backend="aot_eager") if mode == "compiled" else norm
    _loss(run(_rows(rank)), rank).backward()
    dense = _norm()
    sum(_loss(dense(_rows(r)), r) for r in range(world)).backward()
    for name, p in norm.named_parameters():
        torch.testing.assert_close(p.grad, dense.get_parameter(name).grad, rtol=1e-12,
                                   atol=1e-12, msg=f"{mode}: {name} at world size {world}")
    torch._dynamo.reset()
    return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["eager", "replaced",
                                  pytest.param("compiled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("world", [2, 3])
def test_partial_gradients_are_summed_over_the_group_as_dense(world, mode):
    assert all(run_distributed(_partial_sum, world, mode, timeout=240))
