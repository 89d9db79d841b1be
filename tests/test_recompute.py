"""A recomputed module (sequence parallelism's norms) gives the same values and gradients and
keeps only its input for backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.nn.layers._recompute import install_recompute


class NormThenDropout(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.norm(x), p=0.3, training=self.training)


class RMSNorm(nn.Module):  # transformers' Llama norm, in short
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


def _saved(fn):
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved.values())


@pytest.mark.parametrize("make", [lambda: nn.LayerNorm(6, dtype=torch.float64),
                                  lambda: RMSNorm(6), lambda: NormThenDropout(6).double()])
def test_recomputed_module_gives_the_same_values_and_gradients(make):
    torch.manual_seed(0)
    plain = make()
    recomputed = copy.deepcopy(plain)
    install_recompute(recomputed)
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    grad = torch.randn(3, 5, 6, dtype=torch.float64)
    results = []
    for module in (plain, recomputed):
        xi = x.clone().requires_grad_()
        torch.manual_seed(1)  # the same dropout mask in both forwards
        out = module(xi)
        torch.manual_seed(7)  # backward must replay forward's random state, not this one
        out.backward(grad)
        results.append((out, xi.grad, [p.grad for p in module.parameters()]))
    (out0, gx0, gp0), (out1, gx1, gp1) = results
    assert torch.equal(out0, out1)
    assert torch.equal(gx0, gx1)
    assert all(torch.equal(a, b) for a, b in zip(gp0, gp1, strict=True))


def test_recomputed_norm_saves_only_its_input():
    torch.manual_seed(0)
    plain = RMSNorm(64)
    recomputed = copy.deepcopy(plain)
    install_recompute(recomputed)
    x = torch.randn(4, 32, 64, dtype=torch.float64, requires_grad=True)
    _, before = _saved(lambda: plain(x))
    _, after = _saved(lambda: recomputed(x))
    assert after == x.numel() * x.element_size()  # the input alone
    assert before >= 1.5 * after  # a float32 copy of the input, the rsqrt, the normalised x


def test_recompute_steps_aside_without_a_graph_or_with_other_arguments():
    norm = nn.LayerNorm(4, dtype=torch.float64)
    install_recompute(norm)
    x = torch.randn(2, 4, dtype=torch.float64)
    with torch.no_grad():
        assert norm(x).grad_fn is None
    frozen = nn.LayerNorm(4, dtype=torch.float64).requires_grad_(False)
    install_recompute(frozen)
    assert frozen(x).grad_fn is None  # nothing to differentiate
    out = norm(x)
    assert type(out.grad_fn).__name__ == "_RecomputedBackward"


def test_recomputed_module_supports_a_second_derivative():
    torch.manual_seed(0)
    plain = nn.LayerNorm(5, dtype=torch.float64)
    recomputed = copy.deepcopy(plain)
    install_recompute(recomputed)
    x = torch.randn(3, 5, dtype=torch.float64)
    second = []
    for module in (plain, recomputed):
        xi = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(module(xi).sin().sum(), xi, create_graph=True)
        second.append(torch.autograd.grad(g.pow(2).sum(), [xi, module.weight, module.bias]))
    for a, b in zip(*second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_recomputed_module_under_autocast_matches_plain():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    recomputed = copy.deepcopy(plain)
    install_recompute(recomputed)
    x = torch.randn(4, 8)
    grads = []
    for module in (plain, recomputed):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        out.float().sum().backward()
        grads.append([p.grad for p in module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_a_parameter_gradient_hook_fires_once_per_backward():
    # a partial gradient's all-reduce is such a hook: firing inside the replay as well as
    # in the outer backward summed the gradient twice
    norm = nn.LayerNorm(4, dtype=torch.float64)
    install_recompute(norm)
    calls = []
    norm.weight.register_hook(lambda g: calls.append(1) or g * 2)
    x = torch.randn(3, 4, dtype=torch.float64)
    norm(x).sum().backward()
    expected = 2 * torch.nn.functional.layer_norm(x, (4,)).sum(0)
    assert calls == [1]
    torch.testing.assert_close(norm.weight.grad, expected, rtol=0, atol=1e-12)


def test_a_copy_recomputes_with_its_own_parameters():
    norm = nn.LayerNorm(4, dtype=torch.float64)
    install_recompute(norm)
    install_recompute(norm)  # installing twice changes nothing
    twin = copy.deepcopy(norm)
    with torch.no_grad():
        twin.weight.mul_(3)
    x = torch.randn(2, 4, dtype=torch.float64)
    twin(x).sum().backward()
    reference = nn.LayerNorm(4, dtype=torch.float64)
    reference.load_state_dict(twin.state_dict())
    reference(x).sum().backward()
    torch.testing.assert_close(twin(x), reference(x), rtol=0, atol=0)
    assert norm.weight.grad is None and twin.weight.grad is not None
    torch.testing.assert_close(twin.bias.grad, reference.bias.grad, rtol=0, atol=0)
