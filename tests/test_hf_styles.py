"""The styles of transformers' own plans: models planned by plan_from_transformers train like dense.

Every test runs 3 AdamW steps (float64, gradients clipped by `tensorpar.nn.clip_grad_norm_`)
and compares logits, loss, every gradient and the parameters afterwards with the dense model
(1e-10); replicated parameters (norms, biases of row-parallel layers, per-head norms whose
gradients are partial) must be bit-identical across ranks.
"""

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import tensorpar as tp
from tensorpar.nn import (
    Colwise,
    MlaKvAProj,
    PartialGrad,
    Rowwise,
    plan_from_transformers,
    vocab_parallel_cross_entropy,
)
from tensorpar.nn.state.partial_grad import install_partial_grad, partial_grad_parameters
from tensorpar.testing import run_distributed
from tests.test_clip import dense_slice as local

pytest.importorskip("transformers")

BASE = {"vocab_size": 101, "intermediate_size": 50, "num_hidden_layers": 2,
        "max_position_embeddings": 64}
# 10 query heads over 5 key/value heads: uneven at TP 2 (3, 2), 3 (2, 2, 1) and 4 (2, 1, 1, 1)
HEADS = {"num_attention_heads": 10, "num_key_value_heads": 5, "head_dim": 4}
MODELS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**HEADS, "hidden_size": 24}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**HEADS, "hidden_size": 40}),
    # q/k/v gathered (colwise_gather_output: the q/k norms span all heads), o_proj splits
    # its input (rowwise_split_input)
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {**HEADS, "hidden_size": 40}),
    # multi-head latent attention: 5 heads (uneven at TP 2, 3, 4), a low-rank query, a
    # dense first layer and a mixture-of-experts second one (experts left replicated)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"hidden_size": 24, "num_attention_heads": 5, "num_key_value_heads": 5,
                     "q_lora_rank": 12, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
                     "qk_nope_head_dim": 6, "v_head_dim": 5, "head_dim": 4,
                     "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                     "topk_group": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 10,
                     "n_shared_experts": 1, "experts_implementation": "eager"}),
}
# latent attention (5 heads) beside other modules: Kimi-Linear's first layer is a linear
# attention with an o_proj of its own (left whole); Dots3's attention gates each head (g_proj)
# and normalises the shared rotary key (k_rope_only_layernorm: a partial gradient);
# Bailing-Hybrid's gates each head too, but its tp_plan does not say so
LATENT = {"hidden_size": 24, "num_attention_heads": 5, "num_key_value_heads": 5,
          "q_lora_rank": 12, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 6,
          "v_head_dim": 5, "head_dim": 4, "num_experts_per_tok": 2, "n_group": 1,
          "topk_group": 1, "moe_intermediate_size": 10, "experts_implementation": "eager",
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
MODELS.update({
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    {**LATENT, "num_local_experts": 4, "linear_head_dim": 4,
                     "linear_num_heads": 5, "layer_types": ["linear_attention",
                                                            "full_attention"]}),
    "dots3_note": ("Dots3NoteTextConfig", "Dots3NoteForCausalLM",
                   {**LATENT, "n_routed_experts": 4, "shared_experts_intermediate_size": 10,
                    "index_head_dim": 4, "index_n_heads": 2, "index_topk": 4}),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM",
                       {**LATENT, "num_experts": 4, "layer_group_size": 2}),
    # a v_norm without a scale (no parameters), which transformers' plan still names, and
    # activation sparsity in the first layer's MLP (statistics over all its features)
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM",
                {**HEADS, "hidden_size": 40, "vocab_size_per_layer_input": 101,
                 "hidden_size_per_layer_input": 4, "laurel_rank": 4,
                 "num_kv_shared_layers": 0, "activation_sparsity_pattern": [0.95, 0.0],
                 "layer_types": ["sliding_attention", "full_attention"]}),
    # layers beside q_proj that work per head: Laguna's gate of one value per head (g_proj),
    # Phi's output projection (dense)
    "laguna": ("LagunaConfig", "LagunaForCausalLM",
               {**HEADS, "hidden_size": 40, "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 10, "shared_expert_intermediate_size": 10,
                "experts_implementation": "eager"}),
    "phi": ("PhiConfig", "PhiForCausalLM", {**HEADS, "hidden_size": 40}),
    # q_proj gives each head's query and its gate side by side (2 * head_dim per head)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   {**HEADS, "hidden_size": 40, "num_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 10, "shared_expert_intermediate_size": 10,
                    "linear_key_head_dim": 4, "linear_value_head_dim": 4,
                    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "layer_types": ["linear_attention", "full_attention"]}),
})
PER_HEAD_NORMS = ["deepseek_v3", "gemma3", "olmo2", "qwen3"]


