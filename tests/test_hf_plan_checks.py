"""Hand plans that contradict the model's own plan are refused; whole-logit readers refuse a
vocab-parallel head; T5 (encoder-decoder) trains like dense."""

import pytest
import torch

import tensorpar as tp
from tensorpar.nn import Colwise, Rowwise, plan_from_transformers
from tensorpar.testing import run_distributed
from tests.test_hf_models import build, tokens

pytest.importorskip("transformers")

HAND_PLANS = {
    # the packed [gate; up] split plainly: each rank would get a slice of gate only
    "phi3": ("model.layers.0.mlp.gate_up_proj",
             {"model.layers.*.mlp.gate_up_proj": "colwise",
              "model.layers.*.mlp.down_proj": "rowwise"},
             "PackedColwise(blocks=2"),
    # the obvious GPT-2 plan: c_attn's output is sliced at global offsets by the forward
    "gpt2": ("transformer.h.0.attn.c_attn",
             {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise",
              "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"},
             "Colwise(gather_output=True"),
    # the obvious GPT-NeoX plan: query_key_value interleaves (q, k, v) per head (at TP 2 its
    # 4 heads split 2 + 2 either way, and the plan is right: only TP 3 is refused)
    "gpt_neox": ("gpt_neox.layers.0.attention.query_key_value",
                 {"gpt_neox.layers.*.attention.query_key_value": "colwise",
                  "gpt_neox.layers.*.attention.dense": "rowwise"},
                 "Colwise(gather_output=False, multiple_of=18)"),
}


def _refused(arch):
    model = build(arch)
    before = {n: p.clone() for n, p in model.named_parameters()}
    try:
        tp.parallelize(model, HAND_PLANS[arch][1])
    except ValueError as e:
        unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        kinds = {type(m).__name__ for m in model.modules()}
        return str(e), unchanged and "ColumnParallelLinear" not in kinds
    return None, False


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("arch", sorted(HAND_PLANS))
def test_a_hand_plan_contradicting_the_models_own_is_refused_on_every_rank(arch, world_size):
    results = run_distributed(_refused, world_size, arch, timeout=120)
    if (arch, world_size) == ("gpt_neox", 2):  # whole heads either way: accepted
        assert results == [(None, False)] * world_size
        return
    messages = {message for message, _ in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    module, _, expected = HAND_PLANS[arch]
    assert message is not None and "contradicts the model's own plan" in message
    assert f"{module!r}: the plan gives Colwise(gather_output=False, multiple_of=1)" in message
    assert expected in message, message
    assert all(unchanged for _, unchanged in results)


def _qwen3_without_partial_grad():
    from tests.test_hf_styles import build as build_styles

    plan = plan_from_transformers(build_styles("qwen3"))
    del plan["model.layers.*.self_attn.q_norm"]
    try:
        tp.parallelize(build_styles("qwen3"), plan)
    except ValueError as e:
        return str(e)
    return None


def test_a_per_head_norm_left_out_of_a_hand_plan_is_refused():
    messages = run_distributed(_qwen3_without_partial_grad, 2, timeout=180)
    assert len(set(messages)) == 1 and messages[0] is not None
    assert "'model.layers.0.self_attn.q_norm': the plan gives replicated" in messages[0]
    assert "needs PartialGrad()" in messages[0] and "partial" in messages[0]


def _whole_logits():
    model = tp.parallelize(build("llama-gqa-tied"), plan_from_transformers(build("llama-gqa-tied")))
    ids = tokens(0, n=5)
    out = []
    for call in (lambda: model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0),
                 lambda: model(ids, labels=ids)):
        try:
            call()
            out.append(None)
        except RuntimeError as e:
            out.append(str(e))
    out.append(tuple(model(ids).logits.shape))  # the local logits themselves still work
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_generate_and_labels_refuse_a_vocab_parallel_head(world_size):
    results = run_distributed(_whole_logits, world_size, timeout=180)
    generate, labels, _ = results[0]
    assert all(r[:2] == [generate, labels] for r in results)
    assert generate.startswith("generate(): the LM head 'lm_head' is vocab-parallel")
    assert "lm_head='gathered'" in generate
    assert labels.startswith("forward(labels=...)")
    assert [r[2][-1] for r in results] == [101 // world_size + (r < 101 % world_size)
                                          for r in range(world_size)]


