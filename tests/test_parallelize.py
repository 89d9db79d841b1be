"""parallelize() on a transformer it did not write, DTensor equivalence, 2-D (dp x tp) training."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import tensorpar as tp
from tensorpar.nn import Colwise, Rowwise, vocab_parallel_cross_entropy
from tensorpar.testing import run_distributed

CONFIG = {"vocab": 101, "dim": 24, "heads": 6, "head_dim": 4, "hidden": 50, "layers": 2}


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.head_dim = c["head_dim"]
        self.q_proj = nn.Linear(c["dim"], c["heads"] * c["head_dim"], bias=False)
        self.k_proj = nn.Linear(c["dim"], c["heads"] * c["head_dim"], bias=False)
        self.v_proj = nn.Linear(c["dim"], c["heads"] * c["head_dim"], bias=False)
        self.o_proj = nn.Linear(c["heads"] * c["head_dim"], c["dim"])

    def forward(self, x):  # the head count is read off the tensors, never from a config
        q, k, v = (rearrange(p(x), "b t (h d) -> b h t d", d=self.head_dim)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(rearrange(out, "b h t d -> b t (h d)"))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(c["dim"]), nn.LayerNorm(c["dim"])
        self.attn = Attention(c)
        self.up = nn.Linear(c["dim"], c["hidden"])
        self.down = nn.Linear(c["hidden"], c["dim"])

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed = nn.Embedding(c["vocab"], c["dim"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.norm = nn.LayerNorm(c["dim"])
        self.lm_head = nn.Linear(c["dim"], c["vocab"], bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def plan(head_dim):
    return {
        "embed": "vocab",
        "layers.*.attn.[qkv]_proj": Colwise(multiple_of=head_dim),
        "layers.*.attn.o_proj": Rowwise(multiple_of=head_dim),
        "layers.*.up": "colwise",
        "layers.*.down": "rowwise",
        "lm_head": "colwise",
    }


def build(dtype=torch.float64):
    torch.manual_seed(0)
    return TinyLM(CONFIG).to(dtype)


def tokens(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG["vocab"], (3, 9), generator=g), \
        torch.randint(0, CONFIG["vocab"], (3, 9), generator=g)


def _shard_of(model, name):
    """(dim, start, stop) of a parameter's shard in the dense tensor, or None if replicated."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, tp.nn.ColumnParallelLinear | tp.nn.VocabParallelEmbedding):
        return 0, module.shard.start, module.shard.stop
    if isinstance(module, tp.nn.RowParallelLinear) and leaf == "weight":
        return 1, module.shard.start, module.shard.stop
    if isinstance(module, tp.nn.ParallelEmbedding):
        return 1, module.shard.start, module.shard.stop
    return None


def _compare_grads(dense, parallel, tol):
    dense_grads = {n: p.grad for n, p in dense.named_parameters()}
    for name, p in parallel.named_parameters():
        expected = dense_grads[name]
        shard = _shard_of(parallel, name)
        if shard is not None:
            dim, start, stop = shard
            expected = expected.narrow(dim, start, stop - start)
        torch.testing.assert_close(p.grad, expected, rtol=tol, atol=tol, msg=name)


def _transformer():
    dense, parallel = build(), tp.parallelize(build(), plan(CONFIG["head_dim"]))
    ids, target = tokens(0)
    dense_logits = dense(ids)
    dense_loss = F.cross_entropy(dense_logits.flatten(0, 1), target.flatten())
    dense_loss.backward()
    local_logits = parallel(ids)
    lm = parallel.lm_head
    torch.testing.assert_close(local_logits, dense_logits[..., lm.shard.start: lm.shard.stop],
                               rtol=1e-10, atol=1e-10)
    loss = vocab_parallel_cross_entropy(local_logits.flatten(0, 1), target.flatten(),
                                        sizes=lm.shard.sizes)
    torch.testing.assert_close(loss, dense_loss, rtol=1e-12, atol=1e-12)
    loss.backward()
    _compare_grads(dense, parallel, 1e-10)
    heads = parallel.layers[0].attn.q_proj.shard.length // CONFIG["head_dim"]
    return heads, loss.item()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parallelized_transformer_matches_dense(world_size):
    results = run_distributed(_transformer, world_size)
    heads = [h for h, _ in results]
    assert sum(heads) == CONFIG["heads"]  # whole heads only: 6 -> e.g. 2, 2, 1, 1 on 4 ranks
    assert len({loss for _, loss in results}) == 1


