"""context_parallel across transformers' families, and the pieces some of them need.

A family's attention may carry more than the ring's causal mask and window (gpt-oss's
attention sinks), and some families mix positions outside attention (a mamba or
linear-attention layer, a per-layer input computed from the token ids), which a split
sequence gets silently wrong. So context_parallel runs only the families measured equal
to dense (`CONTEXT_MODEL_TYPES`) and refuses the others by name.
"""

import pytest
import torch
import torch.distributed as dist

from tensorpar.testing import run_distributed

TOL = 1e-10


def _sink_errors(lengths, causal, window):
    """Ring attention with sinks against the eager formula (sink logits beside the keys')."""
    from tensorpar.comm._group import resolve_group
    from tensorpar.context._ring import RingSpec, ring_apply
    from tensorpar.context.layout import contiguous_layout
    from tests.test_ring_attention import dense_mask

    rank = dist.get_rank() if dist.is_initialized() else 0
    total, batch, heads, dim, scale = sum(lengths), 2, 4, 5, 0.3
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(batch, heads, total, dim, generator=g, dtype=torch.float64)
               for _ in range(3))
    sinks = torch.randn(heads, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, heads, total, dim, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    logits = leaves[0] @ leaves[1].transpose(-1, -2) * scale
    logits = logits.masked_fill(~dense_mask(total, causal, window), float("-inf"))
    with_sink = torch.cat([logits, leaves[3].view(1, -1, 1, 1).expand(batch, -1, total, 1)], -1)
    ref = torch.softmax(with_sink, -1)[..., :-1] @ leaves[2]
    ref.backward(dout)
    start = sum(lengths[:rank])
    mine = slice(start, start + lengths[rank])
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    local_sinks = sinks.clone().requires_grad_()
    spec = RingSpec(group=resolve_group(None, "test"), layout=contiguous_layout(list(lengths)),
                    causal=causal, window=window, scale=scale, kv_groups=1)
    out = ring_apply(*local, spec, local_sinks)
    out.backward(dout[:, :, mine])
    if dist.is_initialized():  # each rank's queries' share of the sinks' gradient
        dist.all_reduce(local_sinks.grad)
    errors = {"out": (out - ref[:, :, mine]).abs().max().item() if out.numel() else 0.0,
              "dsinks": (local_sinks.grad - leaves[3].grad).abs().max().item()}
    for name, loc, full in zip("qkv", local, leaves, strict=False):
        diff = loc.grad - full.grad[:, :, mine]
        errors["d" + name] = diff.abs().max().item() if diff.numel() else 0.0
    return errors


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lengths,causal,window", [((6, 9), True, None), ((5, 0, 8), True, 4),
                                                   ((7, 3), False, None)])
def test_ring_attention_with_sinks(lengths, causal, window):
    for rank, errors in enumerate(run_distributed(_sink_errors, len(lengths), lengths, causal,
                                                  window, timeout=120)):
        for name, err in errors.items():
            assert err < TOL, f"rank {rank}: {name} off by {err}"


# Sliding windows and attention chunks of 4 at T = 13 on 2 ranks (chunks of 3 and 4 tokens):
# every window crosses a cut. Set where a family's config declares the field.
WINDOWS = {"sliding_window": 4, "attention_chunk_size": 4, "sliding_window_size": 4,
           "use_sliding_window": True, "max_window_layers": 1}
LOSS_TOL, GRAD_TOL = 1e-6, 1e-5  # float32 islands in float64 models (test_context_parallel)


def _families():
    from tests._hf_sweep import architectures

    return {model_type: (config, cls) for model_type, config, cls in architectures()}


PACKED = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8],  # documents across the cuts
                       [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6]])


def _padding(dense):
    """A padding mask: row 0 padded before its tokens, row 1 after them (queries that see no
    key: a window of 4 over 4 padded tokens), where dense runs SDPA; else both after, 3 at
    most (eager attention gives NaN at a query that sees no key)."""
    mask = torch.ones(2, 13, dtype=torch.long)
    try:
        dense.set_attn_implementation("sdpa")
        mask[0, :3] = mask[1, 9:] = 0
    except (ValueError, ImportError):
        mask[0, 11:] = mask[1, 10:] = 0
    return mask


