"""Multi-rank tests of tensorpar.scatter / tensorpar.gather (gloo, world sizes 1-4)."""

import pytest
import torch
import torch.distributed as dist

import tensorpar
from tensorpar import CommCounter, TensorPlaceholder
from tensorpar.testing import run_distributed

WORLD_SIZES = [1, 2, 3, 4]
SHAPE = (7, 5, 3)  # odd lengths: uneven shards at world sizes 2, 3 and 4


def _subgroup(ranks):
    """(group, group_rank) for ``ranks``, or (None, rank) for the default group.

    Non-members get (group, -1). Every rank must call this (new_group is collective).
    """
    if ranks is None:
        return None, dist.get_rank()
    group = dist.new_group(ranks)
    return group, dist.get_rank(group)  # -1 for non-members


def _source_tensor(dtype, requires_grad=False):
    x = torch.arange(1, 1 + torch.Size(SHAPE).numel(), dtype=torch.float64).view(SHAPE)
    x = (x / 10).to(dtype) if dtype.is_floating_point else x.to(dtype)
    return x.requires_grad_(requires_grad)


def _split(x, dim, sizes, parts):
    if sizes is None:
        return list(torch.tensor_split(x, parts, dim))
    return list(torch.split(x, sizes, dim))


def _round_trip(dim, root, sizes, dtype, ranks):
    group, grank = _subgroup(ranks)
    if grank < 0:
        return "not a member"
    size = dist.get_world_size(group) if group is not None else dist.get_world_size()
    full = _source_tensor(dtype)
    # Non-source ranks alternate between None and a placeholder: both are valid.
    if grank == root:
        x = full
    elif grank % 2:
        x = None
    else:
        x = TensorPlaceholder.like(full, owner=root, group=group)
    chunk = tensorpar.scatter(x, dim=dim, src=root, group=group, sizes=sizes)
    expected = _split(full, dim, sizes, size)[grank]
    torch.testing.assert_close(chunk, expected, rtol=0, atol=0)
    assert chunk.is_contiguous() and chunk.dtype == dtype
    out = tensorpar.gather(chunk, dim=dim, dst=root, group=group)
    if grank == root:
        torch.testing.assert_close(out, full, rtol=0, atol=0)
    else:
        assert out == TensorPlaceholder(SHAPE, dtype, owner=root, group=group)
    return tuple(chunk.shape)


CASES = [  # (dim, root, sizes)
    (0, 0, None),
    (1, -1, None),        # root = last rank
    (-1, 0, None),
    (0, -1, "uneven"),    # explicit sizes with a zero-length chunk
    (1, 0, "uneven"),
]


def _sizes_for(kind, dim, world_size):
    if kind is None:
        return None
    length = SHAPE[dim]
    sizes = [0] * world_size
    sizes[-1] = length - (world_size - 1) // 2
    for r in range(1, world_size - 1):
        sizes[r] = 1 if r <= (world_size - 1) // 2 else 0
    sizes[0] += length - sum(sizes)
    return sizes


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim, root, sizes", CASES)
def test_round_trip(world_size, dim, root, sizes):
    root %= world_size
    sizes = _sizes_for(sizes, dim, world_size)
    shapes = run_distributed(_round_trip, world_size, dim, root, sizes, torch.float32, None)
    assert sum(s[dim] for s in shapes) == SHAPE[dim]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64, torch.bool,
                                   torch.complex64])
def test_round_trip_dtypes(dtype):
    run_distributed(_round_trip, 3, 1, 2, None, dtype, None)


@pytest.mark.parametrize("ranks, root", [([1, 2], 1), ([0, 3], 0), ([3, 1, 0], 2)])
def test_round_trip_on_subgroup(ranks, root):
    shapes = run_distributed(_round_trip, 4, 0, root, None, torch.float32, ranks)
    members = [shapes[r] for r in sorted(ranks)]  # group ranks follow global ranks
    assert [s[0] for s in members] == [len(c) for c in torch.tensor_split(torch.empty(7),
                                                                          len(ranks))]
    assert all(shapes[r] == "not a member" for r in range(4) if r not in ranks)


# -- gradients -----------------------------------------------------------------------------

def _per_rank_fn(chunk, rank):
    return torch.sin(chunk * (rank + 1)) + chunk ** 2


def _reference_grad(dim, sizes, size, weights):
    x = _source_tensor(torch.float64, requires_grad=True)
    parts = [_per_rank_fn(c, r) for r, c in enumerate(_split(x, dim, sizes, size))]
    (torch.cat(parts, dim) * weights).sum().backward()
    return x.grad


