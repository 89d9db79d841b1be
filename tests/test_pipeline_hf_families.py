"""Every transformers causal LM family cut into pipeline stages, against its dense self.

Each family of the installed transformers that has a tensor-parallel plan and a decoder
``layers`` list (`tests._hf_sweep`'s tiny configs, four layers, float64) runs as a pipeline of
two and of three stages in one process (virtual stages: no communication, the same stage
runner), and its loss and every gradient are compared with the dense model's. The families
`HF_MODEL_TYPES` lists must be exact; every other one must be refused by name, and, run
anyway, must be shown not to be exact (so the list leaves out nothing that works). The fast
tier runs a few families of different build; the slow tier runs them all.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

import tensorpar as tp
from tensorpar.pipeline import stages
from tensorpar.pipeline.decoder import HF_MODEL_TYPES
from tensorpar.testing import run_distributed

pytest.importorskip("transformers")

from tests._hf_sweep import _build, architectures

TOL = 1e-10
LAYERS = 4
# scaled embeddings and soft-capped logits (gemma2), multipliers on both ends (granite),
# latent attention and experts (deepseek_v3), other module names (gpt_neox), mamba and
# attention layers mixed (jamba), a final norm with no parameters (olmo)
FAST = ("gemma2", "granite", "deepseek_v3", "gpt_neox", "jamba", "olmo")


def _families() -> dict[str, tuple[str, str]]:
    return {model_type: (config, cls) for model_type, config, cls in architectures()}


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in float64 (the model's own loss casts to float32)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           labels[:, 1:].reshape(-1))


def _assert_equals_dense(pipe, loss, dense, dense_loss, tol: float = TOL, what: str = ""
                         ) -> None:
    """The step's loss (last stage) and every gradient this rank holds equal dense."""
    if pipe.is_last:
        torch.testing.assert_close(loss, dense_loss.detach(), rtol=tol, atol=tol)
    grads = dict(dense.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=tol, atol=tol,
                                   msg=f"{what}{name}")


