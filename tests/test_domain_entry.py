"""Entry and exit: the field lives on rank 0, goes out with tensorpar.scatter (a placeholder
elsewhere), the loss is a mean over the whole domain (domain_mean, no gathering), the output
comes back with tensorpar.gather; gradients equal dense. The state dicts of a converted model
are the dense model's."""

import copy

import pytest
import torch
import torch.distributed as dist

import tensorpar
from tensorpar.nn import domain_layout, domain_mean, parallelize_domain
from tensorpar.testing import run_distributed
from tests._domain_unet import SmallUNet

pytestmark = pytest.mark.timeout(900)
T = 600


def _scatter_train_gather(sizes):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = SmallUNet().double()
    field = torch.randn(2, 1, sum(sizes), 8, dtype=torch.float64)
    target = torch.sin(field)
    dense = copy.deepcopy(model)
    loss_d = ((dense(field) - target) ** 2).mean()
    loss_d.backward()
    par = parallelize_domain(copy.deepcopy(model), dims=-2)
    mine = field if rank == 0 else None
    tile = tensorpar.scatter(mine, dim=2, src=0, sizes=sizes)
    goal = tensorpar.scatter(target if rank == 0 else None, dim=2, src=0, sizes=sizes)
    y = par(tile)
    loss = domain_mean((y - goal) ** 2)
    loss.backward()
    worst = abs(float(loss) - float(loss_d))
    dp = dict(dense.named_parameters())
    for name, p in par.named_parameters():
        worst = max(worst, float((p.grad - dp[name].grad).abs().max()))
    out = tensorpar.gather(y.detach(), dim=2, dst=0,
                           sizes=domain_layout(par)[0][field.shape[2]])
    if rank == 0:
        worst = max(worst, float((out - dense(field)).abs().max()))
    else:
        assert tensorpar.is_placeholder(out)
    sd = par.state_dict()
    assert list(sd) == list(dense.state_dict())
    full = tensorpar.full_state_dict(par)  # (whole on rank 0, placeholders elsewhere)
    if rank == 0:
        assert all(torch.equal(full[k], v) for k, v in sd.items())
    return worst


@pytest.mark.parametrize("world,sizes", [(2, [9, 7]), (3, [6, 0, 10])])
def test_scatter_domain_mean_gather(world, sizes):
    assert max(run_distributed(_scatter_train_gather, world, sizes, timeout=T)) < 1e-10


def test_domain_mean_one_rank():
    x = torch.arange(6.0, requires_grad=True)
    domain_mean(x).backward()
    assert torch.allclose(x.grad, torch.full((6,), 1 / 6))
    with pytest.raises(ValueError, match="no points"):
        domain_mean(torch.zeros(0))


class _Slices(torch.nn.Module):
    """Drops the first row of every tile through ``as_strided``: a call parallelize_domain
    does not follow (a slice ``x[:, :, 1:]`` is refused: `test_domain_cuts`)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(1, 2, 3, padding=1)
        self.b = torch.nn.Conv2d(2, 1, 3, padding=1)

    def forward(self, x):
        a = self.a(x)
        size = (*a.shape[:2], a.shape[2] - 1, a.shape[3])
        return self.b(a.as_strided(size, a.stride(), a.storage_offset() + a.stride(2)))


def _validated(kind):
    torch.manual_seed(0)
    model = SmallUNet().double() if kind == "unet" else _Slices().double()
    x = torch.randn(1, 1, 16, 8, dtype=torch.float64)
    par = parallelize_domain(copy.deepcopy(model), dims=-2)
    sizes = [16 // dist.get_world_size()] * dist.get_world_size()
    tile = x.narrow(2, dist.get_rank() * sizes[0], sizes[0]).clone().requires_grad_(True)
    with tensorpar.validation(True):
        try:
            par(tile).sum().backward()
        except RuntimeError as exc:
            return str(exc)
    return "ran"


def test_validation_mode_checks_every_layer():
    assert run_distributed(_validated, 2, "unet", timeout=T) == ["ran", "ran"]
    messages = run_distributed(_validated, 2, "slices", timeout=T)  # raised on every rank
    assert all("no split of this forward" in m for m in messages), messages


def _assign_after_converting():
    from torch import nn

    model = parallelize_domain(SmallUNet().double(), dims=-2)
    model.out.weight = nn.Parameter(model.out.weight.detach().clone())  # after: not hooked
    with pytest.raises(ValueError, match="replaced after parallelize_domain"):
        model(torch.randn(1, 1, 8, 8, dtype=torch.float64))
    return True


def test_a_parameter_assigned_after_converting_is_refused_at_the_forward():
    # its gradient would never be summed over the tiles (each rank would keep its own)
    assert all(run_distributed(_assign_after_converting, 2, timeout=T))