def _family_errors(model_type, force=False, inputs="plain", attention="ring"):
    """``(loss error / loss, worst gradient error / its tensor's largest entry, name)``.

    ``inputs``: ``"packed"``: two documents per row (restarting ``position_ids``), without a
    cache; ``"padded"``: a padding ``attention_mask`` (the padded tokens' labels kept, so
    their logits count too); ``"router"``: padded, with the MoE families' router logits
    and load-balancing loss on (``output_router_logits``), the ``aux_loss`` compared too.
    """
    import warnings

    from tensorpar.context import hf
    from tensorpar.nn import context_parallel
    from tests._hf_sweep import _build

    config, cls = _families()[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extra = {**WINDOWS, "output_router_logits": inputs == "router"}
        dense = _build(model_type, config, cls, layers=4, extra=extra)
        model = _build(model_type, config, cls, layers=4, extra=extra)
        checks = hf._unsupported
        if force:  # run it whatever the checks say (these processes serve other tests too)
            hf._unsupported = lambda config: None
        try:
            context_parallel(model, attention=attention)
        finally:
            hf._unsupported = checks
        ids = torch.randint(2, 101, (2, 13), generator=torch.Generator().manual_seed(0))
        extra = {"position_ids": PACKED} if inputs == "packed" else \
            {"attention_mask": _padding(dense)} if inputs in ("padded", "router") else {}
        want = dense(ids, labels=ids, use_cache=False, **extra)
        want.loss.backward()
        got = model(ids, labels=ids, use_cache=False, **extra)
        got.loss.backward()
    loss = abs(got.loss.item() - want.loss.item()) / abs(want.loss.item())
    want_aux, got_aux = getattr(want, "aux_loss", None), getattr(got, "aux_loss", None)
    if want_aux is not None or got_aux is not None:
        aux = float("inf") if want_aux is None or got_aux is None else \
            abs(got_aux.item() - want_aux.item()) / abs(want_aux.item())
        loss = max(loss, aux)
    worst, where = 0.0, ""
    grads = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        ref = grads[name].grad
        if ref is None and p.grad is None:
            continue
        err = float("inf") if ref is None or p.grad is None else \
            ((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        if not err <= worst:  # NaN counts
            worst, where = err, name
    return loss, worst, where


def _listed_errors(names, inputs, attention):
    return {name: _family_errors(name, inputs=inputs, attention=attention) for name in names}


def _assert_listed_equal_dense(names, inputs="plain", world=2, attention="ring"):
    wrong = [f"{name} on rank {rank}: loss off by {loss:.1e}, {where} by {worst:.1e}"
             for rank, results in enumerate(run_distributed(_listed_errors, world, names,
                                                            inputs, attention, timeout=900))
             for name, (loss, worst, where) in results.items()
             if not (loss < LOSS_TOL and worst < GRAD_TOL)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.timeout(600)
def test_listed_families_equal_dense():
    """Attention sinks (gpt-oss, granitemoe_swa), sliding and full layers (cohere2), latent
    attention (deepseek_v3), biases (starcoder2), a parallel block (phi), a fused qkv
    (gpt_neox)."""
    _assert_listed_equal_dense(["gpt_oss", "granitemoe_swa", "cohere2", "deepseek_v3",
                                "starcoder2", "phi", "gpt_neox"])


@pytest.mark.timeout(600)
def test_packed_rows_follow_each_familys_masks():
    """gpt-oss and AFMoE attend across packed documents in dense transformers (their masks
    are not given the positions), Cohere2 and Llama keep them apart: each as dense."""
    _assert_listed_equal_dense(["gpt_oss", "afmoe", "cohere2", "llama"], inputs="packed")


@pytest.mark.timeout(600)
def test_load_balancing_loss_is_the_whole_sequences():
    """MoE families with ``output_router_logits``: transformers adds a load-balancing loss
    over every token's router logits (masked by the padding); the ``aux_loss`` and the loss
    equal dense, and so does the router's gradient."""
    _assert_listed_equal_dense(["mixtral", "qwen3_moe", "gpt_oss", "olmoe"], inputs="router")
    _assert_listed_equal_dense(["mixtral"], inputs="router", world=3)


def test_load_balancing_loss_refuses_tuple_outputs():
    from tensorpar.nn import context_parallel
    from tests._hf_sweep import _build

    config, cls = _families()["mixtral"]
    model = context_parallel(_build("mixtral", config, cls, extra={"output_router_logits": True}))
    ids = torch.randint(2, 101, (1, 9), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="return_dict=False with output_router_logits"):
        model(ids, labels=ids, return_dict=False)
    assert model(ids, labels=ids).aux_loss is not None  # one rank: as the dense model


@pytest.mark.timeout(600)
def test_padding_masks_follow_each_familys_masks():
    """Sinks with padding (gpt-oss), sliding and full layers (cohere2), latent attention
    (deepseek_v3), a parallel block (phi), a fused qkv (gpt_neox)."""
    _assert_listed_equal_dense(["gpt_oss", "cohere2", "deepseek_v3", "phi", "gpt_neox"],
                               inputs="padded")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("inputs", ["plain", "packed", "router"])  # router: padded too
def test_every_listed_family_equals_dense(inputs):
    from tensorpar.context.hf import CONTEXT_MODEL_TYPES

    missing = [t for t in CONTEXT_MODEL_TYPES if t not in _families()]
    assert not missing, f"listed but not in this transformers: {missing}"
    _assert_listed_equal_dense(list(CONTEXT_MODEL_TYPES), inputs=inputs)


def _has_sinks(model_type):
    import warnings

    from tests._hf_sweep import _build

    config, cls = _families()[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _build(model_type, config, cls, layers=4, extra=WINDOWS)  # as the tests
    return any(name.endswith("sinks") for name, _ in model.named_parameters())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("inputs", ["plain", "packed", "router"])
def test_ulysses_attention_in_listed_families_equals_dense(inputs):
    """Sliding and full layers (cohere2), latent attention (deepseek_v3), a parallel block
    (phi), a load-balancing loss (mixtral), at 2 and 3 ranks."""
    names = ["cohere2", "deepseek_v3", "phi", "mixtral"]
    _assert_listed_equal_dense(names, inputs=inputs, attention="ulysses")
    _assert_listed_equal_dense(names[:1], inputs=inputs, world=3, attention="ulysses")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("inputs", ["plain", "packed", "router"])
def test_every_listed_family_without_sinks_equals_dense_with_ulysses(inputs):
    from tensorpar.context.hf import CONTEXT_MODEL_TYPES

    names = [t for t in CONTEXT_MODEL_TYPES if not _has_sinks(t)]
    assert len(names) >= 70, names
    _assert_listed_equal_dense(names, inputs=inputs, attention="ulysses")


def test_ulysses_refuses_attention_sinks_and_unknown_kinds():
    from tensorpar.nn import context_parallel
    from tests._hf_sweep import _build

    config, cls = _families()["gpt_oss"]
    model = _build("gpt_oss", config, cls, extra=WINDOWS)
    with pytest.raises(ValueError, match="sinks are not supported with attention='ulysses'"):
        context_parallel(model, attention="ulysses")
    assert not hasattr(model, "_tensorpar_context")  # refused before anything changed
    config, cls = _families()["llama"]
    with pytest.raises(ValueError, match="attention must be one of"):
        context_parallel(_build("llama", config, cls), attention="flash")


def test_unlisted_families_and_layer_kinds_are_refused():
    import transformers

    from tensorpar.nn import context_parallel

    def tiny(config_cls, **extra):
        config = config_cls(vocab_size=11, hidden_size=8, intermediate_size=8,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                            **extra)
        return config

    jamba = transformers.JambaForCausalLM(tiny(transformers.JambaConfig))
    with pytest.raises(ValueError, match="model_type 'jamba' has not been measured"):
        context_parallel(jamba)
    lfm2 = transformers.Lfm2ForCausalLM(tiny(transformers.Lfm2Config, full_attn_idxs=[1]))
    with pytest.raises(ValueError, match="layers of kind conv"):
        context_parallel(lfm2)
    assert not hasattr(lfm2, "_tensorpar_context")  # refused before anything changed
    gemma = transformers.GemmaForCausalLM(tiny(transformers.GemmaConfig,
                                               use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        context_parallel(gemma)


def test_a_composite_model_is_judged_by_its_own_type():
    """A multimodal config whose text part is listed is not itself listed (not measured)."""
    import transformers

    from tensorpar.context.hf import _unsupported

    assert "model_type 'gemma3' has not been measured" in _unsupported(transformers.Gemma3Config())
    assert _unsupported(transformers.Gemma3TextConfig()) is None


def test_inputs_that_shape_attention_are_refused():
    from tensorpar.nn import context_parallel
    from tests.test_context_parallel import batch, build

    model = context_parallel(build("llama"))
    ids, labels = batch(0, 9)
    with pytest.raises(ValueError, match="token_type_ids"):
        model(ids, labels=labels, token_type_ids=torch.ones_like(ids))
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, labels=labels, logits_to_keep=1)


def test_num_items_in_batch_is_the_losss_denominator():
    """As the dense model's loss (gradient accumulation divides by the whole step's count)."""
    from tensorpar.nn import context_parallel
    from tests.test_context_parallel import batch, build

    dense, model = build("llama"), context_parallel(build("llama"))
    ids, labels = batch(0, 9)
    want = dense(ids, labels=labels, num_items_in_batch=40).loss
    got = model(ids, labels=labels, num_items_in_batch=40).loss
    assert abs(got.item() - want.item()) < 1e-6
    assert abs(want.item() - dense(ids, labels=labels).loss.item()) > 1e-3  # it matters


def _forced(model_type):
    loss, worst, where = _family_errors(model_type, force=True)
    return loss < LOSS_TOL and worst < GRAD_TOL, f"loss {loss:.1e}, {where} {worst:.1e}"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_unlisted_family_is_wrong_when_forced():
    """The list leaves out nothing that works: each other family, run anyway, differs from
    dense, fails, or hangs (its own processes, with a timeout)."""
    from tensorpar.context.hf import CONTEXT_MODEL_TYPES

    unlisted = [t for t in _families() if t not in CONTEXT_MODEL_TYPES]
    close, ran = [], []
    for model_type in unlisted:
        try:
            results = run_distributed(_forced, 2, model_type, timeout=120)
        except Exception:  # any failure, or a hang: not a family that works
            continue
        ran.append(model_type)
        if all(ok for ok, _ in results):
            close.append(f"{model_type} ({results[0][1]})")
    assert not close, f"equal to dense but not listed in CONTEXT_MODEL_TYPES: {close}"
    # the forcing works: families that run to the end, wrong (mamba, convolution, sinks-free
    # linear attention, a mask of their own)
    assert {"jamba", "lfm2_moe", "qwen3_next", "doge"} <= set(ran), ran


def test_return_dict_false_gives_the_loss_first():
    """As the dense model's tuple (it raised: the loss hook read ``out.logits``)."""
    from tensorpar.nn import context_parallel
    from tests.test_context_parallel import batch, build

    dense, model = build("llama"), context_parallel(build("llama"))
    ids, labels = batch(0, 9)
    want = dense(ids, labels=labels, return_dict=False, use_cache=False)  # (no cache here)
    got = model(ids, labels=labels, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want)
    assert abs(got[0].item() - want[0].item()) < 1e-6
    assert torch.allclose(got[1], want[1], atol=1e-6)  # one rank: the whole sequence


def _tp_cp_family(model_type):
    """TP 2 x CP 2 on 4 ranks (tensor parallel over (0, 1) and (2, 3))."""
    import warnings

    import tensorpar
    from tensorpar.nn import context_parallel, plan_from_transformers
    from tests._hf_sweep import _build
    from tests.test_clip import dense_slice

    rank = dist.get_rank()
    groups = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3], [0, 2], [1, 3])]
    tp, cp = groups[rank // 2], groups[2 + rank % 2]
    config, cls = _families()[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = _build(model_type, config, cls, layers=4, extra=WINDOWS)
        model = _build(model_type, config, cls, layers=4, extra=WINDOWS)
        tensorpar.parallelize(model, plan_from_transformers(model), group=tp)
        context_parallel(model, group=cp)
        ids = torch.randint(2, 101, (2, 13), generator=torch.Generator().manual_seed(0))
        want = dense(ids, labels=ids, use_cache=False)
        want.loss.backward()
        got = model(ids, labels=ids, use_cache=False)
        got.loss.backward()
    grads = dict(dense.named_parameters())
    worst = max(((p.grad - dense_slice(model, n, grads[n].grad)).abs().max()
                 / grads[n].grad.abs().max().clamp_min(1e-30)).item()
                for n, p in model.named_parameters())
    return abs(got.loss.item() - want.loss.item()) / abs(want.loss.item()), worst


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sinks_under_tensor_and_context_parallelism():
    """gpt-oss: each rank's heads' sinks, over its share of the sequence."""
    for loss, worst in run_distributed(_tp_cp_family, 4, "gpt_oss", timeout=600):
        assert loss < LOSS_TOL and worst < GRAD_TOL, (loss, worst)