def build(arch, **overrides):
    return build_from(MODELS[arch], BASE, overrides, "eager")


def build_from(entry, base, overrides, attention):
    """A float64 model from a ``(config class, model class, options)`` entry, seed 0, with
    its norms moved away from their init."""
    import transformers

    config_cls, model_cls, extra = entry
    config = getattr(transformers, config_cls)(**{**base, **extra, **overrides})
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).double()
    with torch.no_grad():  # norms away from their init (ones / zeros), so their grads matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def tokens(seed, n=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, BASE["vocab_size"], (2, n), generator=g)


@contextlib.contextmanager
def norms_in_model_dtype(arch):
    """Gemma3's RMSNorm computes in float32 whatever the model's dtype: a per-head norm's
    weight gradient is then a float32 sum, whose order differs between the dense model (all
    heads) and a rank (its heads). Run it in the model's dtype so float64 means float64."""
    if arch != "gemma3":
        yield
        return
    from transformers.models.gemma3 import modeling_gemma3

    cls = modeling_gemma3.Gemma3RMSNorm
    original = cls.forward
    cls.forward = lambda self, x: self._norm(x) * (1.0 + self.weight)
    try:
        yield
    finally:
        cls.forward = original


def train_like_dense(arch, overrides=None, steps=3, tol=1e-10, param_tol=None):
    """Dense and parallel models side by side; returns the replicated parameters at the end."""
    with norms_in_model_dtype(arch):
        return _train_like_dense(arch, overrides, steps, tol, param_tol)


def _train_like_dense(arch, overrides, steps, tol, param_tol):
    overrides = overrides or {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # experts left replicated
        dense = build(arch, **overrides)
        parallel = tp.parallelize(build(arch, **overrides),
                                  plan_from_transformers(build(arch, **overrides)))
    return train_clipped(dense, parallel, [tokens(step) for step in range(steps)], tol,
                         param_tol)


def train_clipped(dense, parallel, batches, tol=1e-10, param_tol=None):
    """One AdamW step per batch on both models, clipped by the dense model's norm (small
    enough that every step clips): every step compared (`compare_step`, and the norms), then
    the parameters. Returns the parallel model's replicated parameters."""
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(parallel.parameters(), lr=1e-2)
    for step, ids in enumerate(batches):
        compare_step(dense, parallel, ids, f"step {step}", tol)
        expected = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.05)
        got = tp.nn.clip_grad_norm_(parallel, 0.05)
        assert float(expected) > 0.05  # clipping is active
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        dense_opt.step(), opt.step(), dense_opt.zero_grad(), opt.zero_grad()
    dense_params = dict(dense.named_parameters())
    for name, p in parallel.named_parameters():
        torch.testing.assert_close(p, local(parallel, name, dense_params[name]),
                                   rtol=param_tol or tol, atol=param_tol or tol,
                                   msg=f"{name} after {len(batches)} steps")
    return {name: p.detach().clone() for name, p in parallel.named_parameters()
            if not is_sharded(parallel, name)}


