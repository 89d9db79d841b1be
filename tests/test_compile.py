"""torch.compile: tensor-parallel code compiles to one graph, forward and backward, as eager.

Each case runs the same computation eagerly and under ``torch.compile(fullgraph=True)`` on
the same ranks and compares outputs and gradients: float64 with the ``aot_eager`` backend
(the traced graphs run op by op: 1e-10), and float32 with inductor (1e-5). The eager path is
itself checked against one process elsewhere (test_layers, test_hf_models).
"""

import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.testing import AotEagerAndRecordGraphs

import tensorpar as tp
from tensorpar.nn import (
    ColumnParallelLinear,
    Colwise,
    ParallelEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    plan_from_transformers,
    vocab_parallel_cross_entropy,
)
from tensorpar.testing import run_distributed

pytestmark = pytest.mark.timeout(600)  # compiling on a busy 2-core machine takes minutes
TIGHT = {"rtol": 1e-10, "atol": 1e-10}


def rand(seed, *shape, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _fresh():
    torch._dynamo.reset()


def _run_both(fn, inputs, backend="aot_eager", fullgraph=True):
    """``fn(*inputs)`` eagerly and compiled: outputs and input gradients of each."""
    results = []
    for f in (fn, torch.compile(fn, fullgraph=fullgraph, backend=backend)):
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


def _compare_collectives(uneven, backend="aot_eager"):
    _fresh()
    n = torch.distributed.get_world_size()
    fn, inputs = _collectives(n, uneven)
    _assert_same(_run_both(fn, inputs, backend))  # fullgraph=True: a graph break would raise


@pytest.mark.parametrize(("world_size", "uneven"),
                         [(2, False), pytest.param(2, True, marks=pytest.mark.slow),
                          pytest.param(3, True, marks=pytest.mark.slow)])
def test_collectives_compile_fullgraph_and_equal_eager(world_size, uneven):
    run_distributed(_compare_collectives, world_size, uneven, timeout=540)


@pytest.mark.slow
@pytest.mark.parametrize("uneven", [False, True])
def test_collectives_compile_with_inductor_and_equal_eager(uneven):
    """Inductor removes a clone as a no-op before it merges identical calls: the sum- and
    the identity-backward all-reduce of one tensor (and an all-gather beside a
    gather_from_group) became one buffer whose two outputs shared a gradient (2.2 off)."""
    run_distributed(_compare_collectives, 2, uneven, "inductor", timeout=540)


def _complex_collective(kind):
    _fresh()
    rank = torch.distributed.get_rank()
    x = torch.randn(5, 4, dtype=torch.complex128,
                    generator=torch.Generator().manual_seed(rank))
    fn = {"all_to_all": lambda t: tp.all_to_all(t, split_dim=0, concat_dim=1, sizes=[3, 2]),
          "reduce_from_group": lambda t: tp.reduce_from_group(t),
          "gather_from_group": lambda t: tp.gather_from_group(t, dim=-1, sizes=[4, 4]),
          }[kind]
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        leaf = x.clone().requires_grad_()
        out = f(leaf)
        w = torch.randn(out.shape, dtype=torch.complex128,
                        generator=torch.Generator().manual_seed(7))
        (out * w).real.sum().backward()
        results.append((out.detach(), leaf.grad))
    (eager, eager_grad), (compiled, compiled_grad) = results
    torch.testing.assert_close(compiled, eager, **TIGHT)
    torch.testing.assert_close(compiled_grad, eager_grad, **TIGHT)


@pytest.mark.parametrize("kind", ["all_to_all", "reduce_from_group", "gather_from_group"])
def test_a_complex_collective_compiles_and_equals_eager(kind):
    # gloo refused the traced complex all-to-all, and the coalesced all-gather of
    # gather_from_group ("Invalid scalar type")
    run_distributed(_complex_collective, 2, kind, timeout=240)


def _layouts(uneven):
    """Strides of the collectives' results along inner dims, eagerly and compiled, and
    whether ``.view(-1)`` of each works inside a compiled function (it does eagerly)."""
    _fresh()
    n, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    sizes = [2 + (r % 2 if uneven else 0) for r in range(n)]
    b, c = rand(1, 3, sizes[rank], 4), rand(2, 3, sum(sizes), 4)
    calls = {
        "all_gather dim 1": lambda: tp.all_gather(b, dim=1, sizes=sizes),
        "all_gather dim -1": lambda: tp.all_gather(b.transpose(1, 2), dim=-1, sizes=sizes),
        "gather_from_group dim -1": lambda: tp.gather_from_group(b.transpose(1, 2), dim=-1,
                                                                 sizes=sizes),
        "reduce_scatter dim 1": lambda: tp.reduce_scatter(c, dim=1, sizes=sizes),
        "reduce_scatter dim -1": lambda: tp.reduce_scatter(c.transpose(1, 2), dim=-1,
                                                           sizes=sizes),
    }
    rows = {}
    for name, call in calls.items():
        eager = call()
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")()
        torch.testing.assert_close(compiled, eager, **TIGHT)
        flat = torch.compile(lambda f=call: f().view(-1), fullgraph=True, backend="aot_eager")
        rows[name] = (eager.stride(), compiled.stride(), flat().shape == (eager.numel(),))
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("uneven", [False, True])
def test_compiled_collectives_return_eager_layout(uneven):
    """A collective along an inner dim returns a contiguous tensor eagerly; compiled, the same
    strides, so code that views the result (``.view``) runs alike (it failed compiled)."""
    for rows in run_distributed(_layouts, 2, uneven, timeout=540):
        for name, (eager, compiled, viewed) in rows.items():
            assert compiled == eager and viewed, (name, eager, compiled, viewed)


def _rooted_case(n, uneven):
    """Every rooted collective traced: sources and destinations differ, chunks uneven.

    Each rank without data passes a placeholder (``exchange_meta=False``); a gather's or a
    reduce's placeholder goes back through a scatter or a broadcast, so every output is a
    tensor on every rank and one ``backward`` runs every dual.
    """
    rank = torch.distributed.get_rank()
    src, dst = n - 1, 0
    split = [1 + (r if uneven else 0) for r in range(n)]
    length = sum(split)

    def fn(full, chunk, a):
        no_meta = {"exchange_meta": False}
        g1 = tp.gather(chunk, dim=1, dst=dst, sizes=split)  # dst: (2, L); else placeholder
        g0 = tp.gather(chunk.transpose(0, 1), dim=0, dst=dst, sizes=split)
        r = tp.reduce(a, dst=dst)
        mean = tp.reduce(a * 2, dst=src, op="mean")
        return (
            tp.scatter(full, dim=1, src=src, sizes=split, **no_meta),
            tp.scatter(full, dim=-1, src=src, **no_meta),  # balanced: from the shape
            tp.scatter(full, dim=0, src=src, **no_meta),
            tp.broadcast(full, src=src, **no_meta),
            tp.broadcast(full, src=src, async_op=True, **no_meta).resolve(),
            tp.scatter(g1, dim=1, src=dst, sizes=split, **no_meta),
            tp.scatter(g0, dim=0, src=dst, sizes=split, **no_meta),
            tp.broadcast(r, src=dst, **no_meta),
            tp.broadcast(mean, src=src, **no_meta) * 3,
        )

    full = rand(30, n + 1, length)
    if rank != src:
        full = tp.TensorPlaceholder(full.shape, full.dtype, requires_grad=True, owner=src)
    return fn, (full, rand(40 + rank, 2, split[rank]), rand(50 + rank, 4, 3))


def _run_rooted(fn, inputs, compile_it):
    """``fn`` eagerly or compiled (fullgraph where the rooted collectives trace): outputs and
    the gradients of the tensor inputs."""
    from tensorpar.collectives._traced.rooted import TRACES

    f = torch.compile(fn, fullgraph=TRACES, backend="aot_eager") if compile_it else fn
    leaves = [t.detach().clone().requires_grad_() if isinstance(t, torch.Tensor)
              else tp.TensorPlaceholder(t.shape, t.dtype, requires_grad=True, owner=t.owner)
              for t in inputs]  # a fresh placeholder for each run
    outs = f(*leaves)
    sum((o * rand(100 + i, *o.shape)).sum() for i, o in enumerate(outs)).backward()
    return ([o.detach() for o in outs],
            [t.grad for t in leaves if isinstance(t, torch.Tensor)])


def _compare_rooted(uneven):
    _fresh()
    fn, inputs = _rooted_case(torch.distributed.get_world_size(), uneven)
    _assert_same([_run_rooted(fn, inputs, False), _run_rooted(fn, inputs, True)])


@pytest.mark.parametrize(("world_size", "uneven"),
                         [(2, False), pytest.param(3, True, marks=pytest.mark.slow)])
def test_rooted_collectives_compile_fullgraph_and_equal_eager(world_size, uneven):
    run_distributed(_compare_rooted, world_size, uneven, timeout=540)


def _broadcast_twice_with_inductor():
    _fresh()
    rank = torch.distributed.get_rank()
    full = rand(30, 3, 4).requires_grad_()
    given = full if rank == 1 else tp.TensorPlaceholder(full.shape, full.dtype,
                                                        requires_grad=True, owner=1)

    def fn(x):
        return (tp.broadcast(x, src=1, exchange_meta=False) * 2,
                tp.broadcast(x, src=1, async_op=True, exchange_meta=False).resolve() * 3)

    a, b = torch.compile(fn)(given)  # the default backend: inductor
    torch.testing.assert_close(a, full.detach() * 2, rtol=0, atol=0)
    torch.testing.assert_close(b, full.detach() * 3, rtol=0, atol=0)


@pytest.mark.slow
def test_one_tensor_broadcast_twice_from_its_root_under_inductor():
    """Inductor removed the root's copy into a fresh buffer as a no-op, merged the root's
    two sends of one tensor into one, and the other rank waited in its second (a hang)."""
    run_distributed(_broadcast_twice_with_inductor, 2, timeout=300)


def _placeholder_out(compile_it):
    """A gather's placeholder leaves the compiled function; its backward runs the scatter."""
    rank, n = torch.distributed.get_rank(), torch.distributed.get_world_size()
    split = [2 + r for r in range(n)]

    def fn(chunk):
        return tp.gather(chunk * 2, dim=0, dst=1, sizes=split)

    from tensorpar.collectives._traced.rooted import TRACES

    f = torch.compile(fn, fullgraph=TRACES, backend="aot_eager") if compile_it else fn
    chunk = rand(rank, split[rank], 3).requires_grad_()
    out = f(chunk)
    if rank == 1:
        (out * rand(7, *out.shape)).sum().backward()
        shown = out.detach()
    else:
        out.backward()  # the placeholder joins the backward scatter
        shown = out
    return shown, chunk.grad


def _compare_placeholder_out():
    _fresh()
    return _placeholder_out(False), _placeholder_out(True)


@pytest.mark.parametrize("world_size", [2, 3])
def test_placeholder_returned_by_compiled_gather_runs_the_backward(world_size):
    for rank, (eager, compiled) in enumerate(run_distributed(_compare_placeholder_out,
                                                             world_size, timeout=540)):
        if rank == 1:
            torch.testing.assert_close(compiled[0], eager[0], **TIGHT)
        else:
            assert isinstance(compiled[0], tp.TensorPlaceholder) and compiled[0] == eager[0]
        torch.testing.assert_close(compiled[1], eager[1], **TIGHT)


def _reduce_max_backward():
    _fresh()
    fn = torch.compile(lambda a: tp.broadcast(tp.reduce(a, op="max"), src=0,
                                              exchange_meta=False), fullgraph=True,
                       backend="aot_eager")
    a = rand(torch.distributed.get_rank(), 3).requires_grad_()
    out = fn(a)
    try:
        out.sum().backward()
    except tp.TensorparError as e:
        return out.detach(), str(e)
    return out.detach(), ""


def test_compiled_reduce_max_raises_in_backward_as_eager():
    results = run_distributed(_reduce_max_backward, 2, timeout=540)
    expected = torch.maximum(rand(0, 3), rand(1, 3))
    for out, message in results:
        torch.testing.assert_close(out, expected, **TIGHT)
        assert "reduce" in message and "max" in message, message


def _rooted(x):
    """The collectives that need a metadata exchange: each one graph break, run eagerly."""
    rank = torch.distributed.get_rank()
    y = tp.scatter(x if rank == 0 else None, dim=0, src=0)  # uneven: 3 and 2 rows at TP 2
    z = tp.broadcast(x if rank == 1 else None, src=1)
    w = tp.all_gather(y * 1.5, dim=0)  # no sizes: the lengths are exchanged
    return y * 2, z * 3, w


def _compare_graph_breaks():
    _fresh()
    rank = torch.distributed.get_rank()
    x = rand(rank, 5, 3)
    # traced work on both sides of each call (on every rank), so each break splits a graph

    def scatter(a):
        b = a.sin()
        return tp.scatter(b if rank == 0 else None, src=0).cos()

    def broadcast(a):
        b = a.sin()
        return tp.broadcast(b if rank == 1 else None, src=1).cos()

    def all_gather(a):
        return tp.all_gather(a.sin(), dim=0).cos()

    def all_three(a):
        b = a.sin()
        return (tp.scatter(b if rank == 0 else None, src=0).cos(),
                tp.broadcast(b if rank == 1 else None, src=1).cos(),
                tp.all_gather(b, dim=0).cos())

    alone = {"scatter": scatter, "broadcast": broadcast, "all_gather": all_gather,
             "all three": all_three}
    counted = {name: _graph_breaks(fn, x) for name, fn in alone.items()}
    _assert_same(_run_both(_rooted, (x,), fullgraph=False))
    return {name: breaks for name, (breaks, _) in counted.items()}, \
        [r for _, reasons in counted.values() for r in reasons]


def test_metadata_exchanges_break_the_graph_once_each_and_equal_eager():
    for breaks, reasons in run_distributed(_compare_graph_breaks, 2, timeout=540):
        # each is one call of the eager fallback
        assert breaks == {"scatter": 1, "broadcast": 1, "all_gather": 1, "all three": 3}, \
            reasons
        assert all("torch.compiler.disable" in r for r in reasons), reasons


def _validation_under_compile():
    _fresh()
    rank = torch.distributed.get_rank()

    def fn(a):
        return tp.all_reduce(a) * 2 + tp.reduce_from_group(a) + tp.copy_to_group(a)

    alone = {"all_reduce": lambda a: tp.all_reduce(a.sin()).cos(),
             "reduce_from_group": lambda a: tp.reduce_from_group(a.sin()).cos()}
    with tp.validation(True):
        breaks = {name: _graph_breaks(f, rand(0, 3))[0] for name, f in alone.items()}
        _assert_same(_run_both(fn, (rand(0, 3, 4),), fullgraph=False))  # copy_to_group: alike
        mismatch = torch.compile(lambda a: tp.all_reduce(a, op="sum" if rank else "mean"),
                                 backend="aot_eager")
        try:
            mismatch(rand(0, 3))
        except tp.CollectiveMismatchError as e:
            caught = "all_reduce" in str(e)
        else:
            caught = False
    return breaks, caught


def test_validation_mode_checks_every_collective_under_compile():
    for breaks, caught in run_distributed(_validation_under_compile, 2, timeout=540):
        # validation runs each collective eagerly (it fingerprints it): one break each
        assert breaks == {"all_reduce": 1, "reduce_from_group": 1} and caught, breaks


# ---------------------------------------------------------------------------------------
# the layers
# ---------------------------------------------------------------------------------------

def _module_both(module, fn, inputs, backend="aot_eager"):
    """``fn(*inputs)`` eagerly and compiled: (outputs, input grads, parameter grads) of each."""
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend=backend)):
        module.zero_grad(set_to_none=True)
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        outs = f(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        sum((o.double() * rand(100 + i, *o.shape)).sum() for i, o in enumerate(outs)).backward()
        results.append(([o.detach() for o in outs],
                        [t.grad for t in leaves if t.is_floating_point()]
                        + [p.grad for p in module.parameters()]))
    return results


class _Layers(nn.Module):
    """Every parallel layer once, on uneven shards (sizes not divisible by 2 or 3)."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        dense = {name: nn.Linear(n_in, n_out).to(dtype) for name, n_in, n_out in
                 [("col", 10, 13), ("colg", 10, 11), ("packed", 10, 20), ("row", 13, 7),
                  ("rows", 11, 7), ("wide", 13, 7)]}
        self.col = ColumnParallelLinear.from_dense(dense["col"])
        self.colg = ColumnParallelLinear.from_dense(dense["colg"], gather_output=True)
        self.packed = ColumnParallelLinear.from_dense(dense["packed"], blocks=(8, 4, 8),
                                                      multiple_of=(2, 1, 2), gather_output=True)
        self.row = RowParallelLinear.from_dense(dense["row"])
        self.rows = RowParallelLinear.from_dense(dense["rows"], input_is_parallel=False)
        self.wide = RowParallelLinear.from_dense(dense["wide"], reduce_dtype=torch.float64)
        self.vocab = VocabParallelEmbedding.from_dense(nn.Embedding(17, 10).to(dtype))
        self.dim = ParallelEmbedding.from_dense(nn.Embedding(17, 10).to(dtype))
        self.head = ColumnParallelLinear.from_dense(nn.Linear(10, 19).to(dtype))

    def forward(self, x, ids, target):
        h = self.vocab(ids) + self.dim(ids) + x
        a = self.col(h)
        y = self.row(a) + self.wide(a) + self.rows(self.colg(h)) + self.packed(h).sum(-1, True)
        loss = vocab_parallel_cross_entropy(self.head(h).flatten(0, 1), target.flatten(),
                                            sizes=self.head.shard.sizes)
        return y, loss


def _compare_layers(dtype_name, backend, tol):
    _fresh()
    dtype = getattr(torch, dtype_name)
    layers = _Layers(dtype)
    x = rand(1, 2, 3, 10, dtype=dtype)
    ids = torch.randint(0, 17, (2, 3), generator=torch.Generator().manual_seed(2))
    target = torch.randint(0, 19, (2, 3), generator=torch.Generator().manual_seed(3))
    _assert_same(_module_both(layers, layers, (x, ids, target), backend), **tol)


def test_layers_compile_fullgraph_and_equal_eager():
    run_distributed(_compare_layers, 3, "float64", "aot_eager", TIGHT, timeout=540)


class _Siblings(nn.Module):
    """q/k/v-like column-parallel siblings that read one input (one `SharedInput`)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k = nn.Linear(6, 5).double(), nn.Linear(6, 7).double()
        self.o = nn.Linear(12, 6).double()

    def forward(self, x):
        return self.o(torch.cat([self.q(x), self.k(x)], -1).relu())


def _compare_shared_input():
    _fresh()
    both = Colwise(gather_output=True)
    model = tp.parallelize(_Siblings(), {"q": both, "k": both})
    assert model.q.input_share is model.k.input_share is not None
    fn = lambda x: model(x)  # noqa: E731
    graphs = AotEagerAndRecordGraphs()
    x = rand(4, 3, 6).requires_grad_()
    torch.compile(fn, fullgraph=True, backend=graphs)(x).sum().backward()
    backward = "".join(g.code for g in graphs.bw_graphs)
    shared = backward.count("_c10d_functional.all_reduce")  # one for both q and k
    _assert_same(_module_both(model, fn, (rand(4, 3, 6),)))
    return shared, model.q.input_share._copy is None


@pytest.mark.slow
def test_shared_input_compiles_fullgraph_and_equals_eager():
    assert run_distributed(_compare_shared_input, 2, timeout=540) == [(1, True), (1, True)]


class _TinyLM(nn.Module):
    """A whole tensor-parallel language model: a vocab-parallel embedding, two MLP blocks
    (column-parallel up, row-parallel down, residual) and a column-parallel head whose
    vocab-parallel cross entropy is the loss. Widths are uneven at TP 2 and 3."""

    def __init__(self, vocab=29, dim=12, hidden=23, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = VocabParallelEmbedding.from_dense(nn.Embedding(vocab, dim))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.ups = nn.ModuleList(ColumnParallelLinear.from_dense(nn.Linear(dim, hidden))
                                 for _ in range(layers))
        self.downs = nn.ModuleList(RowParallelLinear.from_dense(nn.Linear(hidden, dim))
                                   for _ in range(layers))
        self.head = ColumnParallelLinear.from_dense(nn.Linear(dim, vocab, bias=False))

    def forward(self, ids, target):
        h = self.embed(ids)  # (B, T, D)
        for norm, up, down in zip(self.norms, self.ups, self.downs, strict=True):
            h = h + down(torch.nn.functional.gelu(up(norm(h))))  # up: (B, T, H/tp)
        logits = self.head(h)  # (B, T, V/tp)
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), target.flatten(),
                                            sizes=self.head.shard.sizes)


