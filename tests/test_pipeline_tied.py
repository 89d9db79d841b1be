"""A parameter tied across stages: each holder's gradient is the dense one after every step,
also when ``.grad`` held something before it (accumulation over steps), when the step runs
under ``torch.no_grad()`` (evaluation), and when the parameter is frozen; and what crosses a
boundary that is not one tensor is refused on both sides of it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorpar as tp
from tensorpar.errors import CollectiveArgumentError, CollectiveTypeError
from tensorpar.testing import run_distributed

TOL = 1e-10


def tied(seed=0):
    """Blocks 1 and 3 are the same Linear: split [2, 3] puts them on stages 0 and 1."""
    torch.manual_seed(seed)
    shared = nn.Linear(5, 5)
    return nn.Sequential(nn.Linear(4, 5), shared, nn.Tanh(), shared, nn.Linear(5, 3)).double()


def data(step):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(6, 4, generator=g, dtype=torch.float64),
            torch.randn(6, 3, generator=g, dtype=torch.float64))


def _worst(pipe, dense):
    ref = dict(dense.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, p in pipe.named_parameters():
        if ref[name].grad is None:
            assert p.grad is None, f"{name}: a gradient where dense has none"
            continue
        worst = max(worst, float((p.grad - ref[name].grad).abs().max()))
    return worst


def _step(pipe, step, grad=True):
    x, y = data(step)
    with torch.set_grad_enabled(grad):
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)


def _accumulates(schedule, split, steps):
    dense = tied()
    pipe = tp.nn.pipeline(tied(), microbatches=3, schedule=schedule, loss_fn=F.mse_loss,
                          split=split)
    worst = []
    for step in range(steps):
        _step(pipe, step)
        x, y = data(step)
        F.mse_loss(dense(x), y).backward()
        worst.append(_worst(pipe, dense))
    return worst


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble", "gpipe"])
def test_tied_gradient_accumulates_over_steps(schedule):
    for worst in run_distributed(_accumulates, 2, schedule, [2, 3], 3, timeout=100):
        assert max(worst) < TOL, worst


@pytest.mark.timeout(120)
def test_tied_gradient_accumulates_on_three_stages():
    # the holders are ranks 0 and 2: the middle stage holds no copy
    for worst in run_distributed(_accumulates, 3, "1f1b", [2, 1, 2], 2, timeout=100):
        assert max(worst) < TOL, worst


def _evaluation_leaves_gradients(schedule):
    dense = tied()
    pipe = tp.nn.pipeline(tied(), microbatches=3, schedule=schedule, loss_fn=F.mse_loss,
                          split=[2, 3])
    _step(pipe, 0, grad=False)  # before any gradient: none appears
    assert all(p.grad is None for p in pipe.parameters())
    _step(pipe, 0)
    x, y = data(0)
    F.mse_loss(dense(x), y).backward()
    _step(pipe, 1, grad=False)  # an evaluation between the backward and the optimizer
    return _worst(pipe, dense)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_a_step_without_gradients_leaves_the_tied_gradient(schedule):
    assert max(run_distributed(_evaluation_leaves_gradients, 2, schedule, timeout=100)) < TOL


def _frozen_tied():
    def build():
        model = tied()
        model[1].weight.requires_grad_(False)
        return model
    dense = build()
    pipe = tp.nn.pipeline(build(), microbatches=3, loss_fn=F.mse_loss, split=[2, 3])
    _step(pipe, 0)
    x, y = data(0)
    F.mse_loss(dense(x), y).backward()
    worst = _worst(pipe, dense)  # (asserts the frozen weight has no gradient)
    opt = torch.optim.AdamW([p for p in pipe.parameters() if p.requires_grad],
                            weight_decay=0.1)
    opt_d = torch.optim.AdamW([p for p in dense.parameters() if p.requires_grad],
                              weight_decay=0.1)
    opt.step()
    opt_d.step()
    ref = dict(dense.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        worst = max(worst, float((p - ref[name]).abs().max()))
    return worst


@pytest.mark.timeout(120)
def test_a_frozen_tied_parameter_gets_no_gradient():
    assert max(run_distributed(_frozen_tied, 2, timeout=100)) < TOL


class _Out(nn.Module):
    """A block whose output is not one tensor (a tuple, a dict, a tensor of many dims)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if self.kind == "tuple":
            return y, y
        if self.kind == "dict":
            return {"h": y}
        if self.kind == "list":
            return [y]
        return y.reshape(y.shape[0], *([1] * 12), 4)  # 14 dims


class _Take(nn.Module):
    def forward(self, x):
        return x


def _boundary_refused(kind):
    torch.manual_seed(0)
    model = nn.Sequential(_Out(kind), _Take(), nn.Linear(4, 2)).double()
    pipe = tp.nn.pipeline(model, microbatches=2, loss_fn=lambda y, t: F.mse_loss(
        y.reshape(t.shape), t), split=[1, 2])
    x = torch.randn(4, 4, dtype=torch.float64)
    t = torch.randn(4, 2, dtype=torch.float64)
    try:
        pipe.step(x if pipe.is_first else None, t if pipe.is_last else None)
    except (CollectiveTypeError, CollectiveArgumentError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["tuple", "dict", "list", "many_dims"])