def compare_step(dense, parallel, ids, where, tol=1e-10):
    """One forward and backward of both models: logits (the parallel head's vocabulary
    slice), loss and every gradient equal. Returns the parallel model's loss."""
    head = parallel.get_output_embeddings()
    target = ids.roll(-1, 1)
    dense_logits = dense(ids).logits
    dense_loss = F.cross_entropy(dense_logits.flatten(0, 1), target.flatten())
    logits = parallel(ids).logits
    torch.testing.assert_close(logits, dense_logits[..., head.shard.start: head.shard.stop],
                               rtol=tol, atol=tol, msg=f"logits, {where}")
    loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), target.flatten(),
                                        sizes=head.shard.sizes)
    torch.testing.assert_close(loss, dense_loss, rtol=tol, atol=tol)
    dense_loss.backward()
    loss.backward()
    dense_params = dict(dense.named_parameters())
    for name, p in parallel.named_parameters():
        torch.testing.assert_close(p.grad, local(parallel, name, dense_params[name].grad),
                                   rtol=tol, atol=tol, msg=f"grad of {name}, {where}")
    return loss


def is_sharded(model, name):
    owner, _, leaf = name.rpartition(".")
    return leaf in getattr(model.get_submodule(owner), "sharded_dims", {})


def assert_replicas_identical(results):
    first = results[0]
    assert first, "no replicated parameters were compared"
    for other in results[1:]:
        assert first.keys() == other.keys()
        for name, value in first.items():
            assert torch.equal(value, other[name]), f"{name} differs across ranks"


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow),
                                        pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("arch", PER_HEAD_NORMS)
def test_per_head_norms_train_like_dense(arch, world_size):
    assert_replicas_identical(run_distributed(train_like_dense, world_size, arch, timeout=180))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_deepseek_v3_without_query_lora_trains_like_dense(world_size):
    results = run_distributed(train_like_dense, world_size, "deepseek_v3", {"q_lora_rank": None},
                              timeout=180)
    assert_replicas_identical(results)


def test_mla_plan_splits_the_up_projections_by_head():
    plan = plan_from_transformers(build("deepseek_v3"))
    attn = "model.layers.*.self_attn."
    assert plan[attn + "q_b_proj"] == Colwise(multiple_of=10)
    assert plan[attn + "kv_b_proj"] == Colwise(multiple_of=11)
    assert plan[attn + "kv_a_proj_with_mqa"] == MlaKvAProj(rope_dim=4)
    assert plan[attn + "o_proj"] == Rowwise(multiple_of=5)
    assert attn + "q_a_proj" not in plan and attn + "kv_a_layernorm" not in plan
    olmo = plan_from_transformers(build("olmo2"))
    assert olmo[attn + "q_proj"] == Colwise(gather_output=True)
    assert olmo[attn + "o_proj"] == Rowwise(input_is_parallel=False)


# Dots3 computes its norms and router in float32 whatever the model's dtype: float32-close
# (a rotary-key norm left with its partial gradient differs by far more). Measured at TP 2:
# every step's gradients within 7e-10 of dense, which AdamW's normalisation turns into 1.4e-6
# on the tied embedding after 3 steps: the parameters are held to the sweep's 1e-5.
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("arch, tol, param_tol", [("kimi_linear", 1e-10, 1e-10),
                                                  ("dots3_note", 1e-6, 1e-5)])
def test_latent_attention_beside_other_modules_trains_like_dense(arch, tol, param_tol,
                                                                 world_size):
    results = run_distributed(train_like_dense, world_size, arch, None, 3, tol, param_tol,
                              timeout=300)
    assert_replicas_identical(results)


def test_latent_attention_plan_names_only_the_latent_layers_and_keeps_their_gates():
    kimi = plan_from_transformers(build("kimi_linear"))  # layer 0 is a linear attention
    assert kimi["model.layers.1.self_attn.o_proj"] == Rowwise(multiple_of=5)
    assert not [k for k in kimi if k.startswith(("model.layers.*.self_attn",
                                                 "model.layers.0.self_attn"))]
    dots = plan_from_transformers(build("dots3_note"))
    attn = "model.layers.*.self_attn."
    assert dots[attn + "q_b_proj"] == Colwise(multiple_of=10)
    assert dots[attn + "g_proj"] == Colwise()  # one gate per head
    assert dots[attn + "k_rope_only_layernorm"] == PartialGrad()