def _compare_tiny_lm_inductor():
    _fresh()
    model = _TinyLM()
    ids = torch.randint(0, 29, (2, 7), generator=torch.Generator().manual_seed(0))
    target = ids.roll(-1, 1)
    explained = torch._dynamo.explain(model)(ids, target)
    _fresh()
    results = []
    for m in (model, torch.compile(model)):  # the default backend: inductor
        model.zero_grad(set_to_none=True)
        loss = m(ids, target)
        loss.backward()
        results.append(([loss.detach()], [p.grad for p in model.parameters()]))
    _assert_same(results, rtol=1e-5, atol=1e-5)
    return explained.graph_count, explained.graph_break_count, \
        [str(b.reason) for b in explained.break_reasons]


@pytest.mark.slow
def test_whole_model_compiles_with_inductor_to_one_graph_and_equals_eager():
    for graphs, breaks, reasons in run_distributed(_compare_tiny_lm_inductor, 2, timeout=540):
        assert (graphs, breaks) == (1, 0), reasons


# ---------------------------------------------------------------------------------------
# transformers: a Llama decoder layer and a whole model (GQA, uneven heads at TP 2)
# ---------------------------------------------------------------------------------------

def _llama(dtype, layers):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=37, hidden_size=24, intermediate_size=50,
                                      num_hidden_layers=layers, max_position_embeddings=32,
                                      num_attention_heads=6, num_key_value_heads=3, head_dim=4)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype)


