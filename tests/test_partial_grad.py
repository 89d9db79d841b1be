"""A partial-gradient parameter replaced by another tensor (what ``fully_shard`` does) gets
its gradient sum too; under ``torch.compile(fullgraph=True)`` an unhooked replacement is
refused, never silently left unsummed."""

import pytest
import torch
from torch import nn

from tensorpar.nn.partial_grad import install_partial_grad, partial_grad_group


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
