"""Which dims of a reshaped tile hold the split dims' points (`tensorpar.domain._forward.points`):
each reshape a model writes, read from the call and the shapes alone."""

import pytest
import torch

from tensorpar.domain._forward.points import (
    einsum_points,
    follow,
    follow_block,
    pairs_points,
    reduced_dims,
)

T = torch.Tensor
x4 = torch.zeros(2, 3, 5, 7)  # (B, C, H, W), H split: points in dim 2


@pytest.mark.parametrize("call, want", [
    (lambda: (T.flatten, (x4, 2)), {2}),                      # (B, C, H * W)
    (lambda: (T.flatten, (x4, 1)), {1}),                      # (B, C * H * W)
    (lambda: (T.transpose, (x4, 1, 2)), {1}),
    (lambda: (T.permute, (x4, 0, 2, 3, 1)), {1}),             # channels-last
    (lambda: (T.permute, (x4, (0, 2, 3, 1))), {1}),
    (lambda: (T.movedim, (x4, 1, -1)), {1}),
    (lambda: (T.unsqueeze, (x4, 0)), {3}),
    (lambda: (T.view, (x4, 2, 3, 35)), {2}),                  # H and W merged
    (lambda: (T.reshape, (x4, 6, 35)), {1}),
    (lambda: (T.reshape, (x4, 2, 3, 5, 7, 1)), {2}),          # a trailing 1
    (lambda: (T.view, (x4, 2, 15, 7)), {1}),                  # C and H merged
    (lambda: (torch.relu, (x4,)), {2}),                       # pointwise: in place
])
def test_reshapes_are_followed(call, want):
    func, args = call()
    out = func(*args)
    assert follow(func, args, {}, frozenset({2}), x4.shape, out) == frozenset(want)


def test_a_dim_holding_points_split_in_two_is_unknown_without_its_block():
    tokens = torch.zeros(2, 35, 3)  # (B, H * W, C): which of (5, 7) holds the points?
    out = tokens.view(2, 5, 7, 3)
    assert follow(T.view, (tokens, 2, 5, 7, 3), {}, frozenset({1}), tokens.shape, out) is None


def _both(func, args, src, block):
    out = func(*args)
    x = args[0]
    held = follow(func, args, {}, frozenset(src), x.shape, out, block)
    return held, follow_block(func, args, {}, frozenset(src), block, x.shape, out)


x8 = torch.zeros(2, 3, 8, 5)  # an image whose tile has 8 split rows in dim 2


@pytest.mark.parametrize("call, src, block, want, want_block", [
    # tokens of an NCHW tile split along H, (B, h * w, C), back to a channels-last image
    (lambda: (T.view, (torch.zeros(2, 35, 3), 2, 5, 7, 3)), {1}, (1, 7), {1}, (1, 1)),
    # split along W: the rows are the inner part of each image row
    (lambda: (T.view, (torch.zeros(2, 35, 3), 2, 5, 7, 3)), {1}, (5, 1), {2}, (1, 1)),
    (lambda: (T.unflatten, (torch.zeros(2, 3, 35), 2, (5, 7))), {2}, (1, 7), {2}, (1, 1)),
    # the flatten that made them
    (lambda: (T.flatten, (x8, 2)), {2}, (1, 1), {2}, (1, 5)),
    (lambda: (T.flatten, (x8, 1)), {2}, (1, 1), {1}, (3, 5)),
    (lambda: (T.flatten, (x8, 3)), {2}, (1, 1), {2}, (1, 1)),   # W alone: nothing moves
    # windows of 2 and 4 rows: the first of the two dims counts them
    (lambda: (T.view, (x8, 2, 3, 4, 2, 5)), {2}, (1, 1), {2}, (1, 1)),
    (lambda: (T.view, (x8, 2, 3, 2, 4, 5)), {2}, (1, 1), {2}, (1, 1)),
    (lambda: (T.view, (x8, 2, 3, 4, 10)), {2}, (1, 1), {2}, (1, 1)),  # a window's rows flat
    # Swin's partition of tokens: windows of 2 x 5 (the tile's whole width)
    (lambda: (T.view, (torch.zeros(2, 40, 3), 2, 4, 2, 5, 3)), {1}, (1, 5), {1}, (1, 1)),
    # the outer part of the dim split off (its block says 2 x 4 rows)
    (lambda: (T.view, (x8, 2, 3, 2, 4, 5)), {2}, (2, 1), {3}, (1, 1)),
])
def test_a_split_of_the_points_dim_is_read_from_its_block(call, src, block, want, want_block):
    func, args = call()
    held, out_block = _both(func, args, src, block)
    assert held == frozenset(want)
    assert out_block == want_block


@pytest.mark.parametrize("call, src, block", [
    # the split rows cut across two dims: 5 rows of 7 tokens as 7 x 5
    (lambda: (T.view, (torch.zeros(2, 35, 3), 2, 7, 5, 3)), {1}, (1, 7)),
    # windows counted together with the channels (not read)
    (lambda: (T.view, (x8, 2, 6, 4, 5)), {2}, (1, 1)),
    # windows that do not divide the rows (torch would refuse it on a real tile)
    (lambda: (T.view, (torch.zeros(2, 3, 12, 5), 2, 3, 4, 3, 5)), {2}, (1, 2)),
])
def test_a_split_of_the_points_dim_it_cannot_read_is_unknown(call, src, block):
    func, args = call()
    held, out_block = _both(func, args, src, block)
    assert held is None
    assert out_block is None


def test_channel_splits_keep_the_points():
    tokens = torch.zeros(2, 35, 12)
    out = tokens.view(2, 35, 3, 4)  # heads
    assert follow(T.view, (tokens, 2, 35, 3, 4), {}, frozenset({1}), tokens.shape,
                  out) == frozenset({1})