def _parallel_llama(dtype, layers, sequence=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return tp.parallelize(_llama(dtype, layers), plan_from_transformers(
            _llama(dtype, 1), sequence_parallel=sequence))


def _compare_decoder_layer(dtype_name, backend, tol, sequence=False):
    _fresh()
    dtype = getattr(torch, dtype_name)
    model = _parallel_llama(dtype, 1, sequence)
    layer = model.model.layers[0]
    x = rand(5, 2, 5, 24, dtype=dtype)
    emb = model.model.rotary_emb(x, torch.arange(5).unsqueeze(0))

    def fn(h):
        out = layer(h, position_embeddings=emb, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    breaks = _graph_breaks(fn, x)
    _assert_same(_module_both(layer, fn, (x,), backend), **tol)
    return breaks


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_llama_decoder_layer_is_one_graph_and_equals_eager(world_size):
    pytest.importorskip("transformers")
    for breaks, reasons in run_distributed(_compare_decoder_layer, world_size, "float64",
                                           "aot_eager", TIGHT, timeout=540):
        assert breaks == 0, reasons


def _compare_model(dtype_name, backend, tol, sequence=False):
    _fresh()
    dtype = getattr(torch, dtype_name)
    model = _parallel_llama(dtype, 2, sequence)
    head = model.get_output_embeddings()
    ids = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(0))
    target = ids.roll(-1, 1)

    def step(ids):
        logits = model(ids).logits  # (B, T, V/tp)
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), target.flatten(),
                                            sizes=head.shard.sizes)

    _assert_same(_module_both(model, step, (ids,), backend), **tol)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_llama_model_compiles_fullgraph_and_equals_eager(world_size):
    pytest.importorskip("transformers")
    run_distributed(_compare_model, world_size, "float64", "aot_eager", TIGHT, timeout=540)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_llama_decoder_layer_inductor_float32_equals_eager(world_size):
    pytest.importorskip("transformers")
    close = {"rtol": 1e-5, "atol": 1e-5}
    for breaks, reasons in run_distributed(_compare_decoder_layer, world_size, "float32",
                                           "inductor", close, timeout=540):
        assert breaks == 0, reasons


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_llama_model_inductor_float32_equals_eager():
    pytest.importorskip("transformers")
    run_distributed(_compare_model, 2, "float32", "inductor", {"rtol": 1e-5, "atol": 1e-5},
                    timeout=540)


