"""transformers architectures parallelised with plan_from_transformers equal the dense model."""

import warnings

import pytest
import torch

import tensorpar as tp
from tensorpar.nn import Colwise, Rowwise, plan_from_transformers, vocab_parallel_cross_entropy
from tensorpar.testing import run_distributed
from tests.test_clip import dense_slice as shard
from tests.test_hf_styles import compare_step

pytest.importorskip("transformers")

SMALL = {"vocab_size": 101, "hidden_size": 24, "intermediate_size": 50, "num_hidden_layers": 2,
         "max_position_embeddings": 64}
# (config class, model class, heads/kv heads/head_dim and extras); vocab 101 and MLP 50 are
# uneven at every TP size, and so are the key/value heads where the counts allow
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {"num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 4}),
    "llama-gqa-tied": ("LlamaConfig", "LlamaForCausalLM",
                       {"num_attention_heads": 12, "num_key_value_heads": 6, "head_dim": 2,
                        "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 6}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4,
                 "num_local_experts": 3, "num_experts_per_tok": 2,
                 "experts_implementation": "eager"}),
    # fused [q; k; v] sliced with global sizes (gathered) and a packed [gate; up] (50 + 50)
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             {"num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0,
              "bos_token_id": 1, "eos_token_id": 1}),
    # Conv1D everywhere, c_attn gathered, MLP 50 wide, wte tied to lm_head
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             {"num_attention_heads": 4, "n_inner": 50, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
              "attn_pdrop": 0.0, "bos_token_id": 1, "eos_token_id": 1}),
    # query_key_value interleaved per head: 4 heads of (q, k, v) x 6, whole heads per rank
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 {"num_attention_heads": 4, "hidden_dropout": 0.0, "attention_dropout": 0.0}),
}
ENCODERS = {
    "bert": ("BertConfig", "BertModel",
             {"num_attention_heads": 4, "hidden_dropout_prob": 0.0,
              "attention_probs_dropout_prob": 0.0, "pad_token_id": 0}),
}


def build(arch, dtype=torch.float64, **overrides):
    import transformers

    config_cls, model_cls, extra = {**ARCHS, **ENCODERS}[arch]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra, **overrides})
    config._attn_implementation = "eager" if arch.startswith("gemma") else "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).to(dtype)


def tokens(seed, n=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (2, n), generator=g)


def _train_and_compare(arch, tol=1e-10):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # mixtral: experts left replicated
        dense = build(arch)
        parallel = tp.parallelize(build(arch), plan_from_transformers(build(arch)))
    dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    opt = torch.optim.SGD(parallel.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        loss = compare_step(dense, parallel, tokens(step), f"step {step}", tol)
        dense_opt.step(), opt.step(), dense_opt.zero_grad(), opt.zero_grad()
        losses.append(loss.item())
    dense_params = dict(dense.named_parameters())
    for name, p in parallel.named_parameters():
        torch.testing.assert_close(p, shard(parallel, name, dense_params[name]), rtol=tol,
                                   atol=tol, msg=f"{name} after 3 steps")
    tied = parallel.get_output_embeddings().weight is parallel.get_input_embeddings().weight
    dense_tied = dense.get_output_embeddings().weight is dense.get_input_embeddings().weight
    return losses, (tied, dense_tied)


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow),
                                        pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_architecture_trains_like_dense(arch, world_size):
    heads = ARCHS[arch][2]
    results = run_distributed(_train_and_compare, world_size, arch, timeout=120)
    assert len({tuple(losses) for losses, _ in results}) == 1  # the same loss on every rank
    expected = bool(heads.get("tie_word_embeddings")) or arch.startswith(("gemma", "gpt2"))
    assert {tied for _, tied in results} == {(expected, expected)}