T5 = {"vocab_size": 101, "d_model": 24, "d_kv": 6, "d_ff": 50, "num_layers": 2,
      "num_decoder_layers": 2, "num_heads": 4, "dropout_rate": 0.0,
      "decoder_start_token_id": 0, "pad_token_id": 0}


def _t5(feed_forward_proj, tol=1e-10):
    import transformers

    config = transformers.T5Config(**T5, feed_forward_proj=feed_forward_proj)

    def model():
        torch.manual_seed(0)
        return transformers.T5ForConditionalGeneration(config).double()

    dense = model()
    parallel = tp.parallelize(model(), plan_from_transformers(model(), lm_head="gathered"))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (dense, parallel)]
    for step in range(3):
        ids, labels = tokens(step), tokens(step + 10, n=6)
        outs = [m(input_ids=ids, labels=labels) for m in (dense, parallel)]
        torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=tol, atol=tol)
        torch.testing.assert_close(outs[1].loss, outs[0].loss, rtol=tol, atol=tol)
        for out in outs:
            out.loss.backward()
        grads = dict(dense.named_parameters())
        for name, p in parallel.named_parameters():
            owner, _, leaf = name.rpartition(".")
            module = parallel.get_submodule(owner)
            dim = getattr(module, "sharded_dims", {}).get(leaf)
            expected = grads[name].grad if dim is None else \
                grads[name].grad.narrow(dim, module.shard.start, module.shard.length)
            torch.testing.assert_close(p.grad, expected, rtol=tol, atol=tol, msg=name)
        for opt in opts:
            opt.step(), opt.zero_grad()
    generated = [m.generate(tokens(5), max_new_tokens=4, do_sample=False) for m in (dense,
                                                                                   parallel)]
    assert torch.equal(generated[0], generated[1])
    wi = parallel.encoder.block[0].layer[1].DenseReluDense
    return type(getattr(wi, "wi", None) or wi.wi_0).__name__


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("feed_forward_proj", ["relu", "gated-gelu"])
def test_t5_trains_and_generates_like_dense(feed_forward_proj, world_size):
    kinds = run_distributed(_t5, world_size, feed_forward_proj, timeout=180)
    assert set(kinds) == {"ColumnParallelLinear"}


def test_t5_plan_gathers_attention_and_splits_the_mlp():
    import transformers

    plan = plan_from_transformers(transformers.T5ForConditionalGeneration(
        transformers.T5Config(**T5)))
    assert plan["**.SelfAttention.[qkv]"] == Colwise(gather_output=True)
    assert plan["**.EncDecAttention.o"] == Rowwise(input_is_parallel=False)
    assert plan["**.DenseReluDense.wi"] == Colwise()
    assert {k for k, v in plan.items() if isinstance(v, tp.nn.Vocab)} == {
        "shared", "encoder.embed_tokens", "decoder.embed_tokens"}


def _tiny_llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=4, **kw))


def _shared_mask_warnings(model, **kw):
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plan_from_transformers(model, **kw)
    return [str(w.message) for w in seen if "draws the same masks" in str(w.message)]


def test_dropout_over_split_heads_or_slices_warns():
    # every rank's heads drew the same dropout masks (measured at TP 2 with attention
    # dropout 0.5: rank 0's masks equal rank 1's), and nothing said so
    from transformers import BertConfig, BertModel

    (message,) = _shared_mask_warnings(_tiny_llama(attention_dropout=0.25))
    assert "(attention_dropout=0.25)" in message
    bert = BertModel(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                num_attention_heads=4, intermediate_size=32))
    assert "attention_probs_dropout_prob=0.1" in _shared_mask_warnings(bert)[0]
    assert _shared_mask_warnings(_tiny_llama()) == []
    # hidden dropout is on whole (replicated) tensors, unless the sequence is split
    assert _shared_mask_warnings(_tiny_llama(hidden_dropout=0.1)) == []
    (message,) = _shared_mask_warnings(_tiny_llama(hidden_dropout=0.1), sequence_parallel=True)
    assert "hidden_dropout=0.1" in message
    # a model the plan refuses gets the refusal alone
    import warnings

    with warnings.catch_warnings(record=True) as seen, pytest.raises(ValueError):
        warnings.simplefilter("always")
        plan_from_transformers(bert, sequence_parallel=True)
    assert not [w for w in seen if "draws the same masks" in str(w.message)]