def _training_curve():
    dense, parallel = build(), tp.parallelize(build(), plan(CONFIG["head_dim"]))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (dense, parallel)]
    curves = ([], [])
    ids, target = tokens(0)  # one batch, memorised: the loss must fall
    for _ in range(20):
        losses = (F.cross_entropy(dense(ids).flatten(0, 1), target.flatten()),
                  vocab_parallel_cross_entropy(parallel(ids).flatten(0, 1), target.flatten()))
        for loss, opt, curve in zip(losses, opts, curves, strict=True):
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(loss.item())
    return curves


@pytest.mark.parametrize("world_size", [2, 3])
def test_twenty_training_steps_give_the_dense_loss_curve(world_size):
    for dense, parallel in run_distributed(_training_curve, world_size, timeout=120):
        assert dense[-1] < dense[0] - 0.5  # it learned something
        torch.testing.assert_close(torch.tensor(parallel), torch.tensor(dense), rtol=1e-9,
                                   atol=1e-9)


def _state_dict_round_trip():
    rank, dst = dist.get_rank(), dist.get_world_size() - 1
    dense = build()
    parallel = tp.parallelize(build(), plan(CONFIG["head_dim"]))
    state = tp.full_state_dict(parallel, dst=dst)
    assert list(state) == list(dense.state_dict())  # the dense model's keys, in order
    if rank == dst:
        for key, value in dense.state_dict().items():
            assert torch.equal(state[key], value), key
    else:
        assert all(tp.is_placeholder(v) and v.owner == dst for v in state.values())
    # load a dense checkpoint into a differently initialised parallel model
    torch.manual_seed(99)
    other = tp.parallelize(TinyLM(CONFIG).double(), plan(CONFIG["head_dim"]))
    tp.load_full_state_dict(other, dense.state_dict() if rank == 0 else None, src=0)
    ids, _ = tokens(3)
    torch.testing.assert_close(other(ids), parallel(ids), rtol=0, atol=0)
    return True


@pytest.mark.parametrize("world_size", [1, 3])
def test_full_state_dict_round_trip(world_size):
    assert all(run_distributed(_state_dict_round_trip, world_size))


# -- DTensor equivalence (divisible sizes, where DTensor is exact) ------------------------------

def _against_dtensor():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).double()

    theirs = parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    ours = tp.parallelize(mlp(), {"0": "colwise", "2": "rowwise"}, group=mesh)
    x = torch.randn(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y_theirs, y_ours = theirs(x), ours(x)
    torch.testing.assert_close(y_ours, y_theirs, rtol=1e-12, atol=1e-12)
    y_theirs.pow(2).sum().backward()
    y_ours.pow(2).sum().backward()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        b_grad = b.grad.to_local() if isinstance(b.grad, DTensor) else b.grad
        torch.testing.assert_close(a.grad, b_grad, rtol=1e-12, atol=1e-12, msg=name)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_equivalent_to_dtensor_parallelize_module(world_size):
    assert all(run_distributed(_against_dtensor, world_size))


# -- 2-D: tensor parallel inside dp groups, BucketedAllReduce across them -----------------------

def _two_d():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    dense = build()
    model = tp.parallelize(build(), plan(CONFIG["head_dim"]), group=mesh["tp"])
    tp.BucketedAllReduce(model, group=mesh["dp"])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (dense, model)]
    for step in range(5):
        ids, target = tokens(step)  # the full batch of 3 sequences
        # single process: the full batch
        F.cross_entropy(dense(ids).flatten(0, 1), target.flatten()).backward()
        # dp rank r: its half (uneven: 2 and 1 sequences), mean over its tokens; the reducer
        # averages over the two dp ranks, so weight each half's loss by its share
        rows = torch.tensor_split(torch.arange(3), 2)[dp_rank]
        local = vocab_parallel_cross_entropy(model(ids[rows]).flatten(0, 1),
                                             target[rows].flatten(), group=mesh["tp"])
        (local * len(rows) * 2 / 3).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    state = tp.full_state_dict(model, dst=0, group=mesh["tp"])
    if mesh["tp"].get_local_rank() == 0:
        for key, value in dense.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-9, atol=1e-9, msg=key)
    return True