def _scatter_compute_gather(dim, root, sizes, ranks):
    """Loss on the root only; the other ranks call .backward() on their placeholder."""
    group, grank = _subgroup(ranks)
    if grank < 0:
        return None
    size = dist.get_world_size(group) if group is not None else dist.get_world_size()
    weights = torch.linspace(-1, 1, torch.Size(SHAPE).numel(), dtype=torch.float64).view(SHAPE)
    x = _source_tensor(torch.float64, requires_grad=True) if grank == root else None
    chunk = tensorpar.scatter(x, dim=dim, src=root, group=group, sizes=sizes)
    assert chunk.requires_grad  # on every rank, so every rank joins the backward gather
    out = tensorpar.gather(_per_rank_fn(chunk, grank), dim=dim, dst=root, group=group)
    loss = (out * weights).sum() if not tensorpar.is_placeholder(out) else out
    loss.backward()
    if grank != root:
        assert tensorpar.is_placeholder(out) and out.requires_grad
        return None
    torch.testing.assert_close(x.grad, _reference_grad(dim, sizes, size, weights),
                               rtol=1e-12, atol=1e-12)
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim, root, sizes", CASES)
def test_gradient_matches_single_process(world_size, dim, root, sizes):
    root %= world_size
    sizes = _sizes_for(sizes, dim, world_size)
    results = run_distributed(_scatter_compute_gather, world_size, dim, root, sizes, None)
    assert results[root] is True


def test_gradient_on_subgroup():
    results = run_distributed(_scatter_compute_gather, 4, 1, 1, None, [1, 2, 3])
    assert results[2] is True


def _scatter_then_local_losses():
    """Each rank's own loss; the source gets the sum of their gradients."""
    rank, size = dist.get_rank(), dist.get_world_size()
    x = _source_tensor(torch.float64, requires_grad=True) if rank == 0 else None
    chunk = tensorpar.scatter(x, dim=1)
    (chunk.pow(2).sum() * (rank + 1)).backward()
    if rank:
        return None
    scale = torch.cat([torch.full_like(c, r + 1.0) for r, c in
                       enumerate(torch.tensor_split(x.detach(), size, 1))], 1)
    torch.testing.assert_close(x.grad, 2 * x.detach() * scale, rtol=1e-12, atol=0)
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_scatter_backward_gathers_every_ranks_gradient(world_size):
    assert run_distributed(_scatter_then_local_losses, world_size)[0] is True


def _gather_backward():
    rank = dist.get_rank()
    p = torch.randn(rank + 1, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank),
                    requires_grad=True)
    out = tensorpar.gather(p, dst=1 % dist.get_world_size())
    (out.pow(3).sum() if not tensorpar.is_placeholder(out) else out).backward()
    torch.testing.assert_close(p.grad, 3 * p.detach() ** 2, rtol=1e-12, atol=0)
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather_backward_scatters_gradient_to_every_rank(world_size):
    assert all(run_distributed(_gather_backward, world_size))


def _gradcheck_gather_scatter(dim):
    """gradcheck + gradgradcheck of x -> scatter(f(gather(x))) with f elementwise on dst.

    Every rank checks its own input; the chunks have equal shapes so every rank issues the
    same sequence of collectives.
    """
    rank = dist.get_rank()
    x = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank),
                    requires_grad=True)

    def f(x):
        out = tensorpar.gather(x, dim=dim, dst=0)
        y = out ** 3 if not tensorpar.is_placeholder(out) else out
        return tensorpar.scatter(y, dim=dim, src=0)

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gradcheck_and_double_backward(world_size):
    assert all(run_distributed(_gradcheck_gather_scatter, world_size, 1))


def _requires_grad_follows_source(requires_grad):
    rank = dist.get_rank()
    x = _source_tensor(torch.float32, requires_grad) if rank == 0 else None
    return tensorpar.scatter(x).requires_grad


@pytest.mark.parametrize("requires_grad", [True, False])
def test_chunk_requires_grad_equals_source_on_every_rank(requires_grad):
    assert run_distributed(_requires_grad_follows_source, 3, requires_grad) == [requires_grad] * 3


# -- metadata messages ---------------------------------------------------------------------

def _count_messages(exchange_meta):
    rank = dist.get_rank()
    full = _source_tensor(torch.float32, requires_grad=True)
    x = full if rank == 0 else TensorPlaceholder.like(full, owner=0)
    with CommCounter() as forward:
        chunk = tensorpar.scatter(x, exchange_meta=exchange_meta)
    with CommCounter() as backward:
        chunk.sum().backward()
    with CommCounter() as gathers:
        tensorpar.gather(chunk.detach())
        tensorpar.gather(chunk.detach(), sizes=[len(c) for c in torch.tensor_split(full, 2)])
    return (forward.count(purpose="meta"), forward.count("scatter"),
            backward.count(purpose="meta"), backward.count("gather"),
            gathers.count(purpose="meta"), gathers.count("gather"))