def _encoder_trains_like_dense(arch, tol=1e-10):
    dense = build(arch)
    parallel = tp.parallelize(build(arch), plan_from_transformers(build(arch)))
    dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    opt = torch.optim.SGD(parallel.parameters(), lr=0.1)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # padding: the attention mask path too
    losses = []
    for step in range(3):
        ids = tokens(step)
        outputs = [m(ids, attention_mask=mask) for m in (dense, parallel)]
        torch.testing.assert_close(outputs[1].last_hidden_state, outputs[0].last_hidden_state,
                                   rtol=tol, atol=tol)
        dense_loss, loss = (o.last_hidden_state.pow(2).mean() + o.pooler_output.sum()
                            for o in outputs)
        torch.testing.assert_close(loss, dense_loss, rtol=tol, atol=tol)
        dense_loss.backward()
        loss.backward()
        dense_grads = dict(dense.named_parameters())
        for name, p in parallel.named_parameters():
            torch.testing.assert_close(p.grad, shard(parallel, name, dense_grads[name].grad),
                                       rtol=tol, atol=tol, msg=name)
        dense_opt.step(), opt.step(), dense_opt.zero_grad(), opt.zero_grad()
        losses.append(loss.item())
    dense_params = dict(dense.named_parameters())
    for name, p in parallel.named_parameters():
        torch.testing.assert_close(p, shard(parallel, name, dense_params[name]), rtol=tol,
                                   atol=tol, msg=f"{name} after 3 steps")
    query = parallel.encoder.layer[0].attention.self.query
    return losses, type(query).__name__, query.shard.length


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_bert_encoder_trains_like_dense(world_size):
    results = run_distributed(_encoder_trains_like_dense, world_size, "bert", timeout=120)
    assert len({tuple(losses) for losses, _, _ in results}) == 1
    # 4 heads of 6: whole heads per rank (uneven at 3 ranks: 2, 1, 1)
    assert [width for _, _, width in results] == [24 // world_size] * world_size \
        if world_size != 3 else [12, 6, 6]
    assert {kind for _, kind, _ in results} == {"ColumnParallelLinear"}


def _refusal(arch, overrides):
    try:
        tp.parallelize(build(arch, **overrides), plan_from_transformers(build(arch, **overrides)))
    except ValueError as e:
        return str(e)
    return None


def test_fewer_kv_heads_than_ranks_is_refused_on_every_rank():
    messages = run_distributed(_refusal, 3, "llama-gqa-tied", {"num_key_value_heads": 2})
    assert len(set(messages)) == 1 and messages[0] is not None
    assert "k_proj" in messages[0] and "some ranks would hold nothing" in messages[0]


def _wrong_gqa_plan():
    model = build("llama-gqa-tied", num_attention_heads=12, num_key_value_heads=3)
    before = {n: p.clone() for n, p in model.named_parameters()}
    plan = {"model.embed_tokens": "vocab", "lm_head": "colwise",
            "model.layers.*.self_attn.[qkv]_proj": Colwise(multiple_of=2),
            "model.layers.*.self_attn.o_proj": Rowwise(multiple_of=2)}
    try:
        tp.parallelize(model, plan)
    except ValueError as e:
        unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        return str(e), unchanged, type(model.model.layers[0].self_attn.q_proj).__name__
    return None


def test_independent_qkv_split_on_gqa_is_refused_before_any_change():
    results = run_distributed(_wrong_gqa_plan, 2)
    assert len({r[0] for r in results}) == 1
    message, unchanged, q_type = results[0]
    assert "do not pair up" in message and "query heads [6, 6]" in message
    assert "key/value heads [2, 1]" in message and "multiple_of=8" in message
    assert unchanged and q_type == "Linear"


def _half_tied_plan():
    plan = plan_from_transformers(build("llama-gqa-tied"))
    del plan["lm_head"]
    try:
        tp.parallelize(build("llama-gqa-tied"), plan)
    except ValueError as e:
        return str(e)
    return None


def test_a_tie_split_one_way_only_is_refused_naming_both_modules():
    messages = run_distributed(_half_tied_plan, 2)
    assert len(set(messages)) == 1
    assert "'model.embed_tokens.weight' and 'lm_head.weight'" in messages[0]
    assert "replicated" in messages[0]


def _generate_and_labels():
    dense = build("llama-gqa-tied")
    parallel = tp.parallelize(build("llama-gqa-tied"),
                              plan_from_transformers(dense, lm_head="gathered"))
    ids = tokens(7, n=5)
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    expected = dense.generate(ids, **kwargs)
    got = parallel.generate(ids, **kwargs)
    dense_loss = dense(ids, labels=ids).loss
    loss = parallel(ids, labels=ids).loss
    torch.testing.assert_close(loss, dense_loss, rtol=1e-10, atol=1e-10)
    return torch.equal(got, expected), got[0].tolist()


@pytest.mark.parametrize("world_size", [2, 3])
def test_generate_with_the_gathered_head_returns_the_dense_tokens(world_size):
    results = run_distributed(_generate_and_labels, world_size, timeout=120)
    assert all(same for same, _ in results)
    assert len({tuple(t) for _, t in results}) == 1


@pytest.mark.parametrize("name, config, match", [
    ("GPT2Config", {"n_head": 4, "n_embd": 16, "add_cross_attention": True},
     "add_cross_attention=True is not supported"),
    ("OPTConfig", {"num_attention_heads": 4, "ffn_dim": 32, "word_embed_proj_dim": 16},
     "no tensor-parallel plan"),
])
def test_architectures_without_support_are_refused_clearly(name, config, match):
    import transformers

    cfg = getattr(transformers, name)(**{"hidden_size": 16, "intermediate_size": 32,
                                         "num_hidden_layers": 1, "vocab_size": 50,
                                         "pad_token_id": 0,
                                         "bos_token_id": 1, "eos_token_id": 1, **config})
    model = transformers.AutoModel.from_config(cfg)
    with pytest.raises(ValueError, match=match):
        plan_from_transformers(model)


def test_plans_for_fused_projections():
    phi3 = plan_from_transformers(build("phi3"))
    assert phi3["model.layers.*.mlp.gate_up_proj"] == tp.nn.PackedColwise(blocks=2)
    assert phi3["model.layers.*.self_attn.qkv_proj"] == Colwise(gather_output=True)
    assert phi3["model.layers.*.self_attn.o_proj"] == Rowwise(input_is_parallel=False)
    neox = plan_from_transformers(build("gpt_neox"))
    assert neox["gpt_neox.layers.*.attention.query_key_value"] == Colwise(multiple_of=18)
    assert neox["gpt_neox.layers.*.attention.dense"] == Rowwise(multiple_of=6)
    gpt2 = plan_from_transformers(build("gpt2"))
    assert gpt2["transformer.h.*.attn.c_attn"] == Colwise(gather_output=True)
    assert gpt2["transformer.wte"] == tp.nn.Vocab() and gpt2["lm_head"] == Colwise()


def _bert_mlm_head():
    import transformers

    _, _, extra = ENCODERS["bert"]
    config = transformers.BertConfig(**{**SMALL, **extra})

    def model():
        torch.manual_seed(0)
        return transformers.BertForMaskedLM(config).double()

    dense, parallel = model(), model()
    plan = plan_from_transformers(parallel)
    tp.parallelize(parallel, plan)
    ids = tokens(1)
    torch.testing.assert_close(parallel(ids).logits, dense(ids).logits, rtol=1e-10, atol=1e-10)
    return sorted(plan)


def test_bert_masked_lm_head_with_a_tied_bias_stays_replicated():
    plans = run_distributed(_bert_mlm_head, 2)
    assert not any("word_embeddings" in p or "decoder" in p for p in plans[0])


def test_patterns_match_one_segment_per_star():
    match = tp.nn.match_module
    assert match("layers.*.q_proj", "layers.10.q_proj")
    assert not match("layers.*", "layers.0.q_proj")          # fnmatch's '*' would cross dots
    assert match("**.q_proj", "q_proj") and match("**.q_proj", "a.b.c.q_proj")
    assert match("layers.*.mlp.[gu][ap]*_proj", "layers.3.mlp.gate_proj")
    assert not match("layers.*.mlp.[gu][ap]*_proj", "layers.3.mlp.down_proj")


def _qwen2_with_large_biases(dtype, **plan):
    """A float64 Qwen2 with large biases (as in its checkpoints), and a dense and a
    tensor-parallel copy of it in ``dtype`` (``plan``: `plan_from_transformers` options)."""
    reference = build("qwen2")
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 8.0)
    dense, parallel = build("qwen2", dtype=dtype), build("qwen2", dtype=dtype)
    dense.load_state_dict(reference.state_dict())
    parallel.load_state_dict(reference.state_dict())
    tp.parallelize(parallel, plan_from_transformers(parallel, lm_head="gathered", **plan))
    return reference, dense, parallel


