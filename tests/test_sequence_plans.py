"""Sequence-parallel styles in hand plans, and the plans tensorpar refuses.

A small transformer written in plain PyTorch (LayerNorms with biases, row-parallel layers
with biases: every replicated parameter's gradient is partial under sequence parallelism)
trains like the dense model at any length; a plan that cannot be right is refused before
anything changes, on every rank, with the reason.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorpar as tp
from tensorpar.nn import (
    Colwise,
    Rowwise,
    SequenceGather,
    SequenceParallel,
    SequenceSplit,
    Vocab,
    plan_from_transformers,
)
from tensorpar.testing import run_distributed
from tests.test_hf_styles import local

HIDDEN, HEADS, HEAD_DIM, VOCAB = 12, 4, 3, 23


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HEADS * HEAD_DIM) for _ in range(3))
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN)

    def forward(self, x):
        b, t, _ = x.shape  # the whole sequence: SequenceGather runs before this
        q, k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 20), nn.GELU(), nn.Linear(20, HIDDEN))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


PLAN = {"embed": "vocab", "blocks.0": SequenceSplit(),
        "blocks.*.norm[12]": "sequence_parallel", "blocks.*.attn": SequenceGather(),
        "blocks.*.attn.[qkv]": Colwise(multiple_of=HEAD_DIM),
        "blocks.*.attn.o": Rowwise(multiple_of=HEAD_DIM), "blocks.*.mlp": SequenceGather(),
        "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise",
        "norm": SequenceParallel(gather_output=True), "head": Colwise(gather_output=True)}


def build():
    torch.manual_seed(0)
    net = Net().double()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return net


def _compare(dense, parallel, ids, where, run=None):
    """Outputs and every gradient of a cross-entropy step equal (1e-10); ``run``: how the
    parallel model is called (compiled, say)."""
    expected, got = dense(ids), (parallel if run is None else run)(ids)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    F.cross_entropy(expected.flatten(0, 1), ids.flatten()).backward()
    F.cross_entropy(got.flatten(0, 1), ids.flatten()).backward()
    grads = dict(dense.named_parameters())
    for name, p in parallel.named_parameters():
        torch.testing.assert_close(p.grad, local(parallel, name, grads[name].grad),
                                   rtol=1e-10, atol=1e-10, msg=f"{name}, {where}")


def plan_with(regather):
    """`PLAN`, its gathers regathering in backward or not."""
    return {k: SequenceGather(regather=regather) if isinstance(v, SequenceGather) else v
            for k, v in PLAN.items()}


def _hand_plan_trains_like_dense(regather):
    dense, parallel = build(), tp.parallelize(build(), plan_with(regather))
    opt_d = torch.optim.AdamW(dense.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(parallel.parameters(), lr=1e-2)
    for step, n in enumerate((1, 5, 8)):
        ids = torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(step))
        _compare(dense, parallel, ids, f"length {n}")
        opt_d.step(), opt_p.step(), opt_d.zero_grad(), opt_p.zero_grad()
    return {n: p.detach().clone() for n, p in parallel.named_parameters() if "norm" in n
            or n.endswith(("o.bias", "2.bias"))}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("regather", [False, True])
@pytest.mark.parametrize("world_size", [2, 3])
def test_hand_plan_trains_like_dense(world_size, regather):
    results = run_distributed(_hand_plan_trains_like_dense, world_size, regather, timeout=100)
    for name, value in results[0].items():  # norms and row biases: summed, so identical
        assert all(torch.equal(value, r[name]) for r in results[1:]), name


def _refused(plan):
    net = build()
    before = {n: p.clone() for n, p in net.state_dict().items()}
    with pytest.raises(ValueError) as info:
        tp.parallelize(net, plan)
    assert type(net.blocks[0].attn.q) is nn.Linear  # nothing changed
    assert all(torch.equal(before[n], p) for n, p in net.state_dict().items())
    return str(info.value)


def _without(*keys):
    return {k: v for k, v in PLAN.items() if k not in keys}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("plan", "message"), [
    (_without("blocks.0"), "without a SequenceSplit"),
    ({**PLAN, "blocks.*.mlp.0": Colwise(gather_output=True)}, "gathered output is whole"),
    (_without("blocks.*.mlp.2"), "no split layer or PartialGrad covers"),
    ({**PLAN, "blocks.*.norm[12]": SequenceParallel(dim=0)}, "different sequence dims"),
    ({**PLAN, "blocks.*.attn.o": Rowwise(input_is_parallel=False)}, "input_is_parallel"),
    ({**PLAN, "embed": Vocab(sequence_parallel=True)}, "split in several places"),
])
def test_hand_plans_that_cannot_be_right_are_refused(plan, message):
    assert all(message in m for m in run_distributed(_refused, 2, plan, timeout=50))


def _gather_without_split():
    net = tp.parallelize(build(), PLAN)
    with pytest.raises(RuntimeError, match="before any SequenceSplit"):
        net.blocks[1].attn(torch.zeros(2, 3, HIDDEN, dtype=torch.float64))
    return True


@pytest.mark.timeout(60)
def test_a_gather_before_any_split_says_so():
    assert all(run_distributed(_gather_without_split, 2, timeout=50))


def _tiny(config_name, model_name, **config):
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))


SMALL = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize(("config", "model", "extra", "message"), [
    ("T5Config", "T5ForConditionalGeneration",
     {"vocab_size": 32, "d_model": 16, "d_kv": 4, "d_ff": 24, "num_layers": 1, "num_heads": 4},
     "encoder-decoder"),
    ("MixtralConfig", "MixtralForCausalLM", {**SMALL, "num_local_experts": 4}, "mixture"),
    ("Olmo2Config", "Olmo2ForCausalLM", SMALL, "split by heads and features"),
    ("DeepseekV3Config", "DeepseekV3ForCausalLM",
     {**SMALL, "q_lora_rank": 8, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
      "qk_nope_head_dim": 4, "v_head_dim": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
      "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 8},
     "multi-head latent attention"),
])
def test_plan_from_transformers_refuses_sequence_parallelism_it_does_not_cover(
        config, model, extra, message):
    pytest.importorskip("transformers")
    net = _tiny(config, model, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        plan_from_transformers(net)  # plain tensor parallelism is fine
        with pytest.raises(ValueError, match="sequence_parallel=True") as info:
            plan_from_transformers(net, sequence_parallel=True)
    assert message in str(info.value)


def test_plan_from_transformers_checks_sequence_parallel():
    pytest.importorskip("transformers")
    net = _tiny("LlamaConfig", "LlamaForCausalLM", **SMALL)
    with pytest.raises(ValueError, match="expected True, False or 'regather'"):
        plan_from_transformers(net, sequence_parallel="yes")
    plan = plan_from_transformers(net, sequence_parallel="regather")
    assert plan["model.layers.0"] == SequenceSplit()
    assert plan["model.layers.*.self_attn"] == SequenceGather(regather=True)
    assert plan["model.layers.*.input_layernorm"] == SequenceParallel()
    assert plan["model.norm"] == SequenceParallel(gather_output=True)


def _validated(regather):
    dense, parallel = build(), tp.parallelize(build(), plan_with(regather))
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with tp.validation(True):
        got = parallel(ids)
        F.cross_entropy(got.flatten(0, 1), ids.flatten()).backward()
    F.cross_entropy(dense(ids).flatten(0, 1), ids.flatten()).backward()
    torch.testing.assert_close(parallel.norm.weight.grad, dense.norm.weight.grad, rtol=1e-10,
                               atol=1e-10)
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("regather", [False, True])
def test_validation_mode_accepts_sequence_parallelism(regather):
    assert all(run_distributed(_validated, 3, regather, timeout=50))


def _compiled(regather):
    torch._dynamo.reset()
    dense, parallel = build(), tp.parallelize(build(), plan_with(regather))
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    explained = torch._dynamo.explain(parallel)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    _compare(dense, parallel, ids, "compiled",
             torch.compile(parallel, backend="aot_eager", fullgraph=True))
    return True


@pytest.mark.timeout(240)
@pytest.mark.slow
@pytest.mark.parametrize("regather", [False, True])
def test_sequence_parallelism_compiles_without_graph_breaks(regather):
    """Compiled, a regathering gather keeps the gathered input (the eager path's overlapped
    regather is not traced): the same numbers, one graph."""
    assert all(run_distributed(_compiled, 2, regather, timeout=200))


EMBEDDING_SPLITS = {**_without("blocks.0"), "embed": Vocab(sequence_parallel=True)}


def _bytes_of_activations(plan, n):
    """Ring bytes of the collectives bigger than a norm's gradient, one training step."""
    parallel = tp.parallelize(build(), plan)
    ids = torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(0))
    with tp.CommCounter() as counter:
        F.cross_entropy(parallel(ids).flatten(0, 1), ids.flatten()).backward()
    p = torch.distributed.get_world_size()
    share = {"all_reduce": 2 * (p - 1) / p, "reduce_scatter": (p - 1) / p, "all_gather": p - 1}
    return sum(share.get(r.kind, 1) * r.nbytes for r in counter.records
               if r.purpose == "data" and r.nbytes > 2 * HIDDEN * 8)