def _model(model_type: str, layers: int = LAYERS, train: bool = False) -> torch.nn.Module:
    """The family's tiny model; in eval mode unless ``train`` (dropout and router noise are
    random in training: the two sides would draw different numbers)."""
    config, cls = _families()[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _build(model_type, config, cls, layers=layers).train(train)


def _errors(model_type: str, virtual: int) -> tuple[float, list[str]]:
    """The largest difference from dense (loss and gradients) and the names that differ."""
    dense, model = _model(model_type), _model(model_type)
    ids = torch.randint(2, 101, (3, 7), generator=torch.Generator().manual_seed(1))
    # one microbatch: the batch is not split, so a family that computes parts in float32
    # (Gemma's norms) rounds as dense does, and any difference is the staging's
    pipe = tp.nn.pipeline(model, microbatches=1, virtual_stages=virtual, loss_fn=lm_loss)
    loss = pipe.step(ids, ids)
    dense_loss = lm_loss(dense(ids, use_cache=False).logits, ids)
    dense_loss.backward()
    worst, wrong = (loss - dense_loss).abs().item(), []
    grads = dict(dense.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        expected = grads[name].grad
        if (p.grad is None) != (expected is None):
            wrong.append(name)
        elif p.grad is not None:
            error = (p.grad - expected).abs().max().item()
            worst = max(worst, error)
            if not error <= TOL:  # NaN too
                wrong.append(name)
    if {n for n, _ in pipe.named_parameters()} != {n for n, _ in model.named_parameters()}:
        wrong.append("(the stages do not hold every parameter)")
    return worst, wrong


def _pruned_errors(model_type: str, count: int) -> tuple[float, list[str]]:
    """`_errors` with each of ``count`` stages on a copy of its own, pruned as a rank's is.

    (In one process a pipeline's virtual stages all live in one model, so nothing is
    deleted: this checks that each stage holds what its forward calls.) The stages' outputs
    are chained without detaching, so one backward reaches every copy.
    """
    dense = _model(model_type)
    ids = torch.randint(2, 101, (3, 7), generator=torch.Generator().manual_seed(1))
    dense_loss = lm_loss(dense(ids, use_cache=False).logits, ids)
    dense_loss.backward()
    copies, x = [], ids
    for k in range(count):
        model = _model(model_type)
        specs = stages.stage_specs(model, count, None)
        decoder = stages.decoder_of(model)
        stages.prune(model, [specs[k]], specs)
        x = stages.run_stage(model, specs[k], x, decoder)
        copies.append(model)
    loss = lm_loss(x, ids)
    loss.backward()
    worst, wrong = (loss - dense_loss).abs().item(), []
    got = {name: p.grad for model in copies  # by dense name, from the copy holding it
           for name, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    names: dict[int, tuple[torch.Tensor, list[str]]] = {}  # a tied parameter has several
    for name, p in dense.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), (p, []))[1].append(name)
    for p, its in names.values():
        parts = [got[name] for name in its if name in got]  # tied: each stage's part
        total = sum(parts[1:], parts[0]) if parts else None
        if (total is None) != (p.grad is None):
            wrong.extend(its)
        elif total is not None and p.grad is not None:
            error = (total - p.grad).abs().max().item()
            worst = max(worst, error)
            if not error <= TOL:  # NaN too
                wrong.extend(its)
    return worst, wrong


def _exact(model_type: str) -> list[str]:
    """What is not exact: a pipeline of 2 and 3 (virtual) stages, 2 and 3 pruned copies."""
    out = []
    for count in (2, 3):
        for how, errors in (("virtual", _errors), ("pruned", _pruned_errors)):
            worst, wrong = errors(model_type, count)
            if not worst <= TOL or wrong:  # a NaN loss too
                out.append(f"{count} {how} stages: {worst:.1e} {wrong[:3]}")
    return out


def _check_listed(model_type: str) -> None:
    problems = _exact(model_type)
    assert not problems, f"{model_type}: {problems}"


def _with_layers() -> list[str]:
    out = []
    for model_type in _families():
        try:
            model = _model(model_type)
        except Exception:  # the tiny config builds no model (the TP sweep says why)
            continue
        inner = getattr(model, model.base_model_prefix, None)
        if isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
            out.append(model_type)
    return out


@pytest.mark.parametrize("model_type", FAST)
def test_listed_family_equals_dense_at_two_and_three_stages(model_type):
    _check_listed(model_type)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 102 families in one process: about a minute
def test_every_listed_family_equals_dense_at_two_and_three_stages():
    missing = [t for t in HF_MODEL_TYPES if t not in _families()]
    assert not missing, f"listed but not in this transformers: {missing}"
    for model_type in HF_MODEL_TYPES:
        _check_listed(model_type)


def test_an_unlisted_family_is_refused_by_name():
    # dory loops a run of its layers: cut into stages it comes out wrong (below)
    with pytest.raises(TypeError, match="model_type 'dory' is not among the families"):
        tp.nn.pipeline(_model("dory"), microbatches=2, loss_fn=lm_loss)


@pytest.mark.slow
def test_every_unlisted_family_with_layers_is_not_exact_when_forced(monkeypatch):
    unlisted = [t for t in _with_layers() if t not in HF_MODEL_TYPES]
    assert "dory" in unlisted
    exact = []
    for model_type in unlisted:
        monkeypatch.setattr(stages, "HF_MODEL_TYPES", (model_type,))
        try:
            problems = _exact(model_type)
        except Exception:  # cut into stages, the family's forward fails: not exact
            continue
        if not problems:
            exact.append(model_type)
    assert not exact, f"exact when cut but not listed in HF_MODEL_TYPES: {exact}"


def test_a_looped_family_forced_into_stages_is_wrong(monkeypatch):
    """Why the list: dory runs a block of layers several times; staged, it differs."""
    monkeypatch.setattr(stages, "HF_MODEL_TYPES", ("dory",))
    worst, wrong = _errors("dory", 2)
    assert worst > 1e-6 and wrong


def _family_over_ranks(model_type: str, schedule: str, virtual: int) -> None:
    """Two steps of ``model_type`` (in training mode) over the ranks, microbatched, equal dense.

    (Families that compute parts in float32, Gemma's norms, differ from dense by float32
    rounding once the batch is split; granite and jamba compute in the model's dtype.)
    """
    torch.manual_seed(0)
    layers = 6
    dense, model = _model(model_type, layers, True), _model(model_type, layers, True)
    pipe = tp.nn.pipeline(model, microbatches=3, schedule=schedule, virtual_stages=virtual,
                          loss_fn=lm_loss)
    # SGD: AdamW divides a gradient that is rounding noise by its own size
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    for step, length in enumerate((7, 5)):  # a new sequence length per step
        ids = torch.randint(2, 101, (5, length), generator=torch.Generator().manual_seed(step))
        loss = pipe.step(ids if pipe.is_first else None, ids if pipe.is_last else None)
        dense_loss = lm_loss(dense(ids, use_cache=False).logits, ids)
        dense_loss.backward()
        _assert_equals_dense(pipe, loss, dense, dense_loss, what=f"{model_type} step {step}: ")
        opt.step(), dense_opt.step(), opt.zero_grad(), dense_opt.zero_grad()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("1f1b", 2), ("zero-bubble", 1)])
