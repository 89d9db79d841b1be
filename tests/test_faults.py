"""Timeouts and lost ranks end in a tensorpar error on every surviving rank, naming the
collective, its sequence number, the group size and the missing rank. Each test runs on
ranks of its own with a short process-group timeout."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tensorpar as tp
from tests._fresh_ranks import run_fresh

PG_TIMEOUT = 2.0


def _skip_one_all_reduce(async_op):
    rank = dist.get_rank()
    for step in range(4):
        if rank == 1 and step == 2:
            time.sleep(PG_TIMEOUT + 1.5)  # skipped: it is "elsewhere" while rank 0 waits
            return "skipped"
        handle = tp.all_reduce(torch.ones(8), async_op=async_op)
        if async_op:
            handle.resolve()
    return "done"


def _check_timeout(results):
    status, (names, message, _), seconds = results[0]
    assert status == "err" and "CollectiveTimeoutError" in names, results[0]
    assert "PeerLostError" not in names
    assert "all_reduce #" in message and "on a group of 2" in message, message
    assert "rank 1 did not arrive" in message, message
    assert seconds < 15, seconds
    assert results[1][0] == "ok" and results[1][1] == "skipped"
    return message


@pytest.mark.slow
def test_a_rank_that_skips_a_collective_gives_a_timeout_error_naming_it():
    results = run_fresh(_skip_one_all_reduce, 2, False, pg_timeout=PG_TIMEOUT)
    _check_timeout(results)


@pytest.mark.slow
def test_resolve_of_an_async_collective_times_out_with_the_same_error():
    results = run_fresh(_skip_one_all_reduce, 2, True, pg_timeout=PG_TIMEOUT)
    _check_timeout(results)


def _train_until_rank_2_dies(hook=False):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    reducer = tp.BucketedAllReduce(model, bucket_cap_mb=0.0001, first_bucket_mb=0.0001)
    if hook:  # the buckets' all-reduces go through torch's comm hook (its futures)
        reducer.register_comm_hook(None, default_hooks.allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert len(reducer.buckets) > 1
    for step in range(20):
        x = torch.randn(8, 16)
        loss = model(x).square().mean()
        if dist.get_rank() == 2 and step == 3:
            os._exit(1)  # dies between its forward and its backward
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return "finished"


@pytest.mark.parametrize("hook", [False, True], ids=["buckets", "comm hook"])
def test_a_rank_that_dies_mid_training_gives_every_survivor_a_lost_peer_error(hook):
    # 60 s for three fresh processes to start and report on a loaded machine
    results = run_fresh(_train_until_rank_2_dies, 3, hook, pg_timeout=PG_TIMEOUT, timeout=60)
    assert results[2] is None  # the dead rank sent nothing
    for rank in (0, 1):
        status, (names, message, trace), seconds = results[rank]
        assert status == "err" and "TensorparError" in names, (rank, message, trace)
        assert "PeerLostError" in names, (rank, names, message)
        assert "on a group of 3" in message and "rank 2 went away" in message, message
        assert seconds < 15, seconds


def _reducer_with_a_hook_and_a_stuck_rank():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    reducer = tp.BucketedAllReduce(model, bucket_cap_mb=0.0001, first_bucket_mb=0.0001)
    reducer.register_comm_hook(None, default_hooks.allreduce_hook)
    for step in range(4):
        if dist.get_rank() == 1 and step == 2:
            time.sleep(PG_TIMEOUT + 1.5)  # stuck: rank 0 waits in its hooks' all-reduces
            return "stuck"
        model(torch.randn(8, 16)).square().mean().backward()
    return "finished"


@pytest.mark.slow
def test_a_stuck_rank_under_a_comm_hook_gives_a_timeout_error_naming_the_step():
    results = run_fresh(_reducer_with_a_hook_and_a_stuck_rank, 2, pg_timeout=PG_TIMEOUT)
    status, (names, message, trace), seconds = results[0]
    assert status == "err" and "CollectiveTimeoutError" in names, (message, trace[-3000:])
    assert "PeerLostError" not in names
    assert "BucketedAllReduce" in message and "comm hook" in message, message
    assert "rank 1 did not arrive" in message, message
    assert seconds < 15, seconds
    assert results[1][:2] == ("ok", "stuck")


def _all_reduce_until_rank_2_dies_and_rank_1_lags():
    rank = dist.get_rank()
    tp.all_reduce(torch.ones(4))
    if rank == 2:
        os._exit(1)
    if rank == 1:  # alive, but late to the next all-reduce: rank 0 waits there for it
        time.sleep(3.0)
    tp.all_reduce(torch.ones(4))
    return "finished"


def test_a_lost_peer_error_does_not_call_a_live_rank_gone():
    """The first rank to fail learns only which ranks reported the same failure: one still
    waiting inside the collective (alive) has not, so it may not be named as gone."""
    results = run_fresh(_all_reduce_until_rank_2_dies_and_rank_1_lags, 3,
                        pg_timeout=10.0, timeout=40)
    assert results[2] is None
    for rank in (0, 1):
        status, (names, message, trace), _ = results[rank]
        assert status == "err" and "PeerLostError" in names, (rank, message, trace[-3000:])
        assert "ranks 0,2 went away" not in message and "ranks 1,2 went away" not in message, \
            (rank, message)
        assert "rank 2" in message or "ranks 0,2" in message or "ranks 1,2" in message, message


def _pipeline_until_rank_1_dies(mid_step):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    pipe = tp.nn.pipeline(model, microbatches=4, loss_fn=lambda out, y: out.square().mean())
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    forwards = []

    def die_at_the_tenth_forward(module, args):
        forwards.append(1)
        if len(forwards) == 10:  # step 3's second microbatch, its activations in flight
            os._exit(1)

    if dist.get_rank() == 1 and mid_step:
        model._modules["2"].register_forward_pre_hook(die_at_the_tenth_forward)  # (its stage)
    for step in range(6):
        x = torch.randn(8, 8)
        if dist.get_rank() == 1 and step == 3 and not mid_step:
            os._exit(1)  # the last stage dies between two steps
        pipe.step(x if pipe.is_first else None, x if pipe.is_last else None)
        optimizer.step()
        optimizer.zero_grad()
    return "finished"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mid_step", [False, True], ids=["between steps", "mid-step"])
def test_a_pipeline_stage_that_dies_gives_its_peer_a_lost_peer_error(mid_step):
    """The pipeline's transfers and agreements: their failure names the peer, as the
    collectives' do (a raw gloo error before)."""
    results = run_fresh(_pipeline_until_rank_1_dies, 2, mid_step, pg_timeout=PG_TIMEOUT,
                        timeout=60)
    assert results[1] is None  # the dead rank sent nothing
    status, (names, message, trace), seconds = results[0]
    assert status == "err" and "PeerLostError" in names, (message, trace[-3000:])
    assert "rank 1 went away" in message and "on a group of 2" in message, message
    assert seconds < 15, seconds