def test_products_that_pair_or_sum_the_points():
    q = k = torch.zeros(2, 35, 4)  # tokens: points in dim 1
    kt = k.transpose(1, 2)  # points in dim 2
    assert pairs_points((q, kt), [frozenset({1}), frozenset({2})])  # q @ k^T: scores
    assert pairs_points((kt, q), [frozenset({2}), frozenset({1})])  # k^T @ v: a sum
    w = torch.zeros(4, 4)
    assert not pairs_points((q, w), [frozenset({1}), None])  # a linear map of channels


@pytest.mark.parametrize("call, want", [
    (lambda: (T.mean, (x4, -1)), {2}),                        # over W: H moves nowhere
    (lambda: (T.mean, (x4, 1)), {1}),                         # over C: H moves up
    (lambda: (T.amax, (x4, (0, 3))), {1}),
    (lambda: (T.sum, (x4, 3), {"keepdim": True}), {2}),
    (lambda: (torch.linalg.vector_norm, (x4, 2, 1)), {1}),   # dim is the third argument
    (lambda: (torch.softmax, (x4, 1)), {2}),                  # along C: the dims kept
    (lambda: (T.mean, (x4, 2)), None),                        # along the points
    (lambda: (T.mean, (x4,)), None),                          # the whole tensor
])
def test_reductions_along_other_dims_are_followed(call, want):
    func, args, *rest = call()
    kwargs = rest[0] if rest else {}
    out = func(*args, **kwargs)
    held = follow(func, args, kwargs, frozenset({2}), x4.shape, out)
    assert held == (None if want is None else frozenset(want))


def test_reduced_dims_read_from_the_call():
    assert reduced_dims(T.mean, (x4, (2, -1)), {}, 4) == frozenset({2, 3})
    assert reduced_dims(T.sum, (x4,), {}, 4) == frozenset({0, 1, 2, 3})  # the whole
    assert reduced_dims(T.sort, (x4,), {}, 4) == frozenset({3})  # its default: the last
    assert reduced_dims(torch.max, (x4, x4), {}, 4) is None  # elementwise
    assert reduced_dims(torch.relu, (x4,), {}, 4) is None


def test_einsum_subscripts_name_the_points():
    tile = torch.zeros(2, 3, 5, 7)
    image = {id(tile): frozenset({2})}

    def points(t):
        return image.get(id(t))
    w = torch.zeros(4, 3)
    assert einsum_points(("bchw,dc->bdhw", tile, w), points) == (frozenset({2}), False)
    assert einsum_points(("bchw->bwhc", tile), points) == (frozenset({2}), False)
    assert einsum_points(("bchw,bdhw->bcdhw", tile, tile), points) == (frozenset({3}), False)
    assert einsum_points(("bchw,bdgw->bcdhg", tile, tile), points)[1]  # points paired
    assert einsum_points(("bchw,bdhw->bcd", tile, tile), points)[1]  # summed over
    assert einsum_points(("bchw->bc", tile), points)[1]
    assert einsum_points(("...hw,dc->...dhw", tile, w), points) == (frozenset({3}), False)
    # no output: torch's implicit one, the letters used once, sorted
    assert einsum_points(("bchw", tile), points) == (frozenset({2}), False)
    assert einsum_points(("bchw,bdhw", tile, tile), points)[1]  # "->cd": summed over
    assert einsum_points(("bcii->bc", tile), points)[1]  # a diagonal of the points


def _points_of(t):
    return {id(x4): frozenset({2}), id(tokens3): frozenset({1})}.get(id(t))


tokens3 = torch.zeros(2, 35, 4)  # (B, tokens, C): points in dim 1


@pytest.mark.parametrize("equation, operands, want, refused", [
    ("...chw,dc->...dhw", (x4, torch.zeros(6, 3)), {2}, False),
    ("bc...,dc->bd...", (x4, torch.zeros(6, 3)), {2}, False),
    ("...hw,...hw->...hw", (x4, x4), {2}, False),
    ("bc...->bc", (x4,), set(), True),                          # a sum over the points
    ("...chw,...dgw->...cdhg", (x4, x4), {3}, True),            # pairs the points
    ("b...c,dc->b...d", (tokens3, torch.zeros(6, 4)), {1}, False),  # broadcast from the right
])
def test_einsum_with_an_ellipsis_is_read(equation, operands, want, refused):
    held, pairs = einsum_points((equation, *operands), _points_of)
    assert pairs == refused
    if not refused:
        assert held == frozenset(want)


@pytest.mark.parametrize("index, want", [
    ((slice(None), torch.tensor([[0, 1], [2, 0]])), {3}),    # (B, 2, 2, H, W)
    ((slice(None), [2, 0]), {2}),                             # (B, 2, H, W)
    ((slice(None), torch.tensor([True, False, True])), {2}),  # a mask over C
    ((torch.tensor([1, 0]), slice(None), slice(None), 0), {2}),
    ((slice(None), slice(None), slice(None), torch.tensor([[1], [0]])), {2}),  # along W
    ((slice(None), [0, 1], slice(None), [0, 1]), None),       # two: not read
    ((slice(None), torch.tensor([0.5])), None),               # not an index
])
def test_one_index_tensor_along_other_dims_is_read(index, want):
    try:
        out = x4[index]
    except IndexError:  # (a float index: what follow would see if torch took it)
        out = x4
    held = follow(T.__getitem__, (x4, index), {}, frozenset({2}), x4.shape, out)
    assert held == (None if want is None else frozenset(want))
