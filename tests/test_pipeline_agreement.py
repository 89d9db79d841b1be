"""Every rank's `pipeline` call is compared before any stage is cut: ranks given other
arguments or another model raise on every rank (before, the schedules' mismatches waited
for transfers that never came, and another split or block count gave a wrong loss with no
error); a call refused on one rank is refused on every rank."""

import itertools
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tensorpar as tp
from tensorpar.testing import run_distributed


def _model(blocks=4, last_width=4):
    torch.manual_seed(0)
    widths = [4] * blocks + [last_width]
    return nn.Sequential(*[nn.Linear(a, b) for a, b in itertools.pairwise(widths)]).double()


def _build_and_step(what):
    """Rank 1 calls `pipeline` differently (``what``); then one step. What each rank raised."""
    other = dist.get_rank() == 1
    kwargs = {"microbatches": 4, "schedule": "1f1b", "virtual_stages": 1, "split": None,
              "loss_fn": F.mse_loss, "loss_reduction": "mean"}
    model = _model()
    if other and what in ("microbatches", "refused"):
        kwargs["microbatches"] = 2 if what == "microbatches" else 0
    elif other and what == "schedule":
        kwargs["schedule"] = "gpipe"
    elif other and what == "virtual_stages":
        kwargs["virtual_stages"] = 2
    elif other and what == "loss_reduction":
        kwargs["loss_reduction"] = "sum"
    elif what == "split":
        kwargs["split"] = [1, 3] if other else [2, 2]
    elif other and what == "blocks":
        model = _model(blocks=6)
    elif other and what == "model":
        model = _model(last_width=5)
    elif other and what == "dtype":
        model = model.float()
    try:
        pipe = tp.nn.pipeline(model, **kwargs)
        x = torch.randn(8, 4, dtype=torch.float64)
        pipe.step(x if pipe.is_first else None, x if pipe.is_last else None)
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


DIFFER = {
    "microbatches": r"they differ in microbatches: \[4, 2\] \(rank order\)",
    "schedule": r"schedule differ between rank 0 and rank 1 \(this rank, \d: (1f1b|gpipe)\)",
    "virtual_stages": r"they differ in virtual_stages: \[1, 2\]",
    "loss_reduction": r"loss_reduction differ between rank 0 and rank 1",
    "split": r"the blocks of each stage .* differ between rank 0 and rank 1",
    "blocks": r"the blocks of each stage .* differ between rank 0 and rank 1",
    "model": r"the model's layers and parameters .* differ between rank 0 and rank 1",
    "dtype": r"the model's layers and parameters .* differ between rank 0 and rank 1",
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("what", sorted(DIFFER))
def test_ranks_that_call_pipeline_differently_raise_on_every_rank(what):
    results = run_distributed(_build_and_step, 2, what, timeout=60)
    for name, message in results:
        assert name == "CollectiveArgumentError", results
        assert "pipeline: every rank of a group of 2 must call it with the same" in message
        assert re.search(DIFFER[what], message), message


@pytest.mark.timeout(90)
def test_a_call_refused_on_one_rank_is_refused_on_every_rank():
    (name0, message0), (name1, message1) = run_distributed(_build_and_step, 2, "refused",
                                                           timeout=60)
    assert name1 == "CollectiveArgumentError" and "microbatches must be an int >= 1" in message1
    assert name0 == "CollectiveArgumentError", message0
    assert "the call was refused on rank 1 of its group of 2" in message0


def _same_calls_agree():
    pipe = tp.nn.pipeline(_model(), microbatches=3, loss_fn=F.mse_loss, split=[1, 3])
    dense = _model()
    x = torch.randn(7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    loss = pipe.step(x if pipe.is_first else None, x if pipe.is_last else None)
    dense_loss = F.mse_loss(dense(x), x)
    return float(loss) if pipe.is_last else None, float(dense_loss)


@pytest.mark.timeout(60)
def test_the_same_calls_agree_and_equal_dense():
    results = run_distributed(_same_calls_agree, 2, timeout=50)
    loss, dense_loss = results[1]
    assert abs(loss - dense_loss) < 1e-12, results


class _Scaled(nn.Module):
    """A module with a setting whose ``repr`` holds a memory address (a function)."""

    __constants__ = ("fn",)

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fn = lambda x: 2 * x

    def forward(self, x):
        return self.fn(self.lin(x))


def _lazy_and_unprintable_models():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), _Scaled(), nn.Linear(4, 4)).double()
    pipe = tp.nn.pipeline(model, microbatches=2, loss_fn=F.mse_loss)
    x = torch.ones(4, 4, dtype=torch.float64)
    return type(pipe.step(x if pipe.is_first else None, x if pipe.is_last else None)).__name__


@pytest.mark.timeout(60)
def test_lazy_parameters_and_settings_printed_with_an_address_are_compared_as_equal():
    """Neither has a shape or a text that is the same in every process; both were refused
    (an uninitialised parameter's shape raised, a function's address differed)."""
    assert run_distributed(_lazy_and_unprintable_models, 2, timeout=50) == \
        ["TensorPlaceholder", "Tensor"]