def test_two_dimensional_dp_by_tp_matches_single_process():
    assert all(run_distributed(_two_d, 4, timeout=120))


# -- a transformer from another library, built from its config ----------------------------------

def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=101, hidden_size=24, intermediate_size=50,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6,
                         head_dim=4, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


LLAMA_PLAN = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.[qkv]_proj": Colwise(multiple_of=4),  # whole heads of 4
    "model.layers.*.self_attn.o_proj": Rowwise(multiple_of=4),
    "model.layers.*.mlp.[gu][ap]*_proj": "colwise",                  # gate_proj, up_proj
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise",
}


def _hugging_face_llama():
    dense, parallel = _llama(), tp.parallelize(_llama(), LLAMA_PLAN)
    ids, target = tokens(5)
    dense_logits = dense(ids).logits
    dense_loss = F.cross_entropy(dense_logits.flatten(0, 1), target.flatten())
    dense_loss.backward()
    local_logits = parallel(ids).logits  # the library's own forward, untouched
    lm = parallel.lm_head
    torch.testing.assert_close(local_logits, dense_logits[..., lm.shard.start: lm.shard.stop],
                               rtol=1e-10, atol=1e-10)
    loss = vocab_parallel_cross_entropy(local_logits.flatten(0, 1), target.flatten())
    torch.testing.assert_close(loss, dense_loss, rtol=1e-12, atol=1e-12)
    loss.backward()
    _compare_grads(dense, parallel, 1e-10)
    return parallel.model.layers[0].self_attn.q_proj.shard.length // 4


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_hugging_face_llama_from_config_matches_dense(world_size):
    heads = run_distributed(_hugging_face_llama, world_size, timeout=120)
    assert sum(heads) == 6


def _load_missing_key():
    rank = dist.get_rank()
    parallel = tp.parallelize(build(), plan(CONFIG["head_dim"]))
    state = {k: v for k, v in build().state_dict().items() if k != "norm.weight"}
    try:
        tp.load_full_state_dict(parallel, state if rank == 0 else None, src=0)
    except KeyError as e:
        return str(e)
    return None


def test_load_full_state_dict_missing_key_raises_on_every_rank():
    messages = run_distributed(_load_missing_key, 3)
    assert "['norm.weight']" in messages[0]
    assert all(m is not None and "lacks" in m for m in messages)


def _load_misfit(case):
    rank = dist.get_rank()
    parallel = tp.parallelize(build(), plan(CONFIG["head_dim"]))
    state = build().state_dict()
    before = {k: v.clone() for k, v in parallel.state_dict().items()}
    if case == "a replica's shape":  # broadcast into the norm's 24 values, silently
        state["norm.weight"] = torch.full((1,), 3.0, dtype=state["norm.weight"].dtype)
    elif case == "a shard's shape":
        key = next(k for k in state if k.endswith("o_proj.weight"))
        state[key] = state[key][:, :-1]
    else:  # a key the model lacks (a checkpoint of a deeper model)
        state["layers.9.norm.weight"] = state["norm.weight"].clone()
    try:
        tp.load_full_state_dict(parallel, state if rank == 0 else None, src=0)
    except ValueError as e:
        unchanged = all(torch.equal(v, before[k]) for k, v in parallel.state_dict().items())
        return str(e), unchanged
    return None, False


@pytest.mark.parametrize("case", ["a replica's shape", "a shard's shape", "an unexpected key"])
def test_load_full_state_dict_refuses_a_checkpoint_that_does_not_fit(case):
    """As torch's load_state_dict: on every rank, the model untouched, the key named."""
    results = run_distributed(_load_misfit, 3, case)
    for message, unchanged in results:
        assert message is not None and "does not fit" in message, message
        assert unchanged
    named = {"a replica's shape": "'norm.weight'", "a shard's shape": "o_proj.weight",
             "an unexpected key": "'layers.9.norm.weight'"}[case]
    assert named in results[0][0], results[0][0]