def test_latent_attention_with_a_module_the_plan_does_not_place_is_refused():
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn' holds \['g_proj'\] "
                                         r"beside its latent attention"):
        plan_from_transformers(build("bailing_hybrid"))


def test_a_query_fused_with_a_gate_is_refused():
    with pytest.raises(ValueError, match=r"qwen3_next's q_proj has \[80\] output features, "
                                         r"not 10 heads of 4 \(a query fused with a gate"):
        plan_from_transformers(build("qwen3_next"))


def test_a_norm_without_parameters_and_an_mlp_with_activation_sparsity_are_left_whole():
    plan = plan_from_transformers(build("gemma3n"))
    assert plan["model.layers.*.self_attn.k_norm"] == PartialGrad()
    assert "model.layers.*.self_attn.v_norm" not in plan  # nothing to sum
    assert plan["model.layers.1.mlp.gate_proj"] == Colwise()
    assert not [k for k in plan if k.startswith(("model.layers.0.mlp", "model.layers.*.mlp"))]


def test_layers_working_per_head_beside_q_proj_split_in_query_head_groups():
    laguna = plan_from_transformers(build("laguna"))  # 2 query heads per key/value head
    assert laguna["model.layers.*.self_attn.g_proj"] == Colwise(multiple_of=2)
    assert laguna["model.layers.*.self_attn.o_proj"] == Rowwise(multiple_of=8)
    phi = plan_from_transformers(build("phi"))
    assert phi["model.layers.*.self_attn.dense"] == Rowwise(multiple_of=8)


# Gemma3n and Laguna compute their norms (and Gemma3n its AltUp router, Laguna its gate) in
# float32 whatever the model's dtype: float32-close. A wrong split differs by far more
# (Gemma3n's activation sparsity on a rank's slice: 0.2) or fails.
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("arch, tol", [("phi", 1e-10), ("laguna", 1e-6), ("gemma3n", 1e-6)])
def test_per_head_layers_and_whole_mlps_train_like_dense(arch, tol, world_size):
    results = run_distributed(train_like_dense, world_size, arch, None, 3, tol, timeout=300)
    assert_replicas_identical(results)


def test_plan_maps_replicated_with_grad_allreduce_to_partial_grad():
    for arch in ("qwen3", "gemma3"):
        plan = plan_from_transformers(build(arch))
        assert plan["model.layers.*.self_attn.q_norm"] == PartialGrad()
        assert plan["model.layers.*.self_attn.k_norm"] == PartialGrad()


def _accumulate_and_reuse(micro_batches):
    """A norm used twice per forward, over several backward passes before one step."""
    group = torch.distributed.group.WORLD
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(6, dtype=torch.float64)
    dense = torch.nn.LayerNorm(6, dtype=torch.float64)
    dense.load_state_dict(norm.state_dict())
    install_partial_grad(norm, group)
    install_partial_grad(norm, group)  # twice: still summed once
    counter = tp.CommCounter()
    with counter:
        for m in range(micro_batches):
            x = torch.randn(size * 2 + 1, 6, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(m))
            rows = torch.tensor_split(x, size)[rank]  # this rank's rows (uneven)
            (norm(norm(rows)) ** 2).sum().backward()
            (dense(dense(x)) ** 2).sum().backward()
    for p, q in zip(norm.parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    return counter.count("all_reduce"), [n for n, _ in partial_grad_parameters(norm)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_partial_grad_sums_once_per_backward_with_accumulation(world_size):
    results = run_distributed(_accumulate_and_reuse, world_size, 3)
    # weight and bias, one all-reduce each per backward, 3 backward passes
    assert results == [(6, ["weight", "bias"])] * world_size
