"""Validation mode: replicated parameters that drift apart across ranks are caught at the step."""

import pytest
import torch

import tensorpar as tp
from tensorpar.errors import CollectiveArgumentError
from tensorpar.nn import plan_from_transformers
from tensorpar.testing import run_distributed
from tests.test_clip import _loss, build, tokens

pytest.importorskip("transformers")


def _train(clip, steps):
    model = tp.parallelize(build(), plan_from_transformers(build()))
    head = model.get_output_embeddings()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    done = 0
    with tp.validation(True):
        try:
            for step in range(steps):
                _loss(model, tokens(step), head).backward()
                clip(model.parameters() if clip is torch.nn.utils.clip_grad_norm_ else model,
                     0.05)
                opt.step()
                opt.zero_grad()
                done += 1
        except CollectiveArgumentError as e:
            return done, str(e)
    return done, None


@pytest.mark.timeout(600)
def test_torch_clip_on_a_tp_model_raises_on_every_rank_at_the_first_step():
    for done, message in run_distributed(_train, 2, torch.nn.utils.clip_grad_norm_, 1,
                                         timeout=120):
        assert done == 0, "the drifted replicas were not caught at the first step"
        assert message is not None
        assert "replicated parameter 'model." in message  # a norm weight, named
        assert "tensorpar.nn.clip_grad_norm_" in message


@pytest.mark.timeout(600)
def test_tensorpar_clip_stays_silent_over_twenty_steps():
    for done, message in run_distributed(_train, 2, tp.nn.clip_grad_norm_, 20, timeout=300):
        assert (done, message) == (20, None)


def _drift_without_validation():
    model = tp.parallelize(build(), plan_from_transformers(build()))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    _loss(model, tokens(0), model.get_output_embeddings()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()  # drifts, unchecked: validation is off
    norm = model.model.norm.weight.detach().clone()
    return norm


def test_the_check_costs_nothing_without_validation_and_the_drift_is_real():
    a, b = run_distributed(_drift_without_validation, 2)
    assert not torch.equal(a, b)
