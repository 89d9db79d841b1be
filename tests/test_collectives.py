"""Every collective against its single-process reference: forward, backward, gradcheck."""

import re

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar.testing import run_distributed
from tests._reference import CASES, weights

GROUPS = [(1, None), (2, None), (3, None), (4, None), (4, [1, 2, 3]), (4, [0, 3])]


def _subgroup(ranks):
    if ranks is None:
        return None, dist.get_rank(), dist.get_world_size()
    group = dist.new_group(ranks)
    return group, dist.get_rank(group), len(ranks)


def _check_case(name, ranks, device="cpu"):
    """Run CASES[name] on this rank with its input on ``device``; the single-process
    reference runs on the CPU."""
    case = CASES[name]
    group, rank, p = _subgroup(ranks)
    if rank < 0:
        return "not a member"
    # reference: every rank's input in this process
    if case.replicated_input:
        shared = case.make(0, p).requires_grad_()
        ref_inputs = [shared] * p
    else:
        ref_inputs = [case.make(r, p) for r in range(p)]
        for x in ref_inputs:
            if x is not None:
                x.requires_grad_()
    ref_outputs = case.ref(ref_inputs, p)
    x = case.make(rank, p)
    if x is not None:
        x = x.to(device).requires_grad_()
        before = x.detach().clone()
    out = case.run(x, group)
    # forward
    expected = ref_outputs[rank]
    assert out.device.type == device, f"{name}: output on {out.device}, not {device}"
    if expected is None:
        assert tp.is_placeholder(out), f"{name}: expected a placeholder, got {type(out)}"
        full = next(o for o in ref_outputs if o is not None)
        assert out.shape == full.shape and out.requires_grad
    else:
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-12, atol=1e-12)
    if x is not None:
        assert torch.equal(x, before), f"{name} modified its input"
    # backward: the same total loss in one process and across the ranks
    if case.loss == "summed":
        total = sum((o * weights(r, o.shape)).sum() for r, o in enumerate(ref_outputs)
                    if o is not None)
        local = None if expected is None else (out * weights(rank, out.shape).to(device)).sum()
    else:
        total = (ref_outputs[0] * weights(0, ref_outputs[0].shape)).sum()
        local = (out * weights(0, out.shape).to(device)).sum()
    total.backward()
    (out if local is None else local).backward()
    if x is not None:
        ref_grad = ref_inputs[rank].grad
        assert x.grad.device == x.device
        torch.testing.assert_close(x.grad.cpu(), ref_grad, rtol=1e-12, atol=1e-12)
    return "ok"


@pytest.mark.parametrize("world_size, ranks", GROUPS,
                         ids=[f"{w}{'' if r is None else '-sub' + ''.join(map(str, r))}"
                              for w, r in GROUPS])
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_backward_match_single_process(name, world_size, ranks):
    results = run_distributed(_check_case, world_size, name, ranks)
    members = range(world_size) if ranks is None else ranks
    assert all(results[r] == "ok" for r in members), results


# -- gradcheck -----------------------------------------------------------------------------
# All ranks run gradcheck at once, so each rank's output must depend on its own input only
# while the numerical Jacobian is taken. Rank k checks the collective; every other rank
# runs the same collective on ``constant + 0 * x`` (constant values, but a graph path to x,
# so autograd.grad(.., inputs=x) does not prune the collective's backward) and scales the
# result by zero, so it issues the same collectives but contributes nothing. Every rank
# takes its turn as k.

GRADCHECK = {
    "all_gather": lambda x, g: tp.all_gather(x, dim=1, group=g),
    "reduce_scatter": lambda x, g: tp.reduce_scatter(x, dim=1, group=g),
    "reduce_scatter_mean": lambda x, g: tp.reduce_scatter(x, dim=1, op="mean", group=g),
    "all_reduce_sum": lambda x, g: tp.all_reduce(x, group=g),
    "all_reduce_identity": lambda x, g: tp.all_reduce(x, backward="identity", group=g),
    "all_reduce_mean": lambda x, g: tp.all_reduce(x, op="mean", group=g),
    "broadcast_reduce": lambda x, g: _broadcast_of_reduce(x, g),
    "all_to_all": lambda x, g: tp.all_to_all(x, split_dim=1, concat_dim=0, group=g),
    "copy_to_group": lambda x, g: tp.copy_to_group(x, group=g) ** 2,
    "reduce_from_group": lambda x, g: tp.reduce_from_group(x, group=g) ** 2,
    "split_to_group": lambda x, g: tp.split_to_group(x, dim=1, group=g) ** 2,
    "gather_from_group": lambda x, g: tp.gather_from_group(x, dim=1, group=g) ** 2,
}


