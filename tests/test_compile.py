"""torch.compile: tensor-parallel code compiles to one graph, forward and backward, and equals eager.

Each case runs the same computation eagerly and under ``torch.compile(fullgraph=True)`` on
the same ranks and compares outputs and gradients: float64 with the ``aot_eager`` backend
(the traced graphs run op by op: 1e-10), and float32 with inductor (1e-5). The eager path is
itself checked against one process elsewhere (test_layers, test_hf_models).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorpar as tp
from tensorpar.nn import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    plan_from_transformers,
    vocab_parallel_cross_entropy,
)
from tensorpar.testing import run_distributed

TIGHT = {"rtol": 1e-10, "atol": 1e-10}


def rand(seed, *shape, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _fresh():
    torch._dynamo.reset()


def _run_both(fn, inputs, backend="aot_eager"):
    """``fn(*inputs)`` eagerly and compiled (fullgraph): outputs and input gradients of each."""
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend=backend)):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        outs = f(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        total = sum((o.double() * rand(100 + i, *o.shape)).sum() for i, o in enumerate(outs)
                    if o.requires_grad)
        if isinstance(total, torch.Tensor):
            total.backward()
        results.append(([o.detach() for o in outs],
                        [t.grad for t in leaves if t.is_floating_point()]))
    return results


def _assert_same(results, **tol):
    (eager_out, eager_grad), (comp_out, comp_grad) = results
    assert len(eager_out) == len(comp_out)
    for a, b in zip(comp_out, eager_out, strict=True):
        torch.testing.assert_close(a, b, **(tol or TIGHT))
    for a, b in zip(comp_grad, eager_grad, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, **(tol or TIGHT))


def _graph_breaks(fn, *args):
    explained = torch._dynamo.explain(fn)(*args)
    return explained.graph_break_count, [str(b.reason) for b in explained.break_reasons]


# ---------------------------------------------------------------------------------------
# the public collectives
# ---------------------------------------------------------------------------------------

def _collectives(n, uneven):
    """Every traced collective, once per mode, in one function: (outputs...)."""
    rank = torch.distributed.get_rank()
    sizes = [2 + (r % 2 if uneven else 0) for r in range(n)]  # along the concat dims
    split = [1 + (r if uneven else 0) for r in range(n)]  # split lengths (sum: L)
    length = sum(split)

    def fn(a, b, c):
        outs = [
            tp.all_reduce(a),
            tp.all_reduce(a, backward="identity"),
            tp.all_reduce(a, op="mean"),
            tp.all_reduce(a.detach(), op="max"),
            tp.all_reduce(a, async_op=True).resolve(),
            tp.all_gather(b, dim=0, sizes=sizes),
            tp.all_gather(b.transpose(0, 1), dim=1, sizes=sizes),
            tp.all_gather(b, dim=0, sizes=sizes, async_op=True).resolve(),
            tp.reduce_scatter(c, dim=0, sizes=split),
            tp.reduce_scatter(c, dim=1, op="mean"),
            tp.reduce_scatter(c.transpose(0, 1), dim=1, sizes=split),
            tp.all_to_all(c, split_dim=0, concat_dim=1, sizes=split),
            tp.all_to_all(c.transpose(0, 1), split_dim=1, concat_dim=0, sizes=split),
            tp.copy_to_group(a) * 3,
            tp.reduce_from_group(a),
            tp.split_to_group(c, dim=0, sizes=split),
            tp.split_to_group(c, dim=-1),
            tp.gather_from_group(b, dim=0, sizes=sizes),
        ]
        return tuple(outs)

    a = rand(rank, 3, 4)
    b = rand(10 + rank, sizes[rank], 3)
    c = rand(20 + rank, length, 3 * n)
    return fn, (a, b, c)


def _compare_collectives(uneven):
    _fresh()
    n = torch.distributed.get_world_size()
    fn, inputs = _collectives(n, uneven)
    _assert_same(_run_both(fn, inputs))  # fullgraph=True: a graph break would raise


@pytest.mark.parametrize(("world_size", "uneven"), [(2, False), (2, True), (3, True)])
def test_collectives_compile_fullgraph_and_equal_eager(world_size, uneven):
    run_distributed(_compare_collectives, world_size, uneven, timeout=300)