@pytest.mark.parametrize("model_type", ["granite", "jamba"])
def test_family_over_ranks_equals_dense(model_type, schedule, virtual, world_size):
    run_distributed(functools.partial(_family_over_ranks, model_type, schedule, virtual),
                    world_size)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_a_family_whose_layers_return_two_values_equals_dense_over_ranks(schedule):
    """Bamba's forward unpacks (hidden states, attention weights) from every layer: its
    stand-ins return two values (given one, the forward unpacks its rows, then fails)."""
    run_distributed(functools.partial(_family_over_ranks, "bamba", schedule, 1), 2)


def test_stand_ins_return_as_many_values_as_the_family_unpacks():
    from tensorpar.pipeline.decoder import LAYER_OUTPUTS, Elsewhere

    layer, x = torch.nn.Linear(2, 2), torch.ones(3)
    assert Elsewhere(layer)(x) is x and Elsewhere(layer)(hidden_states=x) is x
    out = Elsewhere(layer, 2)(x, attention_mask=None)
    assert isinstance(out, tuple) and len(out) == 2 and out[0] is x and out[1] is None
    assert LAYER_OUTPUTS["bamba"] == 2 and "bamba" in HF_MODEL_TYPES
    decoder = stages.decoder_of(_model("bamba"))
    assert {m.outputs for m in decoder.elsewhere} == {2}