class _WithExtraState(nn.Module):
    """A module keeping a plain value in its state dict (``get_extra_state``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 10)
        self.k = 7

    def get_extra_state(self):
        return {"k": self.k}

    def set_extra_state(self, state):
        self.k = state["k"]

    def forward(self, x):
        return self.lin(x)


def _extra_state_loaded():
    torch.manual_seed(0)
    dense = nn.Sequential(_WithExtraState(), nn.Linear(10, 6)).double()
    dense[0].k = 11
    model = tp.parallelize(copy.deepcopy(dense), {"0.lin": "colwise", "1": "rowwise"})
    model[0].k = 0
    tp.load_full_state_dict(model, dense.state_dict() if dist.get_rank() == 0 else None)
    full = tp.full_state_dict(model)
    same = dist.get_rank() != 0 or all(
        torch.equal(v, full[k]) if isinstance(v, torch.Tensor) else v == full[k]
        for k, v in dense.state_dict().items())
    return model[0].k, same


def test_load_full_state_dict_loads_a_module_s_extra_state():
    for k, same in run_distributed(_extra_state_loaded, 2):
        assert k == 11 and same


class _CrossAttention(nn.Module):
    """q from x; k and v from x too, or from a second input (cross-attention)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, 8) for _ in range(3))
        self.o_proj = nn.Linear(8, 8)

    def forward(self, x, memory=None):
        h = torch.tanh(x)  # an activation: nothing but the graph keeps it
        kv = h if memory is None else memory
        q, k, v = self.q_proj(h), self.k_proj(kv), self.v_proj(kv)
        return self.o_proj(torch.tanh(q) * torch.sigmoid(k) + v)


def _shared_input_all_reduces(cross):
    dense = _CrossAttention()
    parallel = tp.parallelize(_CrossAttention(), {"q_proj": "colwise", "k_proj": "colwise",
                                                  "v_proj": "colwise", "o_proj": "rowwise"})
    counts = []
    for step in range(2):  # the same input tensor again: a fresh graph, still exact
        g = torch.Generator().manual_seed(step)
        x = torch.randn(5, 8, generator=g, requires_grad=True)
        memory = torch.randn(5, 8, generator=g, requires_grad=True) if cross else None
        xd = x.detach().clone().requires_grad_()
        md = None if memory is None else memory.detach().clone().requires_grad_()
        dense.zero_grad()
        dense(xd, md).square().sum().backward()
        parallel.zero_grad()
        out = parallel(x, memory)
        with tp.CommCounter() as backward:
            out.square().sum().backward()
        counts.append(backward.count("all_reduce"))
        assert parallel.q_proj.input_share._copy is None  # nothing outlives the forward
        torch.testing.assert_close(out, dense(xd, md), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x.grad, xd.grad, rtol=1e-6, atol=1e-6)
        if memory is not None:
            torch.testing.assert_close(memory.grad, md.grad, rtol=1e-6, atol=1e-6)
        _compare_grads(dense, parallel, 1e-6)
    return counts


@pytest.mark.parametrize("cross, all_reduces", [(False, 1), (True, 2)])
def test_siblings_reading_one_input_all_reduce_its_gradient_once(cross, all_reduces):
    # q/k/v read x: one backward all-reduce for the three (was three); with k/v reading a
    # second input, one for x and one for it
    assert run_distributed(_shared_input_all_reduces, 2, cross) == \
        [[all_reduces, all_reduces]] * 2


def test_heads_that_do_not_pair_up_are_described_by_projection():
    from types import SimpleNamespace

    from tensorpar.nn.plans.plan import check_heads

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.o_proj = nn.Linear(16, 16), nn.Linear(16, 16)
            self.k_proj, self.v_proj = nn.Linear(16, 8), nn.Linear(16, 8)

    model = nn.Module()
    model.attn = Attn()
    model.config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                                   hidden_size=16)
    kv = {"attn.k_proj": Colwise(), "attn.v_proj": Colwise()}
    [problem] = check_heads(model, kv, 2)  # q_proj left whole
    assert "None" not in problem, problem
    assert ("q_proj replicated (every query head on every rank), key/value heads [1, 1] "
            "(k_proj and v_proj)") in problem, problem
    [problem] = check_heads(model, {**kv, "attn.v_proj": Colwise(multiple_of=8)}, 2)
    assert "key heads [1, 1] (k_proj), value heads [2, 0] (v_proj)" in problem, problem
    [problem] = check_heads(model, {**kv, "attn.q_proj": Colwise()}, 3)  # 16 rows: 6, 5, 5
    assert "q_proj split into rows [6, 5, 5], not whole heads of 4" in problem, problem


