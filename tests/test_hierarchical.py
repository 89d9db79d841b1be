"""The hierarchical all-reduce equals the flat one bit for bit, on every grid and any numel."""

import gc
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from tensorpar.hierarchical import HierarchicalWork, hierarchical_all_reduce, shutdown_hierarchical
from tensorpar.hierarchical.topology import Topology
from tensorpar.testing import run_distributed

TIMEOUT = 120.0
NUMELS = [0, 1, 3, 7, 99991, 2**20]
DTYPES = [torch.float32, torch.bfloat16]


def _data(n, dtype, seed):
    # small integers: every partial sum is exact in bfloat16 too, so any summation order
    # gives the same bits and the comparison with the flat all-reduce is bit for bit
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _flat(x, op):
    if op == "mean":
        x.div_(dist.get_world_size())  # divide once, before reducing, as the hierarchical does
    dist.all_reduce(x)
    return x


def _exactness(ranks_per_machine, slice_bytes):
    topo = Topology.grid(ranks_per_machine)
    mismatches = []
    for n in NUMELS:
        for dtype in DTYPES:
            for op in ("sum", "mean"):
                x = _data(n, dtype, seed=1000 * dist.get_rank() + n)
                expected = _flat(x.clone(), op)
                kwargs = {} if slice_bytes is None else {"slice_bytes": slice_bytes}
                assert hierarchical_all_reduce(x, topo, op=op, **kwargs) is None
                if not torch.equal(_bits(x), _bits(expected)):
                    mismatches.append((n, str(dtype), op))
    return mismatches


@pytest.mark.parametrize("ranks_per_machine", [2, 4, 1], ids=["2x2", "1x4", "4x1"])
def test_equals_flat_bit_for_bit(ranks_per_machine):
    assert run_distributed(_exactness, 4, ranks_per_machine, None,
                           timeout=TIMEOUT) == [[]] * 4


def test_equals_flat_with_many_slices():
    # 40 002 bytes: slices of an odd number of bytes, many slices per tensor, and a tail
    assert run_distributed(_exactness, 4, 2, 40002, timeout=TIMEOUT) == [[]] * 4


def _async_calls_overlap():
    topo = Topology.grid(2)
    rank = dist.get_rank()
    xs = [_data(n, torch.float32, seed=rank * 7 + n) for n in (50001, 3, 2**18)]
    expected = [_flat(x.clone(), "sum") for x in xs]
    works = [hierarchical_all_reduce(x, topo, async_op=True, slice_bytes=65536) for x in xs]
    other = torch.full((5,), float(rank))
    dist.all_reduce(other)  # the caller's own collectives go on while the calls are in flight
    assert all(isinstance(w, HierarchicalWork) for w in works)
    for w in reversed(works):  # waited in any order
        assert w.wait() is True
        assert w.is_completed()
    assert works[0].wait()  # idempotent
    return [torch.equal(x, e) for x, e in zip(xs, expected, strict=True)], other[0].item()


def test_async_calls_in_flight_together():
    assert run_distributed(_async_calls_overlap, 4, timeout=TIMEOUT) == [([True] * 3, 6.0)] * 4


def _engine_threads():
    return sum(t.name == "tensorpar-hierarchical" and t.is_alive() for t in threading.enumerate())


def _released(ref):
    for _ in range(200):  # the engine drops a finished call right after issuing its last stage
        gc.collect()
        if ref() is None:
            return True
        time.sleep(0.01)
    return False


def _engine_lifecycle():
    assert shutdown_hierarchical()  # engines of earlier tests in this process, if any
    topo = Topology.grid(2)
    rank = dist.get_rank()
    found = {"idle": _engine_threads()}
    xs = [_data(n, torch.float32, seed=rank + n) for n in (99991, 3001)]
    expected = [_flat(x.clone(), "sum") for x in xs]
    work = hierarchical_all_reduce(xs[0], topo, async_op=True, slice_bytes=65536)
    found["running"] = _engine_threads()
    work.wait()
    ref = weakref.ref(work)
    del work
    found["call released"] = _released(ref)  # no finished call (and its works) kept alive
    found["stopped"] = (shutdown_hierarchical(topo, timeout=TIMEOUT), _engine_threads())
    found["stopped again"] = shutdown_hierarchical(topo)  # nothing left to stop
    hierarchical_all_reduce(xs[1], topo, slice_bytes=4096)  # starts a new thread
    found["restarted"] = _engine_threads()
    del topo
    gc.collect()  # a collected topology's thread is stopped and joined
    found["collected"] = _engine_threads()
    found["results"] = [torch.equal(x, e) for x, e in zip(xs, expected, strict=True)]
    return found


def test_engine_thread_stops_joins_and_restarts():
    # the thread that issues a topology's collectives must end before the interpreter
    # finalizes: one still releasing work handles then aborts the process
    expected = {"idle": 0, "running": 1, "call released": True, "stopped": (True, 0),
                "stopped again": True, "restarted": 1, "collected": 0, "results": [True, True]}
    assert run_distributed(_engine_lifecycle, 4, timeout=TIMEOUT) == [expected] * 4