def _compare_sequence_parallel():
    breaks = _compare_decoder_layer("float64", "aot_eager", TIGHT, True)  # on the slice
    _compare_model("float64", "aot_eager", TIGHT, True)
    return breaks


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_llama_sequence_parallel_compiles_fullgraph_and_equals_eager(world_size):
    """The layer (length 5: uneven slices) is one graph; the model compiles fullgraph."""
    pytest.importorskip("transformers")
    for breaks, reasons in run_distributed(_compare_sequence_parallel, world_size,
                                           timeout=540):
        assert breaks == 0, reasons


def test_traced_split_returns_a_copy_not_a_view():
    """A Function whose output is a view of its input was traced by torch 2.11 with a zero
    gradient (split_to_group's compiled input gradient came out zero there)."""
    from tensorpar.collectives._traced import _prims

    x = torch.arange(6.0).view(3, 2)
    out = _prims.SplitToGroup.apply(x, 0, (1, 1, 1), 0, "")
    assert torch.equal(out, x[:1]) and out._base is None and out.data_ptr() != x.data_ptr()


# ---------------------------------------------------------------------------------------
# other transformers architectures: their own layouts of the gathered and split tensors
# ---------------------------------------------------------------------------------------

def _compare_architecture(model_type):
    """A tiny planned model of ``model_type`` (the sweep's config, float64) compiled whole
    with ``fullgraph=True``, forward and backward, against itself eagerly."""
    from tests import _hf_sweep

    _fresh()
    config_name, cls = {m: (c, k) for m, c, k in _hf_sweep.architectures()}[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _hf_sweep._build(model_type, config_name, cls)
        tp.parallelize(model, plan_from_transformers(model))
    ids = torch.randint(2, 101, (2, 7), generator=torch.Generator().manual_seed(0))
    _assert_same(_module_both(model, lambda i: model(i).logits, (ids,)))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["olmo2", "qwen3", "phi3", "gpt_neox"])
