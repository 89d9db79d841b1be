import os

import pytest
import torch
import torch.distributed as dist

from tensorpar.testing import RankTimeoutError, run_distributed

WORLD_SIZES = [1, 2, 3, 4]


def _identity(value):
    return dist.get_rank(), dist.get_world_size(), value, os.getpid()


def _raise_on(rank):
    if dist.get_rank() == rank:
        raise KeyError(f"raised by design on {rank}")
    return dist.get_rank()


def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        dist.barrier()
    return dist.get_rank()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_returns_each_ranks_value_and_reuses_processes(world_size):
    first = run_distributed(_identity, world_size, "x")
    assert [r[:3] for r in first] == [(r, world_size, "x") for r in range(world_size)]
    second = run_distributed(_identity, world_size, "y")
    assert [r[3] for r in first] == [r[3] for r in second]  # same worker processes


@pytest.mark.parametrize("world_size", [2, 4])
def test_exception_names_rank_and_keeps_type(world_size):
    rank = world_size - 1
    with pytest.raises(KeyError, match=f"rank {rank}") as info:
        run_distributed(_raise_on, world_size, rank)
    assert "raised by design" in str(info.value)
    assert "Traceback" in str(info.value.__cause__) and "_raise_on" in str(info.value.__cause__)
    # the pool is healthy afterwards
    assert run_distributed(_all_reduce_rank, world_size) == [sum(range(world_size))] * world_size


@pytest.mark.slow
def test_hang_fails_with_timeout_and_pool_recovers():
    assert run_distributed(_all_reduce_rank, 2) == [1.0, 1.0]  # the pool is up: 2 s to reply
    with pytest.raises(RankTimeoutError,
                       match=r"\): rank 0 did not finish within 2.0 s \(rank 1 did\)"):
        run_distributed(_hang_on_rank_zero, 2, timeout=2.0)
    assert run_distributed(_all_reduce_rank, 2) == [1.0, 1.0]


def test_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_identity, 0, None)


def _raise_on_zero_while_others_block():
    if dist.get_rank() == 0:
        raise ValueError("boom on rank 0")
    dist.barrier()  # never completes: rank 0 is gone
    return dist.get_rank()


@pytest.mark.slow
def test_pool_is_replaced_after_ranks_were_left_blocked():
    with pytest.raises(ValueError, match="boom on rank 0"):
        run_distributed(_raise_on_zero_while_others_block, 3, timeout=30)
    assert run_distributed(_all_reduce_rank, 3) == [3.0, 3.0, 3.0]


def test_the_harness_errors_live_with_the_others():
    import tensorpar.errors
    import tensorpar.testing

    for name in ("RankError", "RankTimeoutError"):
        assert getattr(tensorpar.testing, name) is getattr(tensorpar.errors, name)
        assert issubclass(getattr(tensorpar.errors, name), tensorpar.errors.TensorparError)
