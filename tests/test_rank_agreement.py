"""Always-on cross-rank checks: src/dst, all_to_all's backend path, parallelize's weights."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tensorpar as tp
from tensorpar.testing import run_distributed


def _outcome(call):
    """What this rank saw: ("ok", result) or (exception class name, message)."""
    try:
        return "ok", call()
    except Exception as exc:  # every rank reports, so the test sees all of them
        return type(exc).__name__, str(exc)


def _rooted_disagreement(kind):
    rank = dist.get_rank()
    root = 1 if rank == 2 else 0  # rank 2 names another root
    if kind == "scatter":
        x = torch.arange(6.0) if rank == root else None
        return _outcome(lambda: tp.scatter(x, src=root))
    if kind == "broadcast":
        x = torch.arange(6.0) if rank == root else None
        return _outcome(lambda: tp.broadcast(x, src=root))
    return _outcome(lambda: tp.gather(torch.ones(2), dst=root))


@pytest.mark.parametrize("kind, name", [("scatter", "src"), ("broadcast", "src"),
                                        ("gather", "dst")])
def test_a_rank_naming_another_root_raises_on_every_rank(kind, name):
    results = run_distributed(_rooted_disagreement, 3, kind, timeout=30)
    for cls, message in results:
        assert cls == "CollectiveArgumentError", results
        assert f"disagree on {name}" in message
        assert f"ranks 0,1 {name}=0, rank 2 {name}=1" in message, message


def _gather_then_all_gather():
    rank = dist.get_rank()
    if rank == 0:
        return _outcome(lambda: tp.gather(torch.ones(2), dst=0))
    return _outcome(lambda: tp.all_gather(torch.ones(2)))


def test_gather_paired_with_all_gather_raises_on_every_rank():
    results = run_distributed(_gather_then_all_gather, 2, timeout=30)
    for cls, message in results:
        assert cls == "CollectiveArgumentError" and "rank 1 no dst" in message, results


def _all_to_all_disagreeing_sizes(grad):
    rank = dist.get_rank()
    sizes = [2, 2] if rank == 0 else [1, 3]  # rank 0 thinks equal, rank 1 uneven
    x = torch.full((4, 3), float(rank), requires_grad=grad)
    out = tp.all_to_all(x, split_dim=0, concat_dim=0, sizes=sizes)
    dist.barrier()  # the ranks are still paired: the next collective completes
    return tuple(out.shape)


@pytest.mark.parametrize("grad", [False, True])
def test_all_to_all_with_disagreeing_sizes_takes_one_path_and_never_hangs(grad):
    # equal sizes on one rank and uneven on the other once meant the equal-split collective
    # on one and point-to-point messages on the other: a hang. Both now take one path.
    assert run_distributed(_all_to_all_disagreeing_sizes, 2, grad, timeout=30) == \
        [(4, 3), (6, 3)]


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def _parallelize_with_seeds(seeds):
    model = _mlp(seeds[dist.get_rank()])
    return _outcome(lambda: tp.parallelize(model, {"0": "colwise", "2": "rowwise"}) and "done")


def test_parallelize_refuses_ranks_with_different_weights():
    results = run_distributed(_parallelize_with_seeds, 3, [0, 0, 1], timeout=30)
    for cls, message in results:
        assert cls == "CollectiveArgumentError", results
        assert "'0.weight' (tensor #0) differs in values" in message
        assert "ranks 0,1 version 1, rank 2 version 2" in message
        assert "manual_seed" in message


def test_parallelize_accepts_identical_weights():
    assert run_distributed(_parallelize_with_seeds, 3, [5, 5, 5], timeout=30) == \
        [("ok", "done")] * 3


def _parallelize_different_models():
    if dist.get_rank() == 0:
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    else:
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.Linear(4, 4))
    return _outcome(lambda: tp.parallelize(model, {"0": "colwise", "2": "rowwise"}))


def test_parallelize_refuses_different_models():
    results = run_distributed(_parallelize_different_models, 2, timeout=30)
    for cls, message in results:
        assert cls == "CollectiveArgumentError", results
        assert "rank 0 4 parameters and buffers, rank 1 6 parameters and buffers" in message
