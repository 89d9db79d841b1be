"""A backward pass in two halves (the zero-bubble schedule's B and W) equals one backward."""

import copy

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge as edge_of

from tensorpar.pipeline.split_backward import backward_input


class Reused(nn.Module):
    """One weight used three times on the activation path and once off it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
        self.unused = nn.Parameter(torch.randn(2, dtype=torch.float64))

    def forward(self, x):
        return torch.tanh(x @ self.w) @ self.w.t() + self.w.sum() * x @ self.w


class Scale(torch.autograd.Function):
    """A custom Function taking a weight: it cannot tell which gradients were asked for."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, dtype=torch.float64))

    def forward(self, x):
        return Scale.apply(x, self.w)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.GELU(), Reused(), nn.LayerNorm(4), Custom(),
                         nn.Linear(4, 4)).double()


@pytest.mark.parametrize("as_leaf", [True, False])
def test_halves_equal_one_backward(as_leaf):
    dense, split = model(), model()
    x = torch.randn(5, 4, dtype=torch.float64)
    xd = x.clone().requires_grad_()
    dense(xd).pow(2).sum().backward()

    base = torch.zeros(5, 4, dtype=torch.float64, requires_grad=True)
    xs = base + x if not as_leaf else x.clone().requires_grad_()  # a leaf, or a node
    out = split(xs).pow(2).sum()
    w = backward_input(out, None, [edge_of(xs)])
    assert all(p.grad is None for p in split.parameters())  # B computed no weight gradient
    # groups: each linear (weight, bias), the reused weight, the norm, the custom weight
    assert len(w.groups) == 5
    w.run()
    w.run()  # once only
    for (name, p), q in zip(split.named_parameters(), dense.parameters(), strict=True):
        if name == "2.unused":
            assert p.grad is None and q.grad is None
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-13, msg=name)
    if not as_leaf:
        assert base.grad is None  # B stops at the input: what lies below it is not run


def test_gradients_add_to_what_is_there():
    dense, split = model(), model()
    for m in (dense, split):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    dense(x).sum().backward()
    xs = x.detach().clone().requires_grad_()
    backward_input(split(xs).sum(), None, [edge_of(xs)]).run()
    for p, q in zip(split.parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-13)


def test_without_a_differentiable_input_the_whole_backward_waits_for_w():
    # the first stage (token ids, or a batch that needs no gradient): no one waits for B
    dense, split = model(), model()
    x = torch.randn(3, 4, dtype=torch.float64)
    dense(x).sum().backward()
    w = backward_input(split(x).sum(), None, [])
    assert w.groups == [] and all(p.grad is None for p in split.parameters())
    w.run()
    w.run()  # once only
    for p, q in zip(split.parameters(), dense.parameters(), strict=True):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-13)


def test_an_output_without_a_graph_does_nothing():
    w = backward_input(torch.ones(2), None, [])
    assert w.groups == []
    w.run()


def test_the_split_is_the_same_arithmetic():
    # a deep copy run once through backward() and once in halves: bitwise equal
    dense = model()
    split = copy.deepcopy(dense)
    x = torch.randn(6, 4, dtype=torch.float64)
    xd, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    dense(xd).square().mean().backward()
    backward_input(split(xs).square().mean(), None, [edge_of(xs)]).run()
    for p, q in zip(split.parameters(), dense.parameters(), strict=True):
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpoints(reentrant):
    # reentrant: its own backward inside the graph cannot be split, so B runs everything;
    # non-reentrant: split like any graph
    from torch.utils.checkpoint import checkpoint

    dense, split = model(), model()
    x = torch.randn(3, 4, dtype=torch.float64)
    xd, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    checkpoint(dense, xd, use_reentrant=reentrant).sum().backward()
    w = backward_input(checkpoint(split, xs, use_reentrant=reentrant).sum(), None,
                       [edge_of(xs)])
    assert xs.grad is not None if reentrant else xs.grad is None  # .grad only if it ran whole
    assert (w.groups == []) == reentrant
    w.run()
    for p, q in zip(split.parameters(), dense.parameters(), strict=True):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-13)


def test_gradients_are_tensors_of_their_own():
    # x + p1 + p2 hands both weights the same gradient tensor, and p3.sum() a broadcast
    # view: each .grad must be a tensor of its own, added to by the next microbatch
    torch.manual_seed(0)
    p1, p2 = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    p3 = torch.randn(4, dtype=torch.float64, requires_grad=True)
    dense = [t.detach().clone().requires_grad_() for t in (p1, p2, p3)]

    def f(x, a, b, c):
        return ((x + a + b) * c.sum()).square().sum()

    for _ in range(2):  # two microbatches accumulate
        x = torch.randn(3, 4, dtype=torch.float64)
        f(x, *dense).backward()
        xs = x.clone().requires_grad_()
        backward_input(f(xs, p1, p2, p3), None, [edge_of(xs)]).run()
    assert p1.grad is not p2.grad and p3.grad.stride() == (1,)
    for p, q in zip((p1, p2, p3), dense, strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)


def test_every_leaf_that_needs_a_gradient_gets_it():
    # a temperature held by a loss function, not a module's parameter
    dense, split = model(), model()
    t_dense, t_split = (torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
                        for _ in range(2))
    x = torch.randn(3, 4, dtype=torch.float64)
    (dense(x.clone().requires_grad_()) * t_dense).sum().backward()
    xs = x.clone().requires_grad_()
    backward_input((split(xs) * t_split).sum(), None, [edge_of(xs)]).run()
    torch.testing.assert_close(t_split.grad, t_dense.grad, rtol=0, atol=1e-13)
