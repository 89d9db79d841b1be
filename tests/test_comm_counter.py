"""CommCounter: exact counts of the collectives each function issues."""

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar import CommCounter
from tensorpar.testing import run_distributed


def _counts(name):
    rank, p = dist.get_rank(), dist.get_world_size()
    x = torch.randn(6, 4, requires_grad=True)
    calls = {
        "split_to_group": lambda: tp.split_to_group(x, dim=0),
        "gather_from_group": lambda: tp.gather_from_group(x, dim=0),
        "gather_from_group_sizes": lambda: tp.gather_from_group(x, dim=0, sizes=[6] * p),
        "copy_to_group": lambda: tp.copy_to_group(x),
        "reduce_from_group": lambda: tp.reduce_from_group(x),
        "all_reduce_sum": lambda: tp.all_reduce(x),
        "all_reduce_identity": lambda: tp.all_reduce(x, backward="identity"),
        "all_gather": lambda: tp.all_gather(x),
        "all_gather_sizes": lambda: tp.all_gather(x, sizes=[6] * p),
        "reduce_scatter": lambda: tp.reduce_scatter(x),
        "all_to_all": lambda: tp.all_to_all(x, split_dim=0, concat_dim=1),
        "all_to_all_sizes": lambda: tp.all_to_all(x, split_dim=0, concat_dim=1, sizes=[6 // p] * p),
        "broadcast": lambda: tp.broadcast(x if rank == 0 else None),
        "broadcast_known_meta": lambda: tp.broadcast(
            x if rank == 0 else tp.TensorPlaceholder((6, 4), torch.float32, requires_grad=True),
            exchange_meta=False),
    }
    with CommCounter() as forward:
        out = calls[name]()
    with CommCounter() as backward:
        out.sum().backward()

    def summary(c):
        return {k: c.count(k) for k in ("all_gather", "reduce_scatter", "all_reduce",
                                        "broadcast", "reduce", "all_to_all") if c.count(k)} | (
            {"meta": c.count(purpose="meta")} if c.count(purpose="meta") else {})

    return summary(forward), summary(backward)


@pytest.mark.parametrize("name, forward, backward", [
    ("split_to_group", {}, {"all_gather": 1}),
    ("gather_from_group", {"all_gather": 2, "meta": 1}, {}),
    ("gather_from_group_sizes", {"all_gather": 1}, {}),
    ("copy_to_group", {}, {"all_reduce": 1}),
    ("reduce_from_group", {"all_reduce": 1}, {}),
    ("all_reduce_sum", {"all_reduce": 1}, {"all_reduce": 1}),
    ("all_reduce_identity", {"all_reduce": 1}, {}),
    ("all_gather", {"all_gather": 2, "meta": 1}, {"reduce_scatter": 1}),
    ("all_gather_sizes", {"all_gather": 1}, {"reduce_scatter": 1}),
    ("reduce_scatter", {"reduce_scatter": 1}, {"all_gather": 1}),
    ("all_to_all", {"all_gather": 1, "all_to_all": 1, "meta": 1}, {"all_to_all": 1}),
    ("all_to_all_sizes", {"all_to_all": 1}, {"all_to_all": 1}),
    ("broadcast", {"all_gather": 1, "broadcast": 1, "meta": 1}, {"reduce": 1}),
    ("broadcast_known_meta", {"broadcast": 1}, {"reduce": 1}),
])
def test_exact_collective_counts(name, forward, backward):
    assert run_distributed(_counts, 2, name) == [(forward, backward)] * 2


def _bytes_and_records():
    rank = dist.get_rank()
    with CommCounter() as outer:
        with CommCounter() as inner:
            tp.all_reduce(torch.ones(10))           # 40 bytes of float32
        tp.broadcast(torch.ones(3, dtype=torch.float64) if rank == 0 else None)
    record = inner.records[0]
    return (inner.count(), outer.count(), inner.nbytes(), record.kind, record.group_size,
            record.purpose, outer.nbytes("broadcast"), repr(inner))


def test_bytes_group_size_and_nesting():
    results = run_distributed(_bytes_and_records, 3)
    assert results[0] == (1, 3, 40, "all_reduce", 3, "data", 24, "CommCounter({'all_reduce': 1})")
    assert results[1][6] == 0  # a broadcast receiver sends nothing


def _single_rank_counts():
    with CommCounter() as counter:
        x = torch.ones(4, requires_grad=True)
        tp.all_reduce(tp.all_gather(tp.reduce_scatter(tp.copy_to_group(x)))).sum().backward()
    return counter.count()


def test_group_of_one_issues_nothing():
    assert run_distributed(_single_rank_counts, 1) == [0]