def test_architecture_compiles_fullgraph_and_equals_eager(model_type):
    """Olmo2 normalises the gathered queries over all heads in float32: a gathered tensor
    laid out otherwise than eagerly made its sums differ (2.5e-8 in a float64 model).
    Qwen3: per-head norms with partial gradients; Phi-3: packed projections; GPT-NeoX: a
    packed projection interleaved per head."""
    pytest.importorskip("transformers")
    run_distributed(_compare_architecture, 2, model_type, timeout=540)


# ---------------------------------------------------------------------------------------
# mixture of experts: expert parallelism runs eagerly inside a compiled model
# ---------------------------------------------------------------------------------------

def _compare_expert_parallel(arch):
    """An expert-parallel model compiled (no fullgraph: the routing's split sizes are data)
    against itself eagerly: loss and every gradient; and the graph breaks of the layer."""
    from tests import test_hf_experts as H

    _fresh()
    model = H.build(arch)
    tp.parallelize(model, H.plan_for(arch, model))
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for f in (model, torch.compile(model, backend="aot_eager")):
        model.zero_grad(set_to_none=True)
        loss = f(ids, labels=ids).loss
        loss.backward()
        results.append(([loss.detach()], [p.grad for p in model.parameters()]))
    _assert_same(results)
    experts = next(m for m in model.modules() if type(m).__name__ == "ParallelExperts")
    hidden = rand(3, 2 * 9, 16)
    index = torch.randint(0, 8, (2 * 9, 2), generator=torch.Generator().manual_seed(4))
    _fresh()
    weights = torch.rand(2 * 9, 2, generator=torch.Generator().manual_seed(5),
                         dtype=torch.float64)  # the same routing on every rank
    return _graph_breaks(lambda h, i, w: experts(h * 2, i, w) + 1, hidden, index, weights)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_expert_parallel_model_compiles_and_equals_eager(arch):
    """Compiling an expert-parallel model failed inside dynamo (it traced the layer's count
    exchange and reached into the process group); the layer now runs eagerly, one graph
    break per call, the rest of the model compiled."""
    pytest.importorskip("transformers")
    for breaks, reasons in run_distributed(_compare_expert_parallel, 2, arch, timeout=540):
        assert breaks == 1 and "_run_experts_eagerly" in reasons[0], reasons


