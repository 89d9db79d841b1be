"""Products that sum tiles over every point they hold are the domain's sums: a Gram matrix
(``einsum("bchw,bdhw->bcd")``, a style loss's), linear attention's ``k^T v`` over tokens,
a one-operand ``einsum`` summing over the points; each equals dense, on strips (with a
one-row and an empty tile) and on a mesh. Products that would pair points dense does not
pair (operands laid out differently, a weight indexed by the points, an output keeping
some points) are still refused on every rank."""

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check, check_or_error

pytestmark = pytest.mark.timeout(600)
T = 300
Head = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class Contracted(nn.Module):
    """A convolution, then ``head(self, features)``: the product under test."""

    def __init__(self, head: Head) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(2, 4, 3, padding=1), nn.Linear(4, 3)
        self.q, self.k = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self, self.conv(x))


def _linear_attention(m: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """``q (k^T v) / 40`` over tokens: summed over every point, then per point again."""
    q, k, v = (t.flatten(2).transpose(1, 2) for t in (m.q(y), m.k(y), y))
    kv = torch.bmm(k.transpose(1, 2), v)  # (B, C, C): the domain's sum
    return (q @ kv).transpose(1, 2).reshape(y.shape) / 40.0


CONVERTED: dict[str, Head] = {
    "Gram matrix of one tile": lambda m, y: m.fc(torch.einsum("bchw,bdhw->bcd", y, y).sum(-1)),
    "Gram matrix of two tiles": lambda m, y: m.fc(
        torch.einsum("bchw,bdhw->bcd", y, m.q(y).tanh()).mean(-1)),
    "one operand summed over the points": lambda m, y: m.fc(torch.einsum("bchw->bc", y)),
    "a Gram matrix without ->": lambda m, y: m.fc(torch.einsum("bchw,bdhw", y, y).sum(-1)),
    "one operand summed over every dim": lambda m, y: y * torch.einsum("bchw->", y) / 100,
    "a tile against its transpose, by subscripts": lambda m, y: m.fc(
        torch.einsum("bchw,bcwh->bc", y, y.transpose(2, 3))),
    "an ellipsis summed over": lambda m, y: m.fc(torch.einsum("bc...->bc", y)),
    "operands as a list, summed over rows only": lambda m, y: m.fc(
        torch.einsum("bchw,bchv->bcwv", [y, y]).mean((2, 3))),
    "k^T v over tokens": lambda m, y: m.fc(
        (m.k(y).flatten(2) @ y.flatten(2).transpose(1, 2)).sum(-1)),
    "linear attention (pooled back into the tokens)": _linear_attention,
}
"""Each equals dense."""

_TILES_OUT = ("one operand summed over every dim", "linear attention (pooled back into the tokens)")


def _converted(case, sizes):
    return check(lambda: Contracted(CONVERTED[case]), (2, 2, sum(sizes), 5), (-2,), (sizes,),
                 steps=2, replicated=case not in _TILES_OUT)


@pytest.mark.parametrize("case", sorted(CONVERTED))
def test_products_summing_every_point_equal_dense(case):
    assert max(run_distributed(_converted, 2, case, [5, 7], timeout=T)) < 1e-10
    assert max(run_distributed(_converted, 3, case, [4, 0, 8], timeout=T)) < 1e-10
    assert max(run_distributed(_converted, 2, case, [1, 11], timeout=T)) < 1e-10


def _on_mesh(case):
    return check(lambda: Contracted(CONVERTED[case]), (2, 2, 6, 7), (-2, -1), ([2, 4], [4, 3]),
                 mesh_shape=(2, 2), steps=1, replicated=case not in _TILES_OUT)


@pytest.mark.parametrize("case", ["Gram matrix of two tiles", "k^T v over tokens",
                                  "one operand summed over every dim",
                                  "linear attention (pooled back into the tokens)"])
def test_products_summing_every_point_of_a_mesh_equal_dense(case):
    assert max(run_distributed(_on_mesh, 4, case, timeout=T)) < 1e-10


class PhysicsAttention(nn.Module):
    """Transolver's physics attention over an image's points (its tokens), as written there.

    Each point is softly assigned to ``slices`` slices (a softmax per point); a slice's
    token is the weighted mean of its points (a sum over every point); the slices attend
    to each other; each point takes back its slices' outputs (pooled features into the
    tokens).
    """

    def __init__(self, channels: int = 4, heads: int = 2, slices: int = 3) -> None:
        super().__init__()
        self.heads, self.dim = heads, channels // heads
        self.embed = nn.Conv2d(2, channels, 3, padding=1)
        self.proj_x, self.proj_fx = nn.Linear(channels, channels), nn.Linear(channels, channels)
        self.slice = nn.Linear(self.dim, slices)
        self.qkv = nn.Linear(self.dim, 3 * self.dim)
        self.out = nn.Linear(channels, 2)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        y = self.embed(image)
        b, c, h, w = y.shape
        x = y.flatten(2).transpose(1, 2)  # (B, N, C)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, -1, self.heads, self.dim).permute(0, 2, 1, 3)  # (B, H, N, D)
        fx, weights = heads(self.proj_fx(x)), self.slice(heads(self.proj_x(x))).softmax(-1)
        norm = weights.sum(2)  # (B, H, G): over every point
        tokens = torch.einsum("bhnc,bhng->bhgc", fx, weights) / (norm[..., None] + 1e-5)
        q, k, v = self.qkv(tokens).chunk(3, -1)
        attended = torch.softmax(q @ k.transpose(-1, -2) / self.dim ** 0.5, -1) @ v
        out = torch.einsum("bhgc,bhng->bhnc", attended, weights)  # back to the points
        out = out.permute(0, 2, 1, 3).reshape(b, -1, c)
        return self.out(out).transpose(1, 2).reshape(b, 2, h, w)


def _physics_attention(sizes, mesh):
    if mesh:
        return check(PhysicsAttention, (2, 2, 6, 7), (-2, -1), ([2, 4], [4, 3]),
                     mesh_shape=(2, 2), steps=2)
    return check(PhysicsAttention, (2, 2, sum(sizes), 5), (-2,), (sizes,), steps=2)


def test_transolver_physics_attention_equals_dense():
    assert max(run_distributed(_physics_attention, 2, [5, 7], False, timeout=T)) < 1e-10
    assert max(run_distributed(_physics_attention, 3, [4, 0, 8], False, timeout=T)) < 1e-10
    assert max(run_distributed(_physics_attention, 4, None, True, timeout=T)) < 1e-10


REFUSED: dict[str, Head] = {
    "tokens of a tile against its transpose's": lambda m, y: m.fc(
        (y.flatten(2) @ y.transpose(2, 3).flatten(2).transpose(1, 2)).sum(-1)),
    "a tile against its transpose on a mesh": lambda m, y: m.fc(
        torch.einsum("bchw,bcwh->bc", y, y.transpose(2, 3))),
    "a weight indexed by the points": lambda m, y: m.fc(
        torch.einsum("bchw,h->bc", y, torch.ones(y.shape[2], dtype=y.dtype))),
    "a trace over the points": lambda m, y: m.fc(torch.einsum("bcii->bc", y)),
    "a trace of two tiles over the points": lambda m, y: m.fc(
        torch.einsum("bcii,bcii->bc", y, m.q(y))),
    "a diagonal of the points kept": lambda m, y: torch.einsum("bcii->bci", y).sum(-1),
    "a product keeping the columns on a mesh": lambda m, y: m.fc(
        torch.einsum("bchw,bdhw->bcdw", y, y).sum((2, 3))),
}
"""Each would pair or sum points as dense does not (or lies in a layout not read on a
mesh: a transposed tile): refused on every rank."""


def _refused(case, mesh, hs, ws):
    build = lambda: Contracted(REFUSED[case])  # noqa: E731
    out = check_or_error(build, hs, ws, (2, 2) if mesh else None)
    assert isinstance(out, str) and "points" in out, out
    return True


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_products_pairing_points_otherwise_are_refused(case):
    # square images (a trace needs them), tiles of other shapes; a full and an empty tile
    if case.endswith("on a mesh"):
        assert all(run_distributed(_refused, 4, case, True, [3, 3], [2, 4], timeout=T))
        return
    assert all(run_distributed(_refused, 3, case, False, [1, 0, 6], [7], timeout=T))
    assert all(run_distributed(_refused, 2, case, False, [8, 0], [8], timeout=T))
    if case.startswith("a trace"):  # (square tiles: the tiles' own diagonals would fit)
        assert all(run_distributed(_refused, 4, case, True, [4, 4], [4, 4], timeout=T))


def _channels_first_against_last(m: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """Two tiles' every element paired in another order: channels first, channels last."""
    a, b = y.flatten(1), m.q(y).permute(0, 2, 3, 1).flatten(1)
    return m.fc(y.mean((2, 3)) * (a.unsqueeze(1) @ b.unsqueeze(2))[:, 0])


def _orders_differ(hs, ws):
    out = check_or_error(lambda: Contracted(_channels_first_against_last), hs, ws, (2, 2))
    assert isinstance(out, str) and "points" in out, out
    return True


def test_layouts_read_alike_only_on_some_ranks_are_refused_on_every_rank():
    # an empty tile's tokens do not say where their channels lie: its rank reads the two
    # layouts as equal where the others do not (it summed while they raised, and hung)
    assert all(run_distributed(_orders_differ, 4, [0, 6], [4, 3], timeout=T))
    assert all(run_distributed(_orders_differ, 4, [3, 3], [4, 3], timeout=T))


def _penalty(case, sizes):
    """A gradient penalty through the product (``double_backward=True``) against dense."""
    import copy

    from tensorpar.nn import parallelize_domain
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    dense = (PhysicsAttention() if case == "Transolver" else Contracted(CONVERTED[case])).double()
    x = torch.randn(2, 2, sum(sizes), 5, dtype=torch.float64)
    par = parallelize_domain(copy.deepcopy(dense), dims=-2, double_backward=True)
    xd = x.clone().requires_grad_()
    out_d = dense(xd)
    (gd,) = torch.autograd.grad(out_d.square().sum(), xd, create_graph=True)
    (gd.square().sum() + out_d.sum()).backward()
    tile = x.narrow(2, sum(sizes[:rank]), sizes[rank]).clone().requires_grad_()
    out = par(tile)  # a replicated output's loss is every rank's, a tile's its part
    (g,) = torch.autograd.grad(out.square().sum(), tile, create_graph=True)
    (g.square().sum() + out.sum()).backward()
    want = gd.narrow(2, sum(sizes[:rank]), sizes[rank])
    worst = float((g - want).abs().amax()) if g.numel() else 0.0
    for p, q in zip(par.parameters(), dense.parameters(), strict=True):
        if q.grad is None:  # (a layer the head does not use)
            assert p.grad is None
            continue
        # relative where the gradient is large (a Gram matrix squared reaches 1e4)
        worst = max(worst, float((p.grad - q.grad).abs().amax() / q.grad.abs().amax().clamp(min=1)))
    return worst


@pytest.mark.parametrize("case", ["Gram matrix of one tile", "Transolver",
                                  "linear attention (pooled back into the tokens)"])
def test_gradient_penalty_through_products_over_every_point(case):
    assert max(run_distributed(_penalty, 2, case, [5, 7], timeout=T)) < 1e-10
    assert max(run_distributed(_penalty, 3, case, [4, 0, 8], timeout=T)) < 1e-10