# -- frozen parameters stay frozen ------------------------------------------------------------

FROZEN = ("embed.weight", "layers.0.attn.q_proj.weight", "layers.0.up.weight",
          "layers.0.up.bias", "layers.1.down.weight", "layers.1.down.bias", "lm_head.weight")


def _frozen_training():
    """A frozen embedding, projections and head (a frozen backbone, LoRA-style)."""
    models = build(), build()
    for model in models:
        for name, p in model.named_parameters():
            p.requires_grad_(name not in FROZEN)
    dense, parallel = models[0], tp.parallelize(models[1], plan(CONFIG["head_dim"]))
    flags = {n: p.requires_grad for n, p in parallel.named_parameters()}
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for m in (dense, parallel)]
    for step in range(2):
        ids, target = tokens(step)
        losses = (F.cross_entropy(dense(ids).flatten(0, 1), target.flatten()),
                  vocab_parallel_cross_entropy(parallel(ids).flatten(0, 1), target.flatten()))
        for loss, opt in zip(losses, opts, strict=True):
            loss.backward()
            opt.step()
            opt.zero_grad()
    state, expected = tp.full_state_dict(parallel, dst=0), dense.state_dict()
    gap = max((state[k] - expected[k]).abs().max().item() for k in expected) \
        if dist.get_rank() == 0 else 0.0
    return flags, gap


def test_frozen_parameters_stay_frozen_and_train_like_dense():
    """parallelize() gave every layer it converted trainable parameters (a frozen head moved)."""
    for flags, gap in run_distributed(_frozen_training, 2, timeout=60):
        assert {n for n, trainable in flags.items() if not trainable} == set(FROZEN)
        assert gap < 1e-12, gap


def _frozen_layers():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    built = []
    for cls, dense in ((tp.nn.ColumnParallelLinear, nn.Linear(6, 5)),
                       (tp.nn.RowParallelLinear, nn.Linear(6, 5)),
                       (tp.nn.VocabParallelEmbedding, nn.Embedding(7, 4)),
                       (tp.nn.ParallelEmbedding, nn.Embedding(7, 4)),
                       (tp.nn.ColumnParallelConv1D, Conv1D(5, 6)),
                       (tp.nn.RowParallelConv1D, Conv1D(5, 6))):
        dense.weight.requires_grad_(False)
        layer = cls.from_dense(dense)
        built.append((cls.__name__, {n: p.requires_grad for n, p in layer.named_parameters()}))
    return built


def test_each_layer_from_dense_keeps_requires_grad():
    for built in run_distributed(_frozen_layers, 2):
        for name, flags in built:
            assert flags.pop("weight") is False, name
            assert all(flags.values()), (name, flags)  # the biases were left trainable


def _rng_untouched():
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.pytorch_utils import Conv1D

    from tensorpar.nn import ColumnParallelConv1D, ParallelEmbedding, plan_from_transformers
    config = MixtralConfig(vocab_size=101, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                           head_dim=4, num_local_experts=5, num_experts_per_tok=2)
    for name, build_model, plan_of in [
            ("hand plan", lambda: TinyLM(CONFIG), lambda m: plan(CONFIG["head_dim"])),
            ("transformers plan", lambda: MixtralForCausalLM(config),
             lambda m: plan_from_transformers(m, lm_head="gathered")),
            ("experts split unevenly", lambda: MixtralForCausalLM(config),
             lambda m: plan_from_transformers(m, lm_head="gathered",
                                              experts="expert_parallel"))]:
        torch.manual_seed(0)
        model = build_model()
        chosen = plan_of(model)
        before = torch.get_rng_state()
        tp.parallelize(model, chosen)
        # a batch drawn after the conversion is the one dense draws: every rank's alike
        assert torch.equal(torch.get_rng_state(), before), name
    conv, embedding = Conv1D(7, 3), nn.Embedding(11, 3)
    before = torch.get_rng_state()
    ColumnParallelConv1D.from_dense(conv)
    ParallelEmbedding.from_dense(embedding)
    assert torch.equal(torch.get_rng_state(), before), "from_dense"
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_parallelize_leaves_the_global_rng_as_it_was(world_size):
    assert all(run_distributed(_rng_untouched, world_size, timeout=100))