def _embedding_split(n):
    dense, parallel = build(), tp.parallelize(build(), EMBEDDING_SPLITS)
    for m in (1, n + 1, n):  # uneven and empty slices too
        ids = torch.randint(0, VOCAB, (2, m), generator=torch.Generator().manual_seed(m))
        _compare(dense, parallel, ids, f"length {m}")
        dense.zero_grad(), parallel.zero_grad()
    plain = {k: v for k, v in PLAN.items() if not k.startswith(("blocks.0", "norm"))
             and not isinstance(v, (SequenceGather, SequenceParallel)) and "norm" not in k}
    return (_bytes_of_activations(EMBEDDING_SPLITS, n), _bytes_of_activations(PLAN, n),
            _bytes_of_activations(plain, n))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_embedding_can_start_the_region_with_a_reduce_scatter(world_size):
    """Vocab(sequence_parallel=True): the embedding's sum lands sliced (a reduce-scatter), so
    the model moves the bytes of tensor parallelism but for the last norm's gather."""
    n = 6 * world_size  # even slices: the bytes compare exactly
    for embedded, at_first_block, plain in run_distributed(_embedding_split, world_size, n,
                                                           timeout=100):
        unit = (world_size - 1) / world_size * 2 * n * HIDDEN * 8  # (B, T, H) float64
        assert embedded - plain == pytest.approx(unit)  # the last norm's all-gather
        assert at_first_block - plain == pytest.approx(2 * unit)  # and the split's backward


