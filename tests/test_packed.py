"""Packed (block-wise) column splits, transformers' Conv1D layers and custom builders."""

import pytest
import torch
from torch import nn

import tensorpar as tp
from tensorpar.nn import ColumnParallelLinear, PackedColwise
from tensorpar.testing import run_distributed

DIM, HEAD = 10, 2
Q, KV = 12 * HEAD, 3 * HEAD  # 12 query heads, 3 key/value heads: 4 query heads per kv head
BLOCKS, UNITS = (Q, KV, KV), (4 * HEAD, HEAD, HEAD)


def _packed_linear():
    torch.manual_seed(0)
    dense = nn.Linear(DIM, Q + 2 * KV).double()
    layer = ColumnParallelLinear.from_dense(dense, blocks=BLOCKS, multiple_of=UNITS)
    gathered = ColumnParallelLinear.from_dense(dense, blocks=BLOCKS, multiple_of=UNITS,
                                               gather_output=True)
    x = torch.randn(3, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2),
                    requires_grad=True)  # the same on every rank, whatever the layers drew
    y_dense = dense(x)
    pieces = layer.shard.pieces
    expected = torch.cat([y_dense[:, start: start + n] for start, _, n in pieces], -1)
    y = layer(x)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gathered(x), y_dense, rtol=1e-12, atol=1e-12)  # dense order
    # gradients: the same loss on the local slice equals the dense one on those features
    weight = torch.randn(y_dense.shape, dtype=torch.float64, generator=torch.Generator()
                         .manual_seed(1))
    local_w = torch.cat([weight[:, start: start + n] for start, _, n in pieces], -1)
    (y * local_w).sum().backward()
    (y_dense * weight).sum().backward()
    grad_rows = torch.cat([dense.weight.grad[start: start + n] for start, _, n in pieces])
    torch.testing.assert_close(layer.weight.grad, grad_rows, rtol=1e-12, atol=1e-12)
    # full state in the dense layout; loading a dense state gives the right shard
    full = layer.full_state()
    torch.manual_seed(5)
    other = nn.Linear(DIM, Q + 2 * KV).double()
    layer.load_full_state({k: v for k, v in other.state_dict().items()} if
                          layer.shard.group.rank == 0 else {})
    rows = torch.cat([other.weight[start: start + n] for start, _, n in pieces])
    q_heads, k_heads = pieces[0][2] // HEAD, pieces[1][2] // HEAD
    return (torch.equal(layer.weight, rows), [n for _, _, n in pieces], q_heads == 4 * k_heads,
            None if not isinstance(full["weight"], torch.Tensor)
            else torch.equal(full["weight"], dense.weight))


@pytest.mark.parametrize("world_size, widths", [(1, [24, 6, 6]), (2, [16, 4, 4]),
                                                (3, [8, 2, 2])])
def test_packed_linear_splits_every_block_and_keeps_the_dense_layout(world_size, widths):
    results = run_distributed(_packed_linear, world_size)
    assert all(loaded and paired for loaded, _, paired, _ in results)
    assert results[0][1] == widths       # rank 0's slice of q, k and v (uneven at 2 ranks)
    assert results[0][3] is True         # full_state on rank 0: the dense, unpermuted weight


def _conv1d_layers():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    fc, proj = Conv1D(13, DIM).double(), Conv1D(DIM, 13).double()
    with torch.no_grad():
        fc.bias.normal_(), proj.bias.normal_()
    col = tp.nn.ColumnParallelConv1D.from_dense(fc)
    row = tp.nn.RowParallelConv1D.from_dense(proj)
    x = torch.randn(2, 3, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    dense_out = proj(torch.relu(fc(x)))
    out = row(torch.relu(col(x)))
    torch.testing.assert_close(out, dense_out, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    dense_out.square().sum().backward()
    s = col.shard
    torch.testing.assert_close(col.weight.grad, fc.weight.grad[:, s.start: s.stop])
    torch.testing.assert_close(row.weight.grad, proj.weight.grad[s.start: s.stop])
    torch.testing.assert_close(row.bias.grad, proj.bias.grad)
    full = tp.full_state_dict(nn.ModuleDict({"fc": col, "proj": row}))
    if s.group.rank != 0:
        return True
    return all(torch.equal(full[k], v) for k, v in
               {"fc.weight": fc.weight, "fc.bias": fc.bias, "proj.weight": proj.weight,
                "proj.bias": proj.bias}.items())


@pytest.mark.parametrize("world_size", [1, 3])
def test_conv1d_column_and_row_parallel_keep_the_dense_conv1d_layout(world_size):
    pytest.importorskip("transformers")
    assert all(run_distributed(_conv1d_layers, world_size))


class Scaled(nn.Module):
    """A layer class tensorpar does not know: a linear layer with a learned output scale."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.inner = nn.Linear(n_in, n_out)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.inner(x) * self.scale


class ColumnScaled(nn.Module):
    def __init__(self, dense, style, group):
        super().__init__()
        self.inner = ColumnParallelLinear.from_dense(dense.inner, group=group,
                                                     gather_output=style.gather_output)
        self.scale = nn.Parameter(dense.scale.detach().clone())

    def forward(self, x):
        return self.inner(x) * self.scale


def _custom_builder():
    torch.manual_seed(0)
    dense = nn.Sequential(Scaled(DIM, 7), nn.Linear(7, 3)).double()
    model = nn.Sequential(Scaled(DIM, 7), nn.Linear(7, 3)).double()
    model.load_state_dict(dense.state_dict())
    tp.parallelize(model, {"0": tp.nn.Colwise(gather_output=True)},
                   builders={Scaled: ColumnScaled})
    x = torch.randn(2, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model(x), dense(x), rtol=1e-12, atol=1e-12)
    full = tp.full_state_dict(model)  # the tensorpar layer inside is gathered as usual
    return type(model[0].inner).__name__, sorted(full)


def test_a_builder_registers_a_style_for_an_unknown_layer_class():
    results = run_distributed(_custom_builder, 2)
    assert results[0] == ("ColumnParallelLinear",
                          ["0.inner.bias", "0.inner.weight", "0.scale", "1.bias", "1.weight"])


def test_an_unknown_class_without_a_builder_is_refused_pointing_to_builders():
    model = nn.Sequential(Scaled(DIM, 7))
    with pytest.raises(ValueError, match=r"'0' is a Scaled.*builders="):
        tp.parallelize(model, {"0": "colwise"})


def test_a_builder_that_returns_no_module_leaves_the_model_unchanged():
    model = nn.Sequential(Scaled(DIM, 7), nn.Linear(7, 3))
    with pytest.raises(TypeError, match=r"builder for '0' \(Scaled\) returned int"):
        tp.parallelize(model, {"0": "colwise", "1": "rowwise"},
                       builders={Scaled: lambda module, style, group: 3})
    assert type(model[1]) is nn.Linear


@pytest.mark.parametrize("style, match", [
    (PackedColwise(blocks=(24, 6)), r"blocks=\[24, 6\] sum to 30; expected out_features=36"),
    (PackedColwise(blocks=5), r"out_features=36 does not split into blocks=5"),
    (PackedColwise(blocks=BLOCKS, multiple_of=(8, 2)), r"gives 2 units for 3 blocks"),
    (PackedColwise(blocks=BLOCKS, multiple_of=(5, 2, 2)), r"block 0 \(24 features\).*"
                                                          r"not a multiple of multiple_of=5"),
])
def test_packed_plans_that_do_not_fit_are_refused(style, match):
    with pytest.raises(ValueError, match=match):
        tp.parallelize(nn.Sequential(nn.Linear(DIM, 36)), {"0": style})