def _bf16_errors(reduce_dtype):
    reference, dense16, parallel = _qwen2_with_large_biases(torch.bfloat16,
                                                            reduce_dtype=reduce_dtype)
    ids = tokens(3)
    with torch.no_grad():
        exact = reference(ids).logits
        dense_err = (dense16(ids).logits.double() - exact).abs().mean().item()
        tp_err = (parallel(ids).logits.double() - exact).abs().mean().item()
    return dense_err, tp_err


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_with_float32_reduction_is_as_accurate_as_dense_bf16(world_size):
    dense_err, tp_err = run_distributed(_bf16_errors, world_size, torch.float32)[0]
    assert tp_err <= dense_err * 1.05, (tp_err, dense_err)


def _autocast_errors(reduce_dtype, sequence_parallel):
    """Float32 parameters under bfloat16 autocast: the logits' and gradients' mean error."""
    reference, dense, parallel = _qwen2_with_large_biases(
        torch.float32, reduce_dtype=reduce_dtype, sequence_parallel=sequence_parallel)
    ids = tokens(3, n=12)
    exact = reference(ids).logits
    exact.square().mean().backward()
    errors = []
    for model in (dense, parallel):
        dtypes = []
        model.get_submodule("model.layers.0.mlp.down_proj").register_forward_hook(
            lambda module, args, out, dtypes=dtypes: dtypes.append(out.dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids).logits
        assert dtypes == [torch.bfloat16], dtypes  # as the dense layer's under autocast
        logits.float().square().mean().backward()
        assert logits.dtype == torch.bfloat16
        grad = model.get_submodule("model.layers.0.mlp.down_proj").weight.grad
        want = reference.get_submodule("model.layers.0.mlp.down_proj").weight.grad
        if grad.shape != want.shape:  # this rank's columns
            pieces = model.get_submodule("model.layers.0.mlp.down_proj").shard.pieces
            want = torch.cat([want.narrow(1, start, n) for start, _, n in pieces], 1)
        errors.append(((logits.double() - exact).abs().mean().item(),
                       (grad.double() - want).abs().mean().item()))
    return errors


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
def test_float32_reduction_under_bf16_autocast_is_as_accurate_as_dense(reduce_dtype,
                                                                      sequence_parallel):
    """``reduce_dtype=torch.float32`` was ignored under autocast (float32 parameters: the
    weight's dtype equalled it), and its float32 product was cast back to bfloat16 there;
    a sequence-parallel row layer's output was float32 there (dense: bfloat16)."""
    (dense_err, dense_grad), (tp_err, tp_grad) = run_distributed(
        _autocast_errors, 2, reduce_dtype, sequence_parallel)[0]
    if reduce_dtype is not None:
        assert tp_err <= dense_err * 1.05, (tp_err, dense_err)
        assert tp_grad <= dense_grad * 1.05, (tp_grad, dense_grad)


def _backward_all_reduces(arch):
    parallel = tp.parallelize(build(arch), plan_from_transformers(build(arch)))
    ids = tokens(0)
    head = parallel.get_output_embeddings()
    loss = vocab_parallel_cross_entropy(parallel(ids).logits.flatten(0, 1),
                                        ids.roll(-1, 1).flatten(), sizes=head.shard.sizes)
    with tp.CommCounter() as backward:
        loss.backward()
    return backward.count("all_reduce"), parallel.config.num_hidden_layers


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_a_decoder_layer_all_reduces_twice_in_backward(arch):
    # q/k/v share one all-reduce of their input's gradient, gate/up another (Megatron's
    # count, without fusing the layers); the vocab-parallel head adds one
    for count, layers in run_distributed(_backward_all_reduces, 2, arch):
        assert count == 2 * layers + 1, (count, layers)
