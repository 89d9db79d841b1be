"""A rank that raises in the middle of a backward pass: every rank gets a clear error, and
the reducer trains on afterwards (validation mode, fresh ranks)."""

import pytest

from tests._fresh_ranks import run_fresh


def _raise_mid_backward(with_buffers):
    import torch
    import torch.distributed as dist
    from torch import nn

    import tensorpar as tp

    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)]
    if with_buffers:
        layers.insert(1, nn.BatchNorm1d(32))
    model = nn.Sequential(*layers)
    reducer = tp.BucketedAllReduce(model, bucket_cap_mb=0.001, first_bucket_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = model[0].weight  # its gradient arrives last, after other buckets were launched

    def boom(p):
        if rank == 1 and boom.armed:
            boom.armed = False
            raise KeyError("rank 1 fails in the middle of its backward pass")
    boom.armed = False
    first.register_post_accumulate_grad_hook(boom)
    errors, steps_done, step = [], 0, 0
    with tp.validation(True):
        # a script that skips a failed batch and trains until it has done 5 steps: every
        # successful step is one on every rank, so the ranks finish together
        while steps_done < 5 and step < 12:
            boom.armed = step == 2
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
            try:
                model(x).pow(2).mean().backward()
                opt.step()
                steps_done += 1
            except Exception as e:
                errors.append((step, type(e).__name__, str(e)[:200]))
            opt.zero_grad()
            step += 1
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    same = all(torch.equal(every[0], other) for other in every)
    return errors, steps_done, same, reducer.iterations


@pytest.mark.slow
@pytest.mark.parametrize("with_buffers", [False, True])
def test_a_rank_raising_mid_backward_gives_every_rank_an_error_then_training_goes_on(
        with_buffers):
    results = run_fresh(_raise_mid_backward, 2, with_buffers, pg_timeout=10.0, timeout=40.0)
    assert all(r is not None and r[0] == "ok" for r in results), results
    (errors0, done0, same, _), (errors1, done1, _, _) = (r[1] for r in results)
    assert same, "the replicas diverged"
    assert any(kind == "CollectiveMismatchError" for _, kind, _ in errors0), errors0
    assert errors1[0][:2] == (2, "KeyError"), errors1
    assert all(seconds < 15 for _, _, seconds in results)
    assert done0 == done1 == 5, (errors0, errors1)  # it trained on after the fault