def _broadcast_of_reduce(x, g):
    reduced = tp.reduce(x ** 2, dst=0, group=g)
    # off the root, the placeholder carries reduce's autograd anchor into the broadcast
    return tp.broadcast(reduced, src=0, group=g)


def _gradcheck(name, ranks, second_order):
    group, rank, p = _subgroup(ranks)
    if rank < 0:
        return "not a member"
    op = GRADCHECK[name]
    # gradcheck takes one vjp per output element: every rank's output must have the same
    # size, so the split dim (12) divides every group size here
    x = torch.randn(1, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(rank),
                    requires_grad=True)
    for active in range(p):
        if rank == active:
            def fn(x):
                return op(x, group)
        else:
            constant = x.detach().clone()

            def fn(x, constant=constant):
                return op(constant + 0 * x, group) * 0
        assert torch.autograd.gradcheck(fn, (x,))
        if second_order:
            assert torch.autograd.gradgradcheck(fn, (x,))
    return "ok"


@pytest.mark.parametrize("world_size, ranks", [(1, None), (2, None), (3, None),
                                               pytest.param(4, [0, 1, 3],
                                                            marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(GRADCHECK))
def test_gradcheck(name, world_size, ranks):
    results = run_distributed(_gradcheck, world_size, name, ranks, False)
    assert "ok" in results


@pytest.mark.parametrize("name", ["all_gather", "all_reduce_sum", "all_to_all",
                                  "broadcast_reduce", "gather_from_group"])
def test_second_order_gradients(name):
    assert run_distributed(_gradcheck, 2, name, None, True) == ["ok", "ok"]


# -- all_reduce backward modes ---------------------------------------------------------------

def _all_reduce_modes():
    """The two modes against the two ways a loss can count the ranks."""
    rank, p = dist.get_rank(), dist.get_world_size()
    results = {}
    for mode in ("sum", "identity"):
        x = torch.full((3,), float(rank + 1), dtype=torch.float64, requires_grad=True)
        y = tp.all_reduce(x, backward=mode)
        # replicated: every rank computes the same loss from y, counted once
        replicated = (y ** 2).sum()
        g_rep, = torch.autograd.grad(replicated, x, retain_graph=True)
        # summed: each rank's own loss; the total is the sum over ranks
        own = (y * (rank + 1)).sum()
        g_sum, = torch.autograd.grad(own, x)
        results[mode] = (g_rep.tolist(), g_sum.tolist())
    total = sum(range(1, p + 1))
    # true gradients: replicated loss L = sum(y^2) with y = sum_r x_r -> dL/dx_r = 2y;
    # summed loss L = sum_r (r+1) * sum(y) -> dL/dx_r = sum_r (r+1)
    assert results["identity"][0] == [2.0 * total] * 3
    assert results["sum"][1] == [float(total)] * 3
    # and the wrong pairings are off by the group size (or the rank's share)
    assert results["sum"][0] == [2.0 * total * p] * 3
    assert results["identity"][1] == [float(rank + 1)] * 3
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_backward_modes(world_size):
    assert all(run_distributed(_all_reduce_modes, world_size))


# -- errors ----------------------------------------------------------------------------------

def _outcome(fn):
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def _errors(case):
    rank = dist.get_rank()
    calls = {
        "bad op": lambda: tp.all_reduce(torch.ones(2), op="prod"),
        "bad backward": lambda: tp.all_reduce(torch.ones(2), backward="mean"),
        "mean of ints": lambda: tp.reduce_scatter(torch.ones(2, dtype=torch.int64), op="mean"),
        "max backward": lambda: tp.all_reduce(torch.ones(2, requires_grad=True),
                                              op="max").sum().backward(),
        "reduce_scatter max backward": lambda: tp.reduce_scatter(
            torch.ones(4, requires_grad=True), op="min").sum().backward(),
        "all_gather dims": lambda: tp.all_gather(torch.ones(2, 3 + rank), dim=0),
        "all_to_all shapes": lambda: tp.all_to_all(torch.ones(2 + rank, 4), split_dim=0,
                                                    concat_dim=1),
        "all_to_all dtype": lambda: tp.all_to_all(
            torch.ones(4, dtype=torch.float64 if rank else torch.float32),
            split_dim=0, concat_dim=0),
        "broadcast tensor off source": lambda: tp.broadcast(torch.ones(2)),
        "sizes mismatch": lambda: tp.split_to_group(torch.ones(5), sizes=[1, 1]),
    }
    outcome = _outcome(calls[case])
    # nobody hangs, and the group still works afterwards
    assert tp.all_reduce(torch.ones(1)).item() == dist.get_world_size()
    return outcome


@pytest.mark.parametrize("case, error, match", [
    ("bad op", "CollectiveArgumentError", r"op='prod' is not supported"),
    ("bad backward", "CollectiveArgumentError", "expected 'sum' or 'identity'"),
    ("mean of ints", "CollectiveArgumentError", "floating point"),
    ("max backward", "TensorparError", r"all_reduce\(op='max'\) is forward-only"),
    ("reduce_scatter max backward", "TensorparError", "forward-only"),
    ("all_gather dims", "CollectiveArgumentError", r"rank 1 has float32\[2, 4\]"),
    ("all_to_all shapes", "CollectiveArgumentError", "differ outside concat_dim"),
    ("all_to_all dtype", "CollectiveArgumentError", "same dtype"),
    ("broadcast tensor off source", "CollectiveTypeError", "rank 1 passed a tensor"),
    ("sizes mismatch", "CollectiveArgumentError", "sum to 2"),
])
def test_errors_raise_on_every_rank(case, error, match):
    outcomes = run_distributed(_errors, 2, case)
    for outcome in outcomes:
        assert outcome is not None and outcome[0] == error, outcomes
        assert re.search(match, outcome[1]), outcome[1]


def _single_rank_everything():
    x = torch.arange(6.0).view(2, 3)
    outs = [tp.all_gather(x), tp.reduce_scatter(x), tp.all_reduce(x), tp.broadcast(x),
            tp.reduce(x), tp.all_to_all(x, split_dim=0, concat_dim=1), tp.copy_to_group(x),
            tp.reduce_from_group(x),
            tp.split_to_group(x), tp.gather_from_group(x)]
    return all(torch.equal(o, x) for o in outs)


def test_group_of_one_returns_input():
    assert run_distributed(_single_rank_everything, 1) == [True]
    assert _single_rank_everything()  # and without torch.distributed initialised


# -- memory layout: non-contiguous inputs and gradients ------------------------------------------

def _layouts(name):
    """Transposed (non-contiguous) inputs and gradients on some ranks only."""
    rank, p = dist.get_rank(), dist.get_world_size()
    base = torch.arange(6.0, dtype=torch.float64).view(2, 3) + 1
    odd = rank % 2 == 1  # odd ranks hold transposed views, even ranks contiguous copies

    def laid_out(t):
        return t.t().contiguous().t() if odd else t.contiguous()

    x = laid_out(base.t().contiguous()).requires_grad_()       # values: base.t() on every rank
    if name == "broadcast":
        y, expected = tp.broadcast(x if rank == p - 1 else None, src=p - 1), base.t()
    elif name == "reduce":
        y, expected = tp.reduce(x, dst=0), base.t() * p
    else:
        y, expected = tp.all_reduce(x, op=name), base.t() * (p if name == "sum" else 1)
    weight = laid_out((torch.arange(6.0, dtype=torch.float64).view(3, 2) * 10).contiguous())
    if tp.is_placeholder(y):
        y.backward()
    else:
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
        (y * weight).sum().backward()
    w = torch.arange(6.0, dtype=torch.float64).view(3, 2) * 10
    scale = {"broadcast": p, "reduce": 1, "sum": p, "mean": 1}[name]
    if name == "broadcast" and rank != p - 1:
        return True
    torch.testing.assert_close(x.grad, w * scale, rtol=0, atol=0)
    return True


@pytest.mark.parametrize("name", ["broadcast", "reduce", "sum", "mean"])
def test_non_contiguous_inputs_and_gradients(name):
    assert all(run_distributed(_layouts, 3, name))


def _inplace_non_contiguous():
    try:
        tp.all_reduce(torch.zeros(3, 2).t(), inplace=True)
    except ValueError as e:
        return "needs a contiguous tensor" in str(e)
    return False


def test_inplace_rejects_non_contiguous_input():
    assert all(run_distributed(_inplace_non_contiguous, 2))


# -- the no-autograd path: inputs that need no gradient skip the autograd Function ---------------

def _without_autograd():
    """Each symmetric collective gives the same bytes with and without a recorded graph."""
    rank, p = dist.get_rank(), dist.get_world_size()
    every = [torch.randn(2 * p + 1, 3, dtype=torch.float64,  # an odd length: uneven chunks
                         generator=torch.Generator().manual_seed(r)) for r in range(p)]
    x = every[rank]
    even = [2] * p  # equal chunks along dim 0: the shortest paths
    uneven = [1] + [0] * (p - 2) + [2 * p]  # sums to 2p + 1, with zeros when p > 2
    assert sum(uneven) == 2 * p + 1
    expected = {
        "all_gather equal": torch.cat([t[:2] for t in every]),
        "reduce_scatter equal": sum(t[: 2 * p] for t in every)[2 * rank: 2 * rank + 2] / p,
        "all_to_all equal": torch.cat([t[2 * rank: 2 * rank + 2] for t in every]),
        "all_to_all uneven sizes": torch.cat([t.split(uneven)[rank] for t in every]),
    }
    calls = {
        "all_gather": lambda t: tp.all_gather(t[: rank + 1]),
        "reduce_scatter": lambda t: tp.reduce_scatter(t),
        "all_reduce": lambda t: tp.all_reduce(t, op="mean"),
        "all_to_all": lambda t: tp.all_to_all(t, split_dim=0, concat_dim=1),
        "all_gather equal": lambda t: tp.all_gather(t[:2], sizes=[2] * p),
        "reduce_scatter equal": lambda t: tp.reduce_scatter(t[: 2 * p], op="mean"),
        "all_to_all equal":
            lambda t: tp.all_to_all(t[: 2 * p], split_dim=0, concat_dim=0, sizes=even),
        "all_to_all uneven sizes":
            lambda t: tp.all_to_all(t, split_dim=0, concat_dim=0, sizes=uneven),
    }
    same = {}
    for name, call in calls.items():
        with_graph = call(x.clone().requires_grad_())
        plain = call(x.clone())
        with torch.no_grad():
            no_grad = call(x.clone().requires_grad_())
        same[name] = (with_graph.grad_fn is not None and plain.grad_fn is None
                      and not no_grad.requires_grad
                      and torch.equal(with_graph.detach(), plain)
                      and torch.equal(plain, no_grad))
        if name in expected:
            same[name] = same[name] and torch.allclose(plain, expected[name], rtol=1e-12)
    return same


def test_inputs_without_grad_give_the_same_result():
    for world_size in (2, 3, 4):
        for same in run_distributed(_without_autograd, world_size):
            assert all(same.values()), same


def _half_mean_gradient(compiled):
    """A mean of float16 whose backward's sum would overflow if it divided after summing."""
    def mean(t):
        return tp.all_reduce(t, op="mean")

    fn = torch.compile(mean, fullgraph=True, backend="aot_eager") if compiled else mean
    x = torch.ones(4, dtype=torch.float16, requires_grad=True)
    fn(x).backward(torch.full((4,), 40000.0, dtype=torch.float16))  # fp16 max: 65504
    return x.grad.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_float16_mean_divides_its_gradient_before_the_sum(world_size, compiled):
    for grad in run_distributed(_half_mean_gradient, world_size, compiled, timeout=100):
        assert all(abs(g - 40000.0) <= 64 for g in grad), grad  # fp16 spacing here: 32


def _inplace_on_saved_tensor():
    """An in-place reduction of a tensor autograd saved must fail the backward, not corrupt it."""
    w = torch.ones(4, requires_grad=True)
    x = torch.arange(4.0)  # needs no grad itself, but `w * x` saves it for w's gradient
    loss = (w * x).sum()
    tp.all_reduce(x, inplace=True)
    try:
        loss.backward()
    except RuntimeError as e:
        return "modified by an inplace operation" in str(e)
    return False


def test_inplace_reduction_of_a_saved_tensor_is_detected():
    assert all(run_distributed(_inplace_on_saved_tensor, 2))


def _not_a_member():
    group = dist.new_group([0])  # every rank must call new_group; rank 1 is not in it
    if dist.get_rank() == 0:
        return tp.all_reduce(torch.ones(2), group=group).tolist()
    try:
        tp.all_reduce(torch.ones(2), group=group)
    except ValueError as e:
        return str(e)
    return "no error"


def test_group_without_this_rank_is_refused():
    outcomes = run_distributed(_not_a_member, 2)
    assert outcomes[0] == [1.0, 1.0]
    assert "global rank 1" in outcomes[1] and "not a member" in outcomes[1], outcomes[1]


def _all_to_all_even_on_one_rank_only():
    """Rank 0 splits evenly (2, 2), rank 1 does not (2, 1); every rank now takes the split-list
    path (the choice is made from every rank's shape, so the ranks agree on it)."""
    rank = dist.get_rank()
    lengths = [4, 3]
    x = torch.arange(lengths[rank], dtype=torch.float64) + 10 * rank
    expected = torch.cat([torch.tensor_split(torch.arange(n, dtype=torch.float64) + 10 * r,
                                             2)[rank] for r, n in enumerate(lengths)])
    return torch.equal(tp.all_to_all(x, split_dim=0, concat_dim=0), expected)


def test_all_to_all_even_on_one_rank_uneven_on_another():
    assert run_distributed(_all_to_all_even_on_one_rank_only, 2, timeout=30) == [True, True]


def _forward_mode_dual():
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(torch.ones(3), torch.ones(3))
        try:
            tp.all_reduce(dual)
        except RuntimeError as e:
            return "jvp" in str(e)
    return False


def test_forward_mode_dual_is_refused_not_stripped():
    assert run_distributed(_forward_mode_dual, 2) == [True, True]


def _all_to_all_shortcut_keeps_the_checks():
    """The dim-0 shortcut accepts exactly what the general path accepts."""
    p = dist.get_world_size()
    x = torch.arange(2.0 * p)
    outcomes = {}
    for name, kwargs in {"bool dims": {"split_dim": False, "concat_dim": 0, "sizes": [2] * p},
                         "float size": {"split_dim": 0, "concat_dim": 0,
                                        "sizes": [2] + [2.0] * (p - 1)},
                         "bool size": {"split_dim": 0, "concat_dim": 0,
                                       "sizes": [1] * p, "x": torch.arange(1.0 * p)},
                         "wrong total": {"split_dim": 0, "concat_dim": 0, "sizes": [3] * p},
                         "0-d": {"split_dim": 0, "concat_dim": 0, "sizes": [1] * p,
                                 "x": torch.tensor(1.0)}}.items():
        t = kwargs.pop("x", x)
        if name == "bool size":
            kwargs["sizes"] = [True] * p
        try:
            tp.all_to_all(t, **kwargs)
            outcomes[name] = "accepted"
        except (TypeError, ValueError) as e:  # CollectiveArgumentError is a ValueError
            outcomes[name] = type(e).__name__
    return outcomes


def test_all_to_all_shortcut_keeps_the_checks():
    for outcomes in run_distributed(_all_to_all_shortcut_keeps_the_checks, 2):
        assert "accepted" not in outcomes.values(), outcomes


def _destroyed_group():
    """tensorpar keeps no process group alive past destroy_process_group, and says so after."""
    import gc
    import weakref

    sub = dist.new_group([0, 1])
    x = torch.ones(2, requires_grad=True)
    y = tp.all_reduce(x, group=sub)  # its autograd graph holds the group (weakly)
    reduced = tp.reduce(torch.ones(2), dst=0, group=sub)  # a placeholder on rank 1
    alive = weakref.ref(sub)
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    gone = alive() is None
    if tp.is_placeholder(reduced):
        try:
            _ = reduced.group
            return gone, False
        except tp.TensorparError:
            pass
    try:
        y.sum().backward()
    except tp.TensorparError as e:
        return gone, "has been destroyed" in str(e)
    return gone, False


def test_a_destroyed_group_is_not_kept_alive():
    assert run_distributed(_destroyed_group, 2) == [(True, True)] * 2


def test_the_default_group_is_resolved_again_after_it_is_replaced():
    """``group=None`` reuses the last resolved default group only while WORLD is that group."""
    from tensorpar.comm._group import Group, resolve_group

    assert not dist.is_initialized()  # this runs in the test process, not on a pooled rank
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        first = resolve_group(None)
        assert first.ref is not None and first.ref() is dist.group.WORLD
        assert resolve_group(None) is first
        dist.destroy_process_group()
        assert resolve_group(None) == Group(None, 0, 1)  # not initialised: one rank, no comm
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        second = resolve_group(None)
        assert second.ref is not None and second.ref() is dist.group.WORLD
        assert second is not first
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _uneven_exchange_point_to_point(ranks):
    """On gloo an uneven flat all-to-all goes point to point; async, on a subgroup too."""
    from tensorpar.comm import _comm
    from tensorpar.comm._group import resolve_group

    group, rank, p = _subgroup(ranks)
    if rank < 0:
        return "not a member"
    g = resolve_group(group)
    # rank r sends (r + 1) * (d + 1) elements valued 100 r + d to rank d (itself included),
    # except rank 0, which sends nothing to the last rank
    in_splits = [0 if (rank, d) == (0, p - 1) else (rank + 1) * (d + 1) for d in range(p)]
    out_splits = [0 if (s, rank) == (0, p - 1) else (s + 1) * (rank + 1) for s in range(p)]
    inp = torch.cat([torch.full((n,), 100.0 * rank + d) for d, n in enumerate(in_splits)])
    out = torch.empty(sum(out_splits))
    work = _comm.all_to_all(out, inp, out_splits, in_splits, g, async_op=True)
    assert type(work).__name__ == "_Works"
    work.wait()
    expected = torch.cat([torch.full((n,), 100.0 * s + rank) for s, n in enumerate(out_splits)])
    assert torch.equal(out, expected)
    return "ok"


@pytest.mark.parametrize("world_size, ranks", [(2, None), (3, None), (4, [3, 1, 2])])
def test_uneven_exchange_goes_point_to_point(world_size, ranks):
    results = run_distributed(_uneven_exchange_point_to_point, world_size, ranks)
    members = list(ranks or range(world_size))
    assert [results[r] for r in members] == ["ok"] * len(members)


def _exchange_beside_user_messages():
    """A receive the caller posted before an uneven all_to_all gets the caller's message."""
    rank = dist.get_rank()
    x = torch.arange(4.0) + 10 * rank
    if rank == 0:
        mine = torch.empty(1)
        pending = dist.irecv(mine, src=1)  # torch's default tag, posted first
        out = tp.all_to_all(x, split_dim=0, concat_dim=0, sizes=[1, 3])
        pending.wait()
        return mine.tolist(), out.tolist()
    out = tp.all_to_all(x, split_dim=0, concat_dim=0, sizes=[1, 3])
    dist.send(torch.tensor([42.0]), dst=0)
    return None, out.tolist()


def test_uneven_exchange_leaves_the_callers_messages_alone():
    rank0, rank1 = run_distributed(_exchange_beside_user_messages, 2, timeout=30)
    assert rank0 == ([42.0], [0.0, 10.0])
    assert rank1 == (None, [1.0, 2.0, 3.0, 11.0, 12.0, 13.0])


def _async_with_grad(fn, shape, dim):
    """async_op=True, then resolve, then autograd: as the synchronous call."""
    rank = dist.get_rank()
    results = []
    for async_op in (False, True):
        x = (torch.arange(float(torch.Size(shape).numel())).view(shape) + rank).double()
        x.requires_grad_()
        y = getattr(tp, fn)(x, dim=dim, async_op=async_op)
        y = y.resolve() if async_op else y
        (y * torch.arange(1.0, y.numel() + 1).view(y.shape)).sum().backward()
        results.append((y.detach(), x.grad))
    (sync_y, sync_grad), (async_y, async_grad) = results
    return torch.equal(sync_y, async_y) and torch.equal(sync_grad, async_grad)


@pytest.mark.parametrize("fn", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("shape, dim", [((3,), 0), ((2, 4), 1), ((5, 2), 0), ((6,), 0),
                                        ((6, 2), 0), ((1, 4), 1)],
                         ids=["uneven", "dim 1", "uneven 2-d", "even", "even 2-d",
                              "leading one"])
def test_async_collective_of_a_tensor_requiring_grad_equals_the_sync_one(fn, shape, dim):
    """reduce_scatter's staged path handed back a view of its receive buffer (autograd
    refused it), and its even path a result that the backend's copy at the wait had made
    the copy's (a zero gradient, silently)."""
    assert all(run_distributed(_async_with_grad, 2, fn, shape, dim, timeout=30))