def _row_bias_dtypes():
    _fresh()
    torch.manual_seed(0)
    layer = RowParallelLinear(8, 4)
    layer.bias = nn.Parameter(layer.bias.detach().double())  # a bias in another dtype
    x = torch.randn(3, layer.shard.length, requires_grad=True)
    out = {"fused": layer(x)}
    with torch.no_grad():
        out["no graph"] = layer(x)
    with tp.validation(True):
        out["validation"] = layer(x)
    out["compiled"] = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    return {k: (v.dtype, float((v.double() - out["fused"].double()).abs().max()))
            for k, v in out.items()}


def test_row_layer_bias_dtype_promotes_on_every_path():
    """Outside autocast the bias joins as in ``F.linear``: by type promotion, on every path."""
    for got in run_distributed(_row_bias_dtypes, 2, timeout=300):
        assert all(dtype == torch.float64 for dtype, _ in got.values()), got
        assert all(diff < 1e-6 for _, diff in got.values()), got


def _inplace_and_new_lengths():
    """Eager against compiled: an in-place all-reduce's gradient; splits without sizes= at a
    second, new length (dynamo makes it symbolic); the vocab-parallel loss without sizes=."""
    from tensorpar.nn import vocab_parallel_cross_entropy

    _fresh()
    rank = torch.distributed.get_rank()
    results = {}
    for op in ("sum", "mean"):
        results[f"inplace {op}"] = _run_both(
            lambda a, op=op: tp.all_reduce(a * 2, op=op, inplace=True) * (rank + 1),
            [rand(rank, 3)])
    split = torch.compile(lambda c: tp.split_to_group(c, dim=0) * 2, backend="aot_eager",
                          fullgraph=True)
    scatter = torch.compile(lambda c: tp.reduce_scatter(c, dim=0) * 2, backend="aot_eager",
                            fullgraph=True)
    for length in (4, 6, 7):
        c = rand(length, length, 2)
        results[f"split {length}"] = [(split(c),), (tp.split_to_group(c, dim=0) * 2,)]
        results[f"reduce_scatter {length}"] = [(scatter(c),), (tp.reduce_scatter(c, dim=0) * 2,)]
    logits, target = rand(rank + 7, 5, 3 + rank), torch.tensor([0, 1, 2, 3, 4]) % 3
    loss = torch.compile(lambda lg, t: vocab_parallel_cross_entropy(lg, t), backend="aot_eager")
    results["vocab loss"] = [(loss(logits, target),), (vocab_parallel_cross_entropy(logits,
                                                                                    target),)]
    return results