def _regathers_with_frozen_attention(frozen):
    dense, parallel = build(), tp.parallelize(build(), plan_with(True))
    for model in (dense, parallel):
        for block in model.blocks:
            for proj in (block.attn.q, block.attn.k, block.attn.v):
                proj.requires_grad_(not frozen)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(dense(ids).flatten(0, 1), ids.flatten()).backward()
    loss = F.cross_entropy(parallel(ids).flatten(0, 1), ids.flatten())
    with tp.CommCounter() as counter:
        loss.backward()
    grads = dict(dense.named_parameters())
    for name, p in parallel.named_parameters():
        assert (p.grad is None) == (grads[name].grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, local(parallel, name, grads[name].grad),
                                       rtol=1e-10, atol=1e-10, msg=name)
    return counter.count("all_gather", purpose="data")


@pytest.mark.timeout(60)
def test_regather_skips_the_all_gather_a_frozen_weight_does_not_need():
    trained = run_distributed(_regathers_with_frozen_attention, 2, False, timeout=50)[0]
    frozen = run_distributed(_regathers_with_frozen_attention, 2, True, timeout=50)[0]
    assert frozen == trained - 2, (trained, frozen)  # one attention regather per block


def _regather_events(overlap):
    """The backward's async all-gathers, their waits and the matmuls, in the order they ran."""
    from unittest import mock

    import tensorpar.nn.sequence as sequence

    dense, parallel = build(), tp.parallelize(build(), plan_with(True))
    parallel.blocks[0].attn.o.sequence.overlap = overlap  # one SequenceShards per model
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(dense(ids).flatten(0, 1), ids.flatten()).backward()
    loss = F.cross_entropy(parallel(ids).flatten(0, 1), ids.flatten())
    events, gather, resolve, matmul = [], sequence.all_gather, tp.CollaborativeTensor.resolve, \
        torch.Tensor.matmul

    def logged(name, fn):
        def call(*args, **kwargs):
            if name != "launch" or kwargs.get("async_op"):
                events.append(name)
            return fn(*args, **kwargs)
        return call

    with mock.patch.object(sequence, "all_gather", logged("launch", gather)), \
            mock.patch.object(tp.CollaborativeTensor, "resolve", logged("wait", resolve)), \
            mock.patch.object(torch.Tensor, "matmul", logged("matmul", matmul)):
        loss.backward()
    grads = dict(dense.named_parameters())
    for name, p in parallel.named_parameters():
        torch.testing.assert_close(p.grad, local(parallel, name, grads[name].grad),
                                   rtol=1e-10, atol=1e-10, msg=name)
    return events


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [True, False])
def test_regather_overlaps_the_input_gradient(overlap):
    """With ``overlap`` each regather is launched before the first reader's input gradient
    (a matmul runs while it is in flight); without, it is waited for as soon as launched."""
    for events in run_distributed(_regather_events, 2, overlap, timeout=50):
        launches = [i for i, e in enumerate(events) if e == "launch"]
        assert len(launches) == 4, events  # attention and MLP of 2 blocks
        for i in launches:
            wait = events.index("wait", i)
            assert ("matmul" in events[i:wait]) == overlap, events