def test_exchange_meta_false_sends_no_metadata_message():
    assert run_distributed(_count_messages, 2, False) == [(0, 1, 0, 1, 1, 2)] * 2


def test_default_sends_exactly_one_metadata_message():
    assert run_distributed(_count_messages, 2, True) == [(1, 1, 0, 1, 1, 2)] * 2


def _single_rank_issues_nothing():
    with CommCounter() as counter:
        x = torch.ones(3, 2, requires_grad=True)
        out = tensorpar.gather(tensorpar.scatter(x, dim=1), dim=1)
        out.sum().backward()
    return counter.count(), torch.equal(x.grad, torch.ones(3, 2))


def test_group_of_one_issues_no_collective():
    assert run_distributed(_single_rank_issues_nothing, 1) == [(0, True)]


# -- bad input: every rank raises the same error, no rank hangs ----------------------------

def _scatter_error(case):
    rank = dist.get_rank()
    full = _source_tensor(torch.float32)
    good = TensorPlaceholder.like(full, owner=0)
    src_x, other_x, kwargs = {
        "placeholder on source": (good, good, {}),
        "None on source": (None, None, {}),
        "list on source": ([1.0], None, {}),
        "tensor on non-source": (full, full, {}),
        "int on non-source": (full, 3, {}),
        "shape mismatch": (full, TensorPlaceholder((6, 5, 3), torch.float32, owner=0), {}),
        "dtype mismatch": (full, TensorPlaceholder(SHAPE, torch.float64, owner=0), {}),
        "requires_grad mismatch": (full, TensorPlaceholder(SHAPE, torch.float32,
                                                           requires_grad=True), {}),
        "dim out of range": (full, None, {"dim": 3}),
        "sizes sum": (full, None, {"sizes": [3, 3, 3]}),
        "sizes length": (full, None, {"sizes": [7]}),
        "sizes negative": (full, None, {"sizes": [8, -1, 0]}),
        "src not in group": (full, None, {"src": 3}),
    }[case]
    # only the last rank makes the rank-specific mistake
    x = src_x if rank == 0 else (other_x if rank == dist.get_world_size() - 1 else None)
    try:
        tensorpar.scatter(x, **kwargs)
        outcome = None
    except Exception as e:
        outcome = (type(e).__name__, str(e))
    # the group is still usable: every rank got here and can run another collective
    chunk = tensorpar.scatter(full if rank == 0 else None)
    assert chunk.shape[0] == len(torch.tensor_split(full, dist.get_world_size())[rank])
    return outcome


@pytest.mark.parametrize("case, error, match", [
    ("placeholder on source", "CollectiveTypeError", "source rank must pass the full tensor"),
    ("None on source", "CollectiveTypeError", "got None"),
    ("list on source", "CollectiveTypeError", "not a tensor"),
    ("tensor on non-source", "CollectiveTypeError", "rank 2 passed a tensor.*TensorPlaceholder"),
    ("int on non-source", "CollectiveTypeError", "rank 2 passed something"),
    ("shape mismatch", "CollectiveArgumentError", r"float32\[6, 5, 3\].*float32\[7, 5, 3\]"),
    ("dtype mismatch", "CollectiveArgumentError", "float64.*float32"),
    ("requires_grad mismatch", "CollectiveArgumentError", "requiring grad"),
    ("dim out of range", "CollectiveArgumentError", "dim=3 is out of range for a 3-d tensor"),
    ("sizes sum", "CollectiveArgumentError", "sum to 9.*length 7 along dim 0"),
    ("sizes length", "CollectiveArgumentError", "has 1 entries, expected one per rank"),
    ("sizes negative", "CollectiveArgumentError", "non-negative"),
    ("src not in group", "CollectiveArgumentError", "src=3 is not a rank of the group"),
])
def test_scatter_bad_input_raises_on_every_rank(case, error, match):
    outcomes = run_distributed(_scatter_error, 3, case)
    for outcome in outcomes:
        assert outcome is not None and outcome[0] == error, outcomes
        assert pytest.approx(0) == 0
        import re
        assert re.search(match, outcome[1]), outcome[1]
    # the offending rank's message is the same as everyone else's
    assert len({o[1].split(" (")[0] for o in outcomes}) == 1


def _gather_error(case):
    rank = dist.get_rank()
    x = torch.zeros(rank + 1, 4)
    if rank == 1:
        x = {"trailing dim": torch.zeros(2, 5), "dtype": torch.zeros(2, 4, dtype=torch.float64),
             "ndim": torch.zeros(2, 4, 1), "not a tensor": "oops"}.get(case, x)
    dim = 2 if case == "dim out of range" else 0
    try:
        tensorpar.gather(x, dim=dim)
        outcome = None
    except Exception as e:
        outcome = (type(e).__name__, str(e))
    out = tensorpar.gather(torch.ones(1, 2))
    assert tensorpar.is_placeholder(out) == (rank != 0)
    return outcome