@pytest.mark.timeout(600)
def test_inplace_gradients_new_lengths_and_the_vocab_loss_compile_as_eager():
    """Compiled, an in-place all-reduce's gradient skipped the all-reduce (each rank's own:
    2 and 4 instead of 6); a split without sizes= raised at a new length (divmod of a
    symbolic int), and a rooted scatter then hung; the vocab loss without sizes= raised."""
    for results in run_distributed(_inplace_and_new_lengths, 2, timeout=540):
        for case, result in results.items():
            if case.startswith("inplace"):
                _assert_same(result)
            else:
                torch.testing.assert_close(result[0][0], result[1][0], **TIGHT, msg=case)


def _max_forward_only():
    _fresh()
    a = rand(torch.distributed.get_rank(), 3).requires_grad_()
    out = {}
    for name, call in (("all_reduce", lambda t: tp.all_reduce(t, op="max") * 2),
                       ("reduce_scatter", lambda t: tp.reduce_scatter(t, op="max") * 2)):
        compiled = torch.compile(call, backend="aot_eager", fullgraph=True)(a)
        try:
            compiled.sum().backward()
            said = ""
        except tp.TensorparError as e:
            said = str(e)
        out[name] = (compiled.detach(), call(a.detach()), said)
    return out


@pytest.mark.timeout(600)
def test_a_compiled_max_runs_its_forward_and_refuses_its_backward_as_eager():
    """A max of a tensor that requires grad failed to compile (its backward has no max)."""
    for result in run_distributed(_max_forward_only, 2, timeout=540):
        for name, (compiled, eager, said) in result.items():
            torch.testing.assert_close(compiled, eager, **TIGHT)
            assert name in said and "max" in said, said