def _checkpointed_over_ranks(reentrant: bool, schedule: str) -> None:
    dense, model = _model("granite", 4, True), _model("granite", 4, True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    pipe = tp.nn.pipeline(model, microbatches=2, schedule=schedule, loss_fn=lm_loss)
    ids = torch.randint(2, 101, (4, 7), generator=torch.Generator().manual_seed(0))
    loss = pipe.step(ids if pipe.is_first else None, ids if pipe.is_last else None)
    dense_loss = lm_loss(dense(ids, use_cache=False).logits, ids)
    dense_loss.backward()
    _assert_equals_dense(pipe, loss, dense, dense_loss)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_from_the_received_activation(reentrant, schedule):
    # a recompute calls the layer again with what it was given: the received activation,
    # not the stand-in hidden states the model's forward handed the stage's first layer
    run_distributed(functools.partial(_checkpointed_over_ranks, reentrant, schedule), 2)


def test_a_model_that_adds_a_router_loss_is_refused():
    # Mixtral's own loss adds a load-balancing loss over every layer's router logits, which
    # the stages hold apart: the pipeline's loss would leave it out (and a rank whose
    # stages are not its first view would find no router logits to compute it from)
    model = _model("mixtral", train=True)
    model.config.output_router_logits = True
    ids = torch.randint(2, 101, (3, 7), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids, use_cache=False)
    assert (out.loss - model.loss_function(out.logits, ids, 101)).abs() > 1e-6  # it matters
    for loss_fn in (None, lm_loss):
        with pytest.raises(ValueError, match="output_router_logits"):
            tp.nn.pipeline(model, microbatches=2, loss_fn=loss_fn)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
@pytest.mark.parametrize("model_type", ["qwen3_next", "flint"])
def test_backward_runs_outside_the_callers_autocast(model_type, schedule):
    # a step called under autocast runs its forwards there and its backwards outside, as a
    # dense loop does (loss.backward() after the autocast block); these two families'
    # backward computes with torch ops, which autocast would run in bfloat16 (about 1e-2)
    ids = torch.randint(2, 101, (3, 7), generator=torch.Generator().manual_seed(0))
    dense, model = _model(model_type).float(), _model(model_type).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dense_loss = lm_loss(dense(ids, use_cache=False).logits, ids)
    dense_loss.backward()
    pipe = tp.nn.pipeline(model, microbatches=1, virtual_stages=2, schedule=schedule,
                          loss_fn=lm_loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(ids, ids)
    assert loss == dense_loss
    _assert_equals_dense(pipe, loss, dense, dense_loss, tol=0)


def _masked_over_ranks(model_type: str, schedule: str, virtual: int, packed: bool) -> None:
    """Left-padded rows with their attention mask, or packed rows with restarting positions,
    given to every rank: loss and every gradient equal the dense model's on the same."""
    dense, model = _model(model_type, 6), _model(model_type, 6)
    for m in (dense, model):  # sdpa: a padding position's query has no key at all
        m.config._attn_implementation = "sdpa"  # (eager attention gives it NaNs)
    ids = torch.randint(2, 101, (5, 9), generator=torch.Generator().manual_seed(3))
    extra: dict[str, torch.Tensor] = {}
    labels = ids
    if packed:  # each row two documents, cut at different places
        extra["position_ids"] = torch.stack([torch.cat([torch.arange(c), torch.arange(9 - c)])
                                             for c in (3, 5, 4, 6, 2)])
    else:  # rows left-padded by 0 to 4 tokens, the padding not predicted
        mask = (torch.arange(9) >= torch.tensor([[0], [2], [4], [1], [3]])).long()
        extra["attention_mask"] = mask
        labels = ids.masked_fill(mask == 0, -100)
    count = (labels[:, 1:] != -100).sum()

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The batch's mean over its label tokens, a microbatch's share of it."""
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                               target[:, 1:].reshape(-1), reduction="sum") / count

    pipe = tp.nn.pipeline(model, microbatches=3, schedule=schedule, virtual_stages=virtual,
                          loss_fn=loss_fn, loss_reduction="sum")
    loss = pipe.step(ids if pipe.is_first else None, labels if pipe.is_last else None,
                     **extra)
    dense_loss = loss_fn(dense(ids, use_cache=False, **extra).logits, labels)
    dense_loss.backward()
    unmasked = loss_fn(_model(model_type, 6)(ids, use_cache=False).logits, labels)
    assert (unmasked - dense_loss).abs() > 1e-4  # the mask or the positions matter
    _assert_equals_dense(pipe, loss, dense, dense_loss)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("packed", [False, True], ids=["left-padded", "packed"])
@pytest.mark.parametrize("model_type,schedule,virtual,world_size",
                         [("granite", "1f1b", 1, 2), ("granite", "1f1b", 2, 3),
                          ("jamba", "zero-bubble", 1, 3)])
def test_attention_mask_and_position_ids_reach_every_stage(model_type, schedule, virtual,
                                                           world_size, packed):
    run_distributed(functools.partial(_masked_over_ranks, model_type, schedule, virtual,
                                      packed), world_size)


def _mask_on_one_rank_only() -> None:
    pipe = tp.nn.pipeline(_model("granite"), microbatches=2, loss_fn=lm_loss)
    ids = torch.randint(2, 101, (4, 7))
    mask = torch.ones(4, 7, dtype=torch.long) if pipe.is_first else None
    with pytest.raises(ValueError, match="attention_mask"):
        pipe.step(ids if pipe.is_first else None, ids if pipe.is_last else None,
                  attention_mask=mask)


@pytest.mark.timeout(60)
def test_a_mask_given_on_some_ranks_only_is_refused_on_every_rank():
    run_distributed(_mask_on_one_rank_only, 2)


def test_model_inputs_are_refused_where_they_do_not_fit():
    ids = torch.randint(2, 101, (4, 7))
    pipe = tp.nn.pipeline(_model("granite"), microbatches=2, loss_fn=lm_loss)
    with pytest.raises(ValueError, match="attention_mask has 3 rows"):
        pipe.step(ids, ids, attention_mask=torch.ones(3, 7, dtype=torch.long))
    blocks = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    pipe = tp.nn.pipeline(blocks, microbatches=2, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match="transformers"):
        pipe.step(torch.ones(4, 3), torch.ones(4, 3), position_ids=torch.zeros(4, 3))
