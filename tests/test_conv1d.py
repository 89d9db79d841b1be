"""RowParallelConv1D takes RowParallelLinear's paths: one Function, autocast, reduce_dtype."""

import pytest
import torch

from tensorpar.nn import RowParallelConv1D, RowParallelLinear
from tensorpar.testing import run_distributed

TIMEOUT = 180.0  # every rank imports transformers


def _row_conv(autocast, reduce_dtype, kind="conv1d"):
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    x = torch.randn(3, 7)  # (before the layers: their initialisation draws per shard)
    if kind == "conv1d":
        dense = Conv1D(5, 7)  # in 7 (split unevenly over 2 or 3 ranks), out 5
        layer = RowParallelConv1D.from_dense(dense, input_is_parallel=False,
                                             reduce_dtype=reduce_dtype)
    else:
        dense = torch.nn.Linear(7, 5)
        layer = RowParallelLinear.from_dense(dense, input_is_parallel=False,
                                             reduce_dtype=reduce_dtype)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref, y = dense(x_ref), layer(x_par)
    node = type(y.grad_fn).__name__
    ref.float().pow(2).sum().backward()
    y.float().pow(2).sum().backward()
    s = layer.shard
    tol = 2e-2 if autocast else 1e-5
    dense_grad = dense.weight.grad[s.start: s.stop] if kind == "conv1d" \
        else dense.weight.grad[:, s.start: s.stop]
    return (y.dtype == ref.dtype, torch.allclose(y.float(), ref.float(), atol=tol),
            torch.allclose(x_par.grad, x_ref.grad, atol=tol),
            torch.allclose(layer.weight.grad, dense_grad, atol=tol), node)


@pytest.mark.parametrize("world_size", [2, 3])
def test_row_parallel_conv1d_is_one_function_and_follows_autocast(world_size):
    for dtype_ok, out_ok, x_grad_ok, w_grad_ok, node in run_distributed(
            _row_conv, world_size, False, None, timeout=TIMEOUT):
        assert dtype_ok and out_ok and x_grad_ok and w_grad_ok
        assert node == "_RowLinearBackward"  # the fused path, as RowParallelLinear's
    for result in run_distributed(_row_conv, world_size, True, None, timeout=TIMEOUT):
        assert result[:4] == (True,) * 4, result  # bfloat16 out under autocast, like Conv1D


def test_row_parallel_linear_follows_autocast_like_nn_linear():
    for result in run_distributed(_row_conv, 2, True, None, "linear", timeout=TIMEOUT):
        assert result[:4] == (True,) * 4, result  # bfloat16 out, the bias added in bfloat16


def test_row_parallel_conv1d_with_a_reduce_dtype():
    for dtype_ok, out_ok, x_grad_ok, w_grad_ok, _ in run_distributed(
            _row_conv, 2, False, torch.float64, timeout=TIMEOUT):
        assert dtype_ok and out_ok and x_grad_ok and w_grad_ok