def _scatter_from_the_shape_at_new_lengths():
    _fresh()
    compiled = torch.compile(lambda full: tp.scatter(full, dim=0, src=0, exchange_meta=False) * 2,
                             backend="aot_eager")
    out = []
    for length in (4, 6, 7):
        full = rand(length, length, 2).float() if torch.distributed.get_rank() == 0 else \
            tp.TensorPlaceholder((length, 2), torch.float32, owner=0)
        eager = tp.scatter(full, dim=0, src=0, exchange_meta=False) * 2
        out.append(torch.equal(compiled(full), eager))
    return out


@pytest.mark.timeout(300)
def test_a_scatter_sized_from_the_shape_compiles_at_new_lengths():
    """At a second length the placeholder rank's split raised (divmod of a symbolic int) and
    it ran eagerly while the source rank ran the traced scatter: both waited for ever."""
    assert run_distributed(_scatter_from_the_shape_at_new_lengths, 2, timeout=240) == \
        [[True] * 3] * 2


def _sequence_lengths_graphs(sequence):
    """A whole model compiled with dynamic shapes over eight sequence lengths."""
    from torch._dynamo.utils import counters

    _fresh()
    counters.clear()
    model = _parallel_llama(torch.float64, 1, sequence)
    head = model.get_output_embeddings()

    def step(ids):
        logits = model(ids).logits
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten(),
                                            sizes=head.shard.sizes)

    batches = [torch.randint(0, 37, (2, n), generator=torch.Generator().manual_seed(n))
               for n in range(6, 14)]
    eager = [step(ids) for ids in batches]  # (first: the model's first forward retags once)
    compiled = torch.compile(step, backend="aot_eager", dynamic=True, fullgraph=True)
    worst = max(float((compiled(ids) - want).abs()) for ids, want in
                zip(batches, eager, strict=True))
    return counters["stats"]["unique_graphs"], worst


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sequence", [False, True], ids=["tensor", "sequence"])
def test_new_sequence_lengths_do_not_recompile_each_time(sequence):
    """The sequence split's sizes follow the length symbolically: at most one graph per
    remainder of the length by the group size (here 2), not one per length (a sequence-
    parallel model reached Dynamo's limit of 8 and, under fullgraph, raised)."""
    pytest.importorskip("transformers")
    for graphs, worst in run_distributed(_sequence_lengths_graphs, 2, sequence, timeout=540):
        assert graphs <= 2, graphs
        assert worst < 1e-12