def test_shutdown_argument_errors():
    assert shutdown_hierarchical() is True
    with pytest.raises(TypeError, match=r"topology must be a tensorpar\.Topology or "
                                        r"None, got int"):
        shutdown_hierarchical(3)


def _bytes_by_scope():
    import tensorpar as tp

    topo = Topology.grid(2)
    n = 2**16
    with tp.CommCounter() as hier:
        tp.all_reduce(torch.ones(n), algorithm="hierarchical", topology=topo)
    with tp.CommCounter() as flat:
        tp.all_reduce(torch.ones(n))
    with tp.CommCounter() as local:  # a collective on the machine's own group
        dist.all_reduce(torch.ones(1), group=topo.intra_group)  # (not tensorpar's: not counted)
        tp.all_reduce(torch.ones(n), group=topo.intra_group)
    return ([hier.nbytes(scope=s) for s in ("intra", "inter", "mixed")],
            [flat.nbytes(scope=s) for s in ("intra", "inter", "mixed")],
            [local.nbytes(scope=s) for s in ("intra", "inter", "mixed")], local.count())


def test_comm_counter_tells_intra_from_inter_machine_bytes():
    # per rank of a 2 x 2 grid, n float32: reduce-scatter n*4 and all-gather of its half n*2
    # within the machine, the half's all-reduce n*2 across; flat: n*4 over a mixed group
    n4 = 4 * 2**16
    assert run_distributed(_bytes_by_scope, 4, timeout=TIMEOUT) == \
        [([n4 + n4 // 2, n4 // 2, 0], [0, 0, n4], [n4, 0, 0], 1)] * 4


def _tensor_parallel_bytes_after_detecting_data_parallel_groups():
    import os

    import tensorpar as tp

    old = os.environ.get("GROUP_RANK")
    os.environ["GROUP_RANK"] = str(dist.get_rank() // 2)  # machines {0, 1} and {2, 3}
    try:
        dp = [dist.new_group(r) for r in ([0, 2], [1, 3])][dist.get_rank() % 2]
        tp_group = [dist.new_group(r) for r in ([0, 1], [2, 3])][dist.get_rank() // 2]
        Topology.detect(dp)  # one rank of each data-parallel group per machine
        with tp.CommCounter() as counter:
            tp.all_reduce(torch.ones(1000), group=tp_group)
        return [counter.nbytes(scope=s) for s in ("intra", "inter", "mixed")]
    finally:
        if old is None:
            os.environ.pop("GROUP_RANK", None)
        else:
            os.environ["GROUP_RANK"] = old


def test_machines_detected_through_subgroups_are_the_launchers_machines():
    """A tensor-parallel group on one machine counts as intra-machine after the data-parallel
    groups' topologies were detected (each group's machines were labelled apart: every rank a
    machine of its own, and its bytes inter-machine)."""
    assert run_distributed(_tensor_parallel_bytes_after_detecting_data_parallel_groups, 4,
                           timeout=TIMEOUT) == [[4000, 0, 0]] * 4


def _shapes_and_grad_leaf():
    topo = Topology.grid(2)
    x = torch.ones(3, 5, 7, requires_grad=True)  # a gradient bucket may be a leaf
    hierarchical_all_reduce(x, topo, op="mean")
    y = torch.arange(12, dtype=torch.int64).view(3, 4)
    hierarchical_all_reduce(y, topo)
    return (torch.equal(x.detach(), torch.ones(3, 5, 7)),
            torch.equal(y, 4 * torch.arange(12).view(3, 4)))


def test_any_shape_integer_dtype_and_leaf():
    assert run_distributed(_shapes_and_grad_leaf, 4, timeout=TIMEOUT) == [(True, True)] * 4


def test_single_rank_and_argument_errors():
    topo = Topology.grid(1)
    x = torch.arange(4.0)
    assert hierarchical_all_reduce(x, topo) is None
    work = hierarchical_all_reduce(x, topo, op="mean", async_op=True)
    assert work.wait() and work.is_completed() and torch.equal(x, torch.arange(4.0))
    with pytest.raises(ValueError, match="op must be 'sum' or 'mean', got 'max'"):
        hierarchical_all_reduce(x, topo, op="max")
    with pytest.raises(TypeError, match=r"needs a floating-point tensor, got torch\.int64"):
        hierarchical_all_reduce(torch.arange(4), topo, op="mean")
    with pytest.raises(ValueError, match=r"contiguous.*shape \(2, 2\) with strides \(1, 2\)"):
        hierarchical_all_reduce(torch.zeros(2, 2).t(), topo)
    with pytest.raises(ValueError, match="slice_bytes must be >= 1, got 0"):
        hierarchical_all_reduce(x, topo, slice_bytes=0)
    with pytest.raises(TypeError, match=r"topology must be a tensorpar\.Topology"):
        hierarchical_all_reduce(x, None)
    with pytest.raises(TypeError, match=r"tensor must be a torch\.Tensor, got list"):
        hierarchical_all_reduce([1.0], topo)