def test_a_boundary_that_is_not_one_tensor_raises_on_both_sides(kind):
    (sender, said), (receiver, heard) = run_distributed(_boundary_refused, 2, kind, timeout=50)
    assert sender != "no error" and receiver != "no error", (said, heard)
    assert "stage 0" in said and "stage 0" in heard, (said, heard)
    if kind == "many_dims":
        assert "14 dims" in said, said
    else:
        assert "one tensor" in said and type(_Out(kind)(torch.ones(1, 4))).__name__ in said


def _send_not_a_tensor():
    import torch.distributed as dist

    from tensorpar.pipeline import recv, send
    try:
        if dist.get_rank() == 0:
            send([torch.ones(2)], dst=1)
        else:
            recv(src=0)
    except CollectiveTypeError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_send_of_what_is_not_a_tensor_raises_on_the_receiver_too():
    said, heard = run_distributed(_send_not_a_tensor, 2, timeout=50)
    assert said == "send: one tensor is sent, got list", said
    assert "the sending rank raised" in heard, heard


COUNT = [None]


def _counted_cross_entropy(y, t):
    return F.cross_entropy(y, t, reduction="sum") / COUNT[0]


def _ignored_targets_summed():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)).double()
    dense = build()
    pipe = tp.nn.pipeline(build(), microbatches=3, loss_fn=_counted_cross_entropy,
                          loss_reduction="sum")
    x = torch.randn(9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([1, -100, 3, -100, -100, -100, 0, 4, -100])  # microbatch 1: all ignored
    COUNT[0] = (t != -100).sum()
    loss = pipe.step(x if pipe.is_first else None, t if pipe.is_last else None)
    dense_loss = F.cross_entropy(dense(x), t)
    dense_loss.backward()
    worst = _worst(pipe, dense)
    if pipe.is_last:
        worst = max(worst, float((loss - dense_loss).abs()))
    return worst


@pytest.mark.timeout(120)
def test_a_loss_over_counted_targets_summed_equals_dense():
    assert max(run_distributed(_ignored_targets_summed, 2, timeout=100)) < TOL


def test_loss_reduction_is_checked():
    with pytest.raises(CollectiveArgumentError, match="loss_reduction must be"):
        tp.nn.pipeline(tied(), microbatches=2, loss_fn=F.mse_loss, loss_reduction="none")


def _three_stages_refused(bad_stage):
    torch.manual_seed(0)
    blocks = [nn.Linear(4, 4), _Take(), nn.Linear(4, 4), nn.Linear(4, 2)]
    blocks[bad_stage] = _Out("tuple")
    model = nn.Sequential(*blocks).double()
    pipe = tp.nn.pipeline(model, microbatches=3, loss_fn=lambda y, t: F.mse_loss(
        y.reshape(t.shape), t), split=[1, 1, 2])
    x = torch.randn(6, 4, dtype=torch.float64)
    t = torch.randn(6, 2, dtype=torch.float64)
    try:
        pipe.step(x if pipe.is_first else None, t if pipe.is_last else None)
    except (CollectiveTypeError, CollectiveArgumentError) as e:
        return type(e).__name__
    return "no error"


@pytest.mark.timeout(90)
def test_a_refused_boundary_reaches_every_later_stage_and_leaves_the_group_clean():
    # stage 0 refuses: stage 1 raises, and tells stage 2, which raises too
    assert run_distributed(_three_stages_refused, 3, 0, timeout=40) == \
        ["CollectiveTypeError", "NothingSent", "NothingSent"]
    # the same ranks then run a pipeline that equals dense (no receive left over)
    for worst in run_distributed(_accumulates, 3, "1f1b", [2, 1, 2], 2, timeout=40):
        assert max(worst) < TOL, worst


class _HeadReusesEmbedding(nn.Module):
    """Lists ``emb`` in its first and its last block: the head is ``emb``'s weight again."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(4, 6, bias=False).double()
        self.mid = nn.Linear(6, 6).double()

    def pipeline_blocks(self):
        return [(("emb",), lambda x: torch.tanh(self.emb(x))),
                (("mid",), lambda h: torch.tanh(self.mid(h))),
                (("emb",), lambda h: F.linear(h, self.emb.weight.t()))]

    def forward(self, x):
        for _, fn in self.pipeline_blocks():
            x = fn(x)
        return x


def _same_name_on_two_stages(split):
    dense = _HeadReusesEmbedding()
    pipe = tp.nn.pipeline(_HeadReusesEmbedding(), microbatches=3, loss_fn=F.mse_loss,
                          split=split)
    worst = []
    for step in range(2):
        x, y = data(step)
        y = y[:, :1].expand(-1, 4)
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        F.mse_loss(dense(x), y).backward()
        worst.append(_worst(pipe, dense))
    return worst


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,split", [(2, [1, 2]), (3, [1, 1, 1])])
def test_a_name_listed_by_blocks_on_two_ranks_is_tied(world, split):
    """The same dense name in the first and the last block: both halves of its gradient."""
    for worst in run_distributed(_same_name_on_two_stages, world, split, timeout=100):
        assert max(worst) < TOL, worst