@pytest.mark.parametrize("case, error, match", [
    ("trailing dim", "CollectiveArgumentError", r"rank 1 has float32\[2, 5\]"),
    ("dtype", "CollectiveArgumentError", "rank 1 has float64"),
    ("ndim", "CollectiveArgumentError", r"float32\[2, 4, 1\]"),
    ("not a tensor", "CollectiveTypeError", "rank 1 passed a non-tensor"),
    ("dim out of range", "CollectiveArgumentError", "dim=2 is out of range"),
])
def test_gather_bad_input_raises_on_every_rank(case, error, match):
    import re
    outcomes = run_distributed(_gather_error, 3, case)
    for outcome in outcomes:
        assert outcome is not None and outcome[0] == error, outcomes
        assert re.search(match, outcome[1]), outcomes


def _gather_sizes_disagree():
    try:
        tensorpar.gather(torch.zeros(2, 3), sizes=[1, 1])
    except ValueError as e:
        return str(e)
    return None


def test_gather_sizes_checked_against_local_chunk():
    messages = run_distributed(_gather_sizes_disagree, 2)
    assert all("sizes[" in m and "has length 2" in m for m in messages)


def test_single_rank_errors():
    with pytest.raises(tensorpar.CollectiveTypeError, match="must pass a tensor"):
        tensorpar.scatter(None)
    with pytest.raises(tensorpar.CollectiveArgumentError, match="sum to 3"):
        tensorpar.scatter(torch.zeros(4), sizes=[3])
    with pytest.raises(ValueError, match="dst=1 is not a rank"):
        tensorpar.gather(torch.zeros(4), dst=1)
    with pytest.raises(ValueError, match="dim=1 is out of range"):
        tensorpar.gather(torch.zeros(4), dim=1)


def _arguments_disagree(fn, case):
    """Only the last rank passes another ``dim`` or ``sizes``; the others the same."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    full = _source_tensor(torch.float32)  # (7, 5, 3)
    mine = {"sizes": {"sizes": [1, 2, 4] if rank == last else [3, 2, 2]},
            "dim": {"dim": 1 if rank == last else 0},
            "dim out of range": {"dim": 3 if rank == last else 0},
            "same dim, counted from the end": {"dim": -3 if rank == last else 0}}[case]
    try:
        if fn == "scatter":
            out = tensorpar.scatter(full if rank == 0 else None, **mine)
        elif fn == "gather":
            out = tensorpar.gather(torch.zeros(rank + 1, 4, 4), **mine)
        else:
            out = tensorpar.all_gather(torch.zeros(rank + 1, 4, 4), **mine)
        outcome = ("ok", tuple(out.shape))
    except Exception as e:
        outcome = (type(e).__name__, str(e))
    tensorpar.scatter(full if rank == 0 else None)  # the group is still usable
    return outcome


@pytest.mark.parametrize("fn, case, says", [
    ("scatter", "sizes", r"disagree on sizes: ranks 0,1 \[3, 2, 2\], rank 2 \[1, 2, 4\]"),
    ("scatter", "dim", r"disagree on dim.*rank 2.*dim=1"),
    ("scatter", "dim out of range", r"disagree on dim.*rank 2.*dim=3"),
    ("gather", "dim", r"disagree on dim.*rank 2.*dim=1"),
    ("gather", "dim out of range", r"disagree on dim.*rank 2.*dim=3"),
    ("all_gather", "dim", r"disagree on dim.*rank 2.*dim=1"),
])
def test_ranks_that_disagree_on_dim_or_sizes_raise_on_every_rank(fn, case, says):
    """A scatter's chunks were cut by the source's sizes and received by each rank's own
    (silently wrong, uninitialised memory); a gather hung or went wrong on another dim."""
    import re
    outcomes = run_distributed(_arguments_disagree, 3, fn, case, timeout=40)
    for outcome in outcomes:
        assert outcome[0] == "CollectiveArgumentError", outcomes
        assert re.search(says, outcome[1]), outcome[1]
    assert len({message for _, message in outcomes}) == 1, outcomes  # the same everywhere


@pytest.mark.parametrize("fn", ["scatter", "gather", "all_gather"])
def test_the_same_dim_counted_from_either_end_agrees(fn):
    outcomes = run_distributed(_arguments_disagree, 3, fn, "same dim, counted from the end")
    assert all(status == "ok" for status, _ in outcomes), outcomes
