"""Topology: grid and detected layouts, their subgroups, and the errors with their arithmetic."""

import os

import pytest
import torch.distributed as dist

from tensorpar.hierarchical.topology import Topology
from tensorpar.testing import run_distributed

TIMEOUT = 60.0


def _members(pg):
    return None if pg is None else dist.get_process_group_ranks(pg)


def _describe(topo):
    return (topo.machines, topo.ranks_per_machine, topo.machine, topo.local_rank,
            topo.machine_ranks, _members(topo.intra_group), _members(topo.rails_group),
            _members(topo.gather_group))


def _grid(ranks_per_machine):
    return _describe(Topology.grid(ranks_per_machine))


def _detect_with(group_ranks):
    """Detect with GROUP_RANK (torchrun's machine index) set per rank as given."""
    old = os.environ.get("GROUP_RANK")
    try:
        if group_ranks is None:
            os.environ.pop("GROUP_RANK", None)
        else:
            os.environ["GROUP_RANK"] = str(group_ranks[dist.get_rank()])
        return _describe(Topology.detect())
    finally:
        if old is None:
            os.environ.pop("GROUP_RANK", None)
        else:
            os.environ["GROUP_RANK"] = old


def _subgroup_grid(parts, ranks_per_machine):
    """Every rank passes its own group of a partition of the world."""
    groups = [dist.new_group(p) for p in parts]
    mine = next(g for g, p in zip(groups, parts, strict=True) if dist.get_rank() in p)
    return _describe(Topology.grid(ranks_per_machine, group=mine))


def test_grid_2x2():
    got = run_distributed(_grid, 4, 2, timeout=TIMEOUT)
    layout = ((0, 1), (2, 3))
    assert got == [
        (2, 2, 0, 0, layout, [0, 1], [0, 2], [0, 1]),
        (2, 2, 0, 1, layout, [0, 1], [1, 3], [0, 1]),
        (2, 2, 1, 0, layout, [2, 3], [0, 2], [2, 3]),
        (2, 2, 1, 1, layout, [2, 3], [1, 3], [2, 3]),
    ]


def test_grid_one_machine_and_one_rank_per_machine():
    one_machine = run_distributed(_grid, 4, 4, timeout=TIMEOUT)
    assert [g[:4] for g in one_machine] == [(1, 4, 0, r) for r in range(4)]
    assert all(g[5:] == ([0, 1, 2, 3], None, None) for g in one_machine)
    one_each = run_distributed(_grid, 4, 1, timeout=TIMEOUT)
    assert [g[:4] for g in one_each] == [(4, 1, r, 0) for r in range(4)]
    assert all(g[5:] == (None, [0, 1, 2, 3], None) for g in one_each)


