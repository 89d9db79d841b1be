"""tensorpar.all_reduce(algorithm=...): the hierarchical path through the public collective."""

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar.hierarchical.topology import Topology
from tensorpar.testing import run_distributed


def _public_algorithms():
    topo = Topology.grid(2)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    out = {}
    for n in (5, 3 << 19):  # 5 elements, and 6 MiB of float32 (above "auto"'s threshold)
        x = torch.randint(-8, 9, (n,), generator=g).float()
        before = x.clone()
        flat = tp.all_reduce(x)
        hier = tp.all_reduce(x, algorithm="hierarchical", topology=topo)
        auto = tp.all_reduce(x, algorithm="auto", topology=topo, op="mean")
        handle = tp.all_reduce(x.clone(), algorithm="hierarchical", topology=topo,
                               async_op=True, inplace=True)
        out[n] = (torch.equal(flat, hier), torch.equal(flat / 4, auto),
                  torch.equal(handle.resolve(), flat),
                  torch.equal(x, before))  # the calls without inplace left x alone
    errors = []
    for kwargs, x in (({"algorithm": "hierarchical"}, torch.ones(3)),
                      ({"algorithm": "ring", "topology": topo}, torch.ones(3)),
                      ({"algorithm": "hierarchical", "topology": topo, "op": "max"},
                       torch.ones(3))):
        try:
            tp.all_reduce(x, **kwargs)
        except ValueError as e:
            errors.append(str(e))
    return out, errors


@pytest.mark.slow
def test_all_reduce_algorithms_agree_and_refuse_what_they_cannot_do():
    for out, errors in run_distributed(_public_algorithms, 4, timeout=120):
        assert all(all(checks) for checks in out.values()), out
        assert len(errors) == 3, errors
        assert "needs topology=" in errors[0] and "expected one of" in errors[1]
        assert "op='max'" in errors[2]


def test_a_topology_of_another_size_is_refused():
    with pytest.raises(ValueError, match="group has"):
        from tensorpar.collectives._hierarchical import hierarchical_topology
        from tensorpar.comm._group import Group

        topo = Topology(machines=2, ranks_per_machine=2, machine=0, local_rank=0,
                        machine_ranks=((0, 1), (2, 3)), global_ranks=(0, 1, 2, 3))
        hierarchical_topology("all_reduce", "hierarchical", topo, torch.ones(2), "sum",
                              Group(None, 0, 3))


def _reducer_parity(ranks_per_machine, algorithm):
    import copy

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 3)).double()
    theirs = DDP(copy.deepcopy(ours), bucket_cap_mb=0.01)
    reducer = tp.BucketedAllReduce(ours, bucket_cap_mb=0.01, first_bucket_mb=0.005,
                                   algorithm=algorithm,
                                   topology=Topology.grid(ranks_per_machine))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(4):
        g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        x = torch.randn(8, 16, generator=g, dtype=torch.float64)
        for model, opt in zip((ours, theirs), opts, strict=True):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    gap = max((a - b).abs().max().item()
              for a, b in zip(ours.parameters(), theirs.module.parameters(), strict=True))
    return gap, len(reducer.buckets)


@pytest.mark.parametrize("world_size, ranks_per_machine, algorithm",
                         [pytest.param(4, 2, "hierarchical", marks=pytest.mark.slow),
                          (2, 1, "hierarchical"),
                          pytest.param(4, 2, "auto", marks=pytest.mark.slow),
                          pytest.param(3, 3, "hierarchical", marks=pytest.mark.slow)])
def test_reducer_with_the_hierarchical_algorithm_matches_ddp(world_size, ranks_per_machine,
                                                             algorithm):
    results = run_distributed(_reducer_parity, world_size, ranks_per_machine, algorithm,
                              timeout=120)
    for gap, buckets in results:
        assert buckets > 1 and gap < 1e-12, results


def _backward_parity(ranks_per_machine):
    """all_reduce under autograd, flat and hierarchical: outputs and gradients, and the
    collectives each backward issued."""
    topo = Topology.grid(ranks_per_machine)
    rank = dist.get_rank()
    out = {}
    for op in ("sum", "mean"):
        for mode in ("sum", "identity"):
            for inplace in (False, True):
                runs = []
                for algorithm in ("flat", "hierarchical"):
                    g = torch.Generator().manual_seed(rank)
                    x = torch.randint(-8, 9, (7, 3), generator=g).double().requires_grad_()
                    w = torch.randint(-8, 9, (7, 3), generator=g).double()
                    y = tp.all_reduce(x * 2, op=op, backward=mode, inplace=inplace,
                                      algorithm=algorithm, topology=topo)
                    with tp.CommCounter() as counter:
                        (y * w).sum().backward()
                    runs.append((y.grad_fn is not None, y.detach(), x.grad,
                                 counter.count("reduce_scatter")))
                (rec_f, y_f, grad_f, _), (rec_h, y_h, grad_h, scatters) = runs
                out[op, mode, inplace] = (rec_f and rec_h, torch.equal(y_f, y_h),
                                          torch.equal(grad_f, grad_h), scatters)
    # double backward: the same second derivatives, and the second backward reduces
    # hierarchically too; in validation mode as well (the backwards check fingerprints)
    for validate in (False, True):
        for mode in ("sum", "identity"):
            seconds = []
            for algorithm in ("flat", "hierarchical"):
                g = torch.Generator().manual_seed(rank)
                x = torch.randint(-4, 5, (6,), generator=g).double().requires_grad_()
                w = torch.randint(-4, 5, (6,), generator=g).double()
                with tp.validation(validate):
                    y = tp.all_reduce(x * x, backward=mode, algorithm=algorithm, topology=topo)
                    (gx,) = torch.autograd.grad((y * w).sum(), x, create_graph=True)
                    with tp.CommCounter() as counter:
                        (ggx,) = torch.autograd.grad((gx * w).sum(), x)
                seconds.append((gx.detach(), ggx, counter.count("reduce_scatter")))
            (gx_f, ggx_f, _), (gx_h, ggx_h, scatters) = seconds
            out["double", mode, validate] = (True, torch.equal(gx_f, gx_h),
                                             torch.equal(ggx_f, ggx_h), scatters)
    return out


@pytest.mark.parametrize("ranks_per_machine", [2, 4], ids=["2x2", "1x4"])
def test_hierarchical_backward_equals_flat_backward(ranks_per_machine):
    for got in run_distributed(_backward_parity, 4, ranks_per_machine, timeout=120):
        assert len(got) == 12
        for (op, mode, inplace), (recorded, same_out, same_grad, scatters) in got.items():
            assert recorded and same_out and same_grad, (op, mode, inplace, got)
            if op == "double":  # on 2 x 2 the second backward reduces machine by machine:
                # sum: the backward's all-reduce and the forward's (reached through the tie);
                # identity: its copy's all-reduce (the forward's backward issues nothing)
                expected = {"sum": 2, "identity": 1}[mode] if ranks_per_machine == 2 else 0
                assert scatters == expected, (mode, inplace, got)
                continue
            # the 2 x 2 backward reduces the gradient machine by machine; identity issues none
            expected = 1 if ranks_per_machine == 2 and mode == "sum" else 0
            assert scatters == expected, (op, mode, inplace, scatters)
