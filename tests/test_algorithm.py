"""tensorpar.all_reduce(algorithm=...): the hierarchical path through the public collective."""

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar.testing import run_distributed
from tensorpar.topology import Topology


def _public_algorithms():
    topo = Topology.grid(2)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    out = {}
    for n in (5, 3 << 19):  # 5 elements, and 6 MiB of float32 (above "auto"'s threshold)
        x = torch.randint(-8, 9, (n,), generator=g).float()
        flat = tp.all_reduce(x)
        hier = tp.all_reduce(x, algorithm="hierarchical", topology=topo)
        auto = tp.all_reduce(x, algorithm="auto", topology=topo, op="mean")
        handle = tp.all_reduce(x.clone(), algorithm="hierarchical", topology=topo,
                               async_op=True, inplace=True)
        out[n] = (torch.equal(flat, hier), torch.equal(flat / 4, auto),
                  torch.equal(handle.resolve(), flat), torch.equal(x, x.clone()))
    errors = []
    for kwargs, x in (({"algorithm": "hierarchical"}, torch.ones(3)),
                      ({"algorithm": "ring", "topology": topo}, torch.ones(3)),
                      ({"algorithm": "hierarchical", "topology": topo, "op": "max"},
                       torch.ones(3)),
                      ({"algorithm": "hierarchical", "topology": topo},
                       torch.ones(3, requires_grad=True))):
        try:
            tp.all_reduce(x, **kwargs)
        except ValueError as e:
            errors.append(str(e))
    return out, errors


def test_all_reduce_algorithms_agree_and_refuse_what_they_cannot_do():
    for out, errors in run_distributed(_public_algorithms, 4, timeout=120):
        assert all(all(checks) for checks in out.values()), out
        assert len(errors) == 4, errors
        assert "needs topology=" in errors[0] and "expected one of" in errors[1]
        assert "op='max'" in errors[2] and "detach it" in errors[3]


def test_a_topology_of_another_size_is_refused():
    with pytest.raises(ValueError, match="group has"):
        from tensorpar._algorithm import hierarchical_topology
        from tensorpar._group import Group

        topo = Topology(machines=2, ranks_per_machine=2, machine=0, local_rank=0,
                        machine_ranks=((0, 1), (2, 3)))
        hierarchical_topology("all_reduce", "hierarchical", topo, torch.ones(2), "sum",
                              Group(None, 0, 3))