def test_detect_from_group_rank():
    got = run_distributed(_detect_with, 4, [0, 0, 1, 1], timeout=TIMEOUT)
    assert [g[:4] for g in got] == [(2, 2, 0, 0), (2, 2, 0, 1), (2, 2, 1, 0), (2, 2, 1, 1)]
    assert got[3][5:] == ([2, 3], [1, 3], [2, 3])
    # machines interleaved with the ranks: still grouped by machine, ordered by lowest rank
    got = run_distributed(_detect_with, 4, [5, 9, 5, 9], timeout=TIMEOUT)
    assert got[0][4] == ((0, 2), (1, 3))
    assert [g[5] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g[6] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_detect_without_launcher_is_one_host():
    got = run_distributed(_detect_with, 4, None, timeout=TIMEOUT)
    assert [g[:4] for g in got] == [(1, 4, 0, r) for r in range(4)]


def test_uneven_machines_raise_with_the_arithmetic():
    with pytest.raises(ValueError, match=r"different numbers of ranks: \[3, 1\].*4 = 3 \+ 1"):
        run_distributed(_detect_with, 4, [0, 0, 0, 1], timeout=TIMEOUT)


def test_grid_must_divide_the_group():
    with pytest.raises(ValueError, match=r"ranks_per_machine=3 does not divide.*4 = 1 \* 3 \+ 1"):
        run_distributed(_grid, 4, 3, timeout=TIMEOUT)


def test_subgroups_of_a_partition():
    # data-parallel groups {0, 2} and {1, 3}; one rank of each per machine
    got = run_distributed(_subgroup_grid, 4, [[0, 2], [1, 3]], 1, timeout=TIMEOUT)
    assert [g[:4] for g in got] == [(2, 1, 0, 0), (2, 1, 0, 0), (2, 1, 1, 0), (2, 1, 1, 0)]
    assert [g[6] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    got = run_distributed(_subgroup_grid, 4, [[0, 1], [2, 3]], 2, timeout=TIMEOUT)
    assert [g[5] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_single_process_and_argument_errors():
    topo = Topology.grid(1)
    assert (topo.size, topo.is_hierarchical, str(topo)) == (1, False, "1 machine x 1 rank")
    assert repr(topo) == "Topology(machines=1, ranks_per_machine=1, machine=0, local_rank=0)"
    assert Topology.detect().machine_ranks == ((0,),)
    assert topo.global_ranks == (0,) and topo.matches(None)
    with pytest.raises(ValueError, match=r"ranks_per_machine=2 does not divide the group size 1"):
        Topology.grid(2)
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        Topology.grid(0)
    with pytest.raises(TypeError, match="must be an int, got float"):
        Topology.grid(2.0)


def _foreign_topology(where):
    """A topology built on the groups {0, 2}, {1, 3}, used with the groups {0, 1}, {2, 3}."""
    import torch

    import tensorpar as tp

    rails = [dist.new_group(p) for p in ([0, 2], [1, 3])]
    dp = [dist.new_group(p) for p in ([0, 1], [2, 3])]
    rank = dist.get_rank()
    topo = Topology.grid(1, group=rails[rank % 2])
    group = dp[rank // 2]
    x = torch.tensor([float(rank)])
    flat = tp.all_reduce(x, group=group).item()
    try:
        if where == "all_reduce":
            got = tp.all_reduce(x, group=group, algorithm="hierarchical", topology=topo).item()
        else:
            tp.BucketedAllReduce(torch.nn.Linear(2, 2), group=group, algorithm="hierarchical",
                                 topology=topo)
            got = None
    except ValueError as e:
        return flat, str(e)
    return flat, got


@pytest.mark.parametrize("where", ["all_reduce", "reducer"])
def test_a_topology_of_another_group_of_the_same_size_raises_on_every_rank(where):
    got = run_distributed(_foreign_topology, 4, where, timeout=TIMEOUT)
    assert [flat for flat, _ in got] == [1.0, 1.0, 5.0, 5.0]
    for rank, (_, error) in enumerate(got):
        assert isinstance(error, str), got  # not a (wrong) sum: 2, 4, 2, 4 before the check
        mine, other = ([0, 2], [1, 3])[rank % 2], ([0, 1], [2, 3])[rank // 2]
        assert f"topology describes the group of global ranks {mine}" in error, error
        assert f"group= has global ranks {other}" in error, error


def _matches():
    dp = [dist.new_group(p) for p in ([0, 1], [2, 3])]
    again = [dist.new_group(p) for p in ([0, 1], [2, 3])]  # other groups, the same ranks
    rank = dist.get_rank()
    topo = Topology.grid(2, group=dp[rank // 2])
    return topo.matches(dp[rank // 2]), topo.matches(again[rank // 2]), topo.matches(None)


def test_a_topology_matches_its_ranks_whichever_group_object():
    assert run_distributed(_matches, 4, timeout=TIMEOUT) == [(True, True, False)] * 4


def _mixed_or_malformed(case):
    old = os.environ.get("GROUP_RANK")
    rank = dist.get_rank()
    try:
        if case == "grid and detect":
            return repr(Topology.grid(2) if rank < 2 else Topology.detect())
        os.environ["GROUP_RANK"] = "node0" if rank == 3 else str(rank // 2)
        return repr(Topology.detect())
    except ValueError as e:
        return f"ValueError: {e}"
    finally:
        if old is None:
            os.environ.pop("GROUP_RANK", None)
        else:
            os.environ["GROUP_RANK"] = old


@pytest.mark.parametrize(("case", "words"), [
    ("grid and detect", "Topology.detect on rank(s) [2, 3]"),
    ("malformed GROUP_RANK", "GROUP_RANK on rank(s) [3] is not an integer"),
])
def test_ranks_that_describe_the_layout_differently_raise_on_every_rank(case, words):
    """Ranks 0 and 1 raised, ranks 2 and 3 went on into new_group and waited there (grid
    and detect); rank 3 raised on its own and the others timed out (a GROUP_RANK that is no
    integer)."""
    results = run_distributed(_mixed_or_malformed, 4, case, timeout=TIMEOUT)
    for got in results:
        assert got.startswith("ValueError") and words in got, got
    if case == "malformed GROUP_RANK":
        assert "this rank has GROUP_RANK='node0'" in results[3], results[3]
