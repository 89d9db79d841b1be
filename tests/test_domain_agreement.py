"""Every rank's `parallelize_domain` call is compared before anything changes: ranks given
other dims or another model raise on every rank (before, gloo aborted the processes at the
first forward, "Received data size doesn't match expected size"; NCCL has no such check),
and a model refused on one rank is refused on every rank."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tensorpar.nn import parallelize_domain
from tensorpar.testing import run_distributed


def _convert_and_run(what):
    """Rank 1 converts differently (``what``); then a forward and backward. What it raised."""
    other = dist.get_rank() == 1
    torch.manual_seed(0)
    k = 5 if other and what == "kernel" else 3
    model = nn.Sequential(nn.Conv2d(2, 4, k, padding=k // 2), nn.ReLU(),
                          nn.Conv2d(4, 2, 3, padding=1)).double()
    if other and what == "padding_mode":
        model[0].padding_mode = "circular"
    if other and what == "refused":
        model.append(nn.LSTM(2, 2))  # a layer that cannot be converted
    dims = -1 if other and what == "dims" else -2
    pointwise = ("Tanh",) if other and what == "pointwise" else ()
    try:
        parallelize_domain(model, dims=dims, pointwise=pointwise)
        model(torch.randn(1, 2, 4, 8, dtype=torch.float64)).sum().backward()
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


DIFFER = {
    "dims": r"dims differ between rank 0 and rank 1 \(this rank, \d: \(-[12],\)\)",
    "pointwise": r"pointwise differ between rank 0 and rank 1",
    "kernel": r"the model's layers and parameters .* differ between rank 0 and rank 1",
    "padding_mode": r"the model's layers and parameters .* differ between rank 0 and rank 1",
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("what", sorted(DIFFER))
def test_ranks_that_convert_differently_raise_on_every_rank(what):
    import re

    for name, message in run_distributed(_convert_and_run, 2, what, timeout=60):
        assert name == "CollectiveArgumentError", message
        assert message.startswith("parallelize_domain: every rank of a group of 2 must call "
                                  "it with the same model and arguments"), message
        assert re.search(DIFFER[what], message), message


@pytest.mark.timeout(90)
def test_a_model_refused_on_one_rank_is_refused_on_every_rank():
    (name0, message0), (name1, message1) = run_distributed(_convert_and_run, 2, "refused",
                                                           timeout=60)
    assert name1 == "ValueError" and "cannot convert 1 layer(s)" in message1, message1
    assert name0 == "CollectiveArgumentError", message0
    assert "the call was refused on rank 1 of its group of 2" in message0, message0


def _convert_on_a_mesh(what):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1)).double()
    if dist.get_rank() == 0 and what == "refused":
        model.append(nn.LSTM(2, 2))
    if dist.get_rank() == 0 and what == "differ":
        model[0].padding_mode = "circular"
    try:
        parallelize_domain(model, dims=(-2, -1), group=mesh)
        model(torch.randn(1, 2, 4, 4, dtype=torch.float64)).sum().backward()
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["refused", "differ", "same"])
def test_a_difference_anywhere_on_a_mesh_of_tiles_raises_on_every_rank(what):
    """Rank 3 shares no group with rank 0 on a 2 x 2 mesh: it hears of rank 0's call through
    the exchange of its other dim (it went on to its first forward, and waited, when each
    group's exchange raised on its own)."""
    results = run_distributed(_convert_on_a_mesh, 4, what, timeout=90)
    if what == "same":
        assert [name for name, _ in results] == ["no error"] * 4, results
        return
    for rank, (name, message) in enumerate(results):
        if rank == 0 and what == "refused":
            assert name == "ValueError", message
            continue
        assert name == "CollectiveArgumentError", (rank, message)
    assert "refused, or differs, on another rank of the mesh" in results[3][1], results[3]


def _convert_a_lazy_layer():
    from tensorpar.nn import parallelize_domain
    model = torch.nn.Sequential(torch.nn.LazyConv2d(3, 3, padding=1), torch.nn.ReLU())
    try:
        parallelize_domain(model, dims=-2)
    except ValueError as e:
        return str(e)
    return None


def test_a_lazy_layer_not_initialised_yet_is_refused_by_name():
    """Its parameters do not exist yet (torch's own error about an uninitialised parameter
    came out before)."""
    for message in run_distributed(_convert_a_lazy_layer, 2, timeout=60):
        assert message is not None and "0 (LazyConv2d)" in message and "lazy" in message, \
            message


def _forward_with(what, mesh):
    """Rank 0's input (or mode) differs as ``what`` says; a forward and backward."""
    group = None
    if mesh:
        from torch.distributed.device_mesh import init_device_mesh
        group = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 2, 3, padding=1)).double()
    parallelize_domain(model, dims=(-2, -1) if mesh else -2, group=group)
    shape = [2, 3, 4, 8]
    dtype = torch.float64
    odd = dist.get_rank() == 0
    if odd and what in ("batch", "channels", "width"):
        shape[("batch", "channels", "width").index(what) if what != "width" else 3] += 1
    if odd and what == "dtype":
        dtype = torch.float32
        model.float()
    if odd and what == "eval":
        model.eval()
    x = torch.randn(*shape, dtype=dtype)
    if odd and what == "unbatched":
        x = x[0]
    if odd and what == "height on a mesh":  # (seen by the row's group only, the last)
        x = x[:, :, :3]
    try:
        model(x).sum().backward()
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["batch", "channels", "width", "dtype", "eval", "unbatched",
                                  "height on a mesh"])
def test_tiles_or_modes_that_differ_outside_the_split_raise_on_every_rank(what):
    # gloo aborted the processes ("Received data size doesn't match expected size"), or one
    # rank raised while the others waited; the entry's exchange of the sizes now carries
    # each tile's other dims, dtype and train/eval mode
    for mesh in (False, True) if what != "height on a mesh" else (True,):
        results = run_distributed(_forward_with, 4 if mesh else 2, what, mesh, timeout=90)
        for rank, (name, message) in enumerate(results):
            assert name == "CollectiveArgumentError", (mesh, rank, message)
            assert "differ" in message, (mesh, rank, message)