def _pipeline_saves_after_its_last_stage_dies():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    pipe = tp.nn.pipeline(model, microbatches=2, loss_fn=lambda out, y: out.square().mean())
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    if dist.get_rank() == 1:
        os._exit(1)
    tp.sharded_optimizer_state_dict(pipe, optimizer)  # compares every stage's names
    return "saved"


def test_a_stage_lost_before_an_optimizer_checkpoint_gives_a_lost_peer_error():
    results = run_fresh(_pipeline_saves_after_its_last_stage_dies, 2, pg_timeout=PG_TIMEOUT,
                        timeout=30)
    status, (names, message, trace), seconds = results[0]
    assert status == "err" and "PeerLostError" in names, (message, trace[-3000:])
    assert "parameter names" in message and "rank 1 went away" in message, message
    assert seconds < 15, seconds


def _hierarchical_all_reduce_with_a_rank_elsewhere():
    topology = tp.Topology.grid(1)  # one rank per machine: the machines' exchange is a subgroup's
    tp.all_reduce(torch.ones(4), algorithm="hierarchical", topology=topology)
    if dist.get_rank() == 1:
        time.sleep(4 * PG_TIMEOUT + 4)  # alive, elsewhere
        return "elsewhere"
    tp.all_reduce(torch.ones(4), algorithm="hierarchical", topology=topology)
    return "done"


@pytest.mark.slow
def test_a_subgroup_of_the_hierarchical_all_reduce_keeps_the_jobs_timeout():
    """The topology's groups time out with the default group's timeout (torch gives a new
    group 30 minutes: the survivor waited until its peer exited)."""
    results = run_fresh(_hierarchical_all_reduce_with_a_rank_elsewhere, 2,
                        pg_timeout=PG_TIMEOUT, timeout=40)
    status, (names, message, trace), seconds = results[0]
    assert status == "err" and "CollectiveTimeoutError" in names, (message, trace[-3000:])
    assert seconds < 2 * PG_TIMEOUT + 3, seconds  # (the peer was away for 12 s)
    assert results[1][:2] == ("ok", "elsewhere")
