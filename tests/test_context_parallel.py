"""context_parallel on transformers decoder LMs: loss, gradients and AdamW steps equal dense.

transformers keeps float32 islands inside a float64 model (RMSNorm's variance, the rotary
tables, the causal-LM loss on ``logits.float()``), so the bar is float32 rounding: the loss
within 1e-6 (compared in float64), each gradient within 1e-5 of its tensor's largest entry.
"""

import pytest
import torch
import torch.distributed as dist

from tensorpar.errors import CollectiveArgumentError
from tensorpar.nn import context_parallel
from tensorpar.testing import run_distributed

pytest.importorskip("transformers")

SMALL = {"vocab_size": 53, "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2,
         "max_position_embeddings": 128}
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 4}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6}),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6,
                 "sliding_window": 16}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6,
                "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]}),
}
LOSS_TOL, GRAD_TOL = 1e-6, 1e-5


def build(arch, dtype=torch.float64):
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra})
    config._attn_implementation = "eager" if arch.startswith("gemma") else "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).to(dtype)


def batch(seed, total):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (2, total), generator=g)
    labels = ids.clone()
    labels[0, total // 3] = -100  # an ignored label: the token count is the batch's
    return ids, labels


def backward_errors(dense, parallel, want, got):
    """Backward of both losses: the loss's error and each gradient's (relative to its max)."""
    want.backward()
    got.backward()
    errors = {"loss": abs(got.double().item() - want.double().item())}
    dense_params = dict(dense.named_parameters())
    for name, p in parallel.named_parameters():
        ref = dense_params[name].grad
        errors[name] = ((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return errors


def _errors(dense, parallel, ids, labels):
    """One forward and backward of both models: the loss's and each gradient's error."""
    return backward_errors(dense, parallel, dense(ids, labels=labels).loss,
                           parallel(ids, labels=labels).loss)


def _train(arch, total, steps):
    dense, parallel = build(arch), context_parallel(build(arch))
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(parallel.parameters(), lr=1e-3)
    history = []
    for step in range(steps):
        errors = _errors(dense, parallel, *batch(step, total))
        history.append(errors)
        dense_opt.step(), opt.step(), dense_opt.zero_grad(), opt.zero_grad()
    dense_params = dict(dense.named_parameters())
    drift = max(((p - dense_params[n]).abs().max() / dense_params[n].abs().max()).item()
                for n, p in parallel.named_parameters())
    return history, drift, dist.get_rank() if dist.is_initialized() else 0


def _assert_close(results, steps, drift_tol=GRAD_TOL):
    for history, drift, rank in results:
        assert len(history) == steps
        for step, errors in enumerate(history):
            assert errors["loss"] < LOSS_TOL, f"rank {rank} step {step}: loss {errors['loss']}"
            worst = max((v, k) for k, v in errors.items() if k != "loss")
            assert worst[0] < GRAD_TOL, f"rank {rank} step {step}: {worst[1]} off by {worst[0]}"
        assert drift < drift_tol, f"rank {rank}: parameters after {steps} steps off by {drift}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_trains_like_dense(arch, world):
    """T = 61 (uneven chunks, Mistral's window 16 and Gemma3's 5 cross the chunks)."""
    _assert_close(run_distributed(_train, world, arch, 61, 3, timeout=600), 3)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_short_sequence_four_ranks(arch):
    """T = 7 on 4 ranks: 8 chunks, one of them empty."""
    _assert_close(run_distributed(_train, 4, arch, 7, 1, timeout=600), 1)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("total", [7, 61])
def test_breadth(arch, world, total):
    _assert_close(run_distributed(_train, world, arch, total, 3, timeout=1200), 3)


def _config_shared(arch):
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra})
    torch.manual_seed(0)
    parallel = getattr(transformers, model_cls)(config).double()
    torch.manual_seed(0)
    dense = getattr(transformers, model_cls)(config).double()  # the same config object
    before = config._attn_implementation
    context_parallel(parallel)
    assert config._attn_implementation == before  # the dense model's is its own still
    ids, labels = batch(0, 12)
    want = dense(ids, labels=labels).loss  # (it ran tensorpar's attention, and raised)
    got = parallel(ids, labels=labels).loss
    assert abs(float(got) - float(want)) < LOSS_TOL * max(1.0, abs(float(want)))
    return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_dense_model_sharing_the_config_keeps_its_attention(arch):
    assert all(run_distributed(_config_shared, 2, arch, timeout=200))


def test_single_rank():
    history, drift, _ = _train("llama", 9, 1)
    _assert_close([(history, drift, 0)], 1)


def _tp_cp(arch, total, steps, lm_head):
    """4 ranks: tensor parallel over (0, 1) and (2, 3), context parallel over (0, 2), (1, 3)."""
    import tensorpar
    from tensorpar.nn import plan_from_transformers
    from tests.test_clip import dense_slice

    rank = dist.get_rank()
    groups = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3], [0, 2], [1, 3])]
    tp, cp = groups[rank // 2], groups[2 + rank % 2]
    dense, parallel = build(arch), build(arch)
    tensorpar.parallelize(parallel, plan_from_transformers(parallel, lm_head=lm_head), group=tp)
    context_parallel(parallel, group=cp)
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(parallel.parameters(), lr=1e-3)
    history = []
    for step in range(steps):
        ids, labels = batch(step, total)
        want, got = dense(ids, labels=labels), parallel(ids, labels=labels)
        want.loss.backward()
        got.loss.backward()
        errors = {"loss": abs(got.loss.double().item() - want.loss.double().item())}
        dense_params = dict(dense.named_parameters())
        for name, p in parallel.named_parameters():
            ref = dense_slice(parallel, name, dense_params[name].grad)
            errors[name] = ((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        history.append(errors)
        dense_opt.step(), opt.step(), dense_opt.zero_grad(), opt.zero_grad()
    dense_params = dict(dense.named_parameters())
    drift = 0.0
    for name, p in parallel.named_parameters():
        ref = dense_slice(parallel, name, dense_params[name])
        drift = max(drift, ((p - ref).abs().max() / ref.abs().max()).item())
    return history, drift, rank


@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tensor_times_context_parallel(arch):
    """TP 2 x CP 2 on 4 ranks, the default vocabulary-parallel head."""
    _assert_close(run_distributed(_tp_cp, 4, arch, 61, 3, "vocab_parallel", timeout=600), 3)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("lm_head", ["vocab_parallel", "gathered"])
def test_tensor_times_context_parallel_breadth(arch, lm_head):
    _assert_close(run_distributed(_tp_cp, 4, arch, 61, 3, lm_head, timeout=1200), 3)


def _dp_cp(arch, total, steps):
    """4 ranks: context parallel over (0, 1) and (2, 3), data parallel over (0, 2), (1, 3)."""
    from tensorpar.nn import DistributedDataParallel

    rank = dist.get_rank()
    groups = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3], [0, 2], [1, 3])]
    cp, dp = groups[rank // 2], groups[2 + rank % 2]
    replica = rank // 2  # which data-parallel batch this rank's context group runs
    dense = build(arch)
    parallel = DistributedDataParallel(context_parallel(build(arch), group=cp),
                                       process_group=dp)
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(parallel.parameters(), lr=1e-3)
    history = []
    for step in range(steps):
        want = sum(_loss(dense, step, r, total) for r in (0, 1)) / 2
        got = _loss(parallel, step, replica, total)
        want.backward()
        got.backward()
        errors = {"loss": 0.0}  # each replica's loss is its own batch's; gradients are averaged
        dense_params = dict(dense.named_parameters())
        for name, p in parallel.module.named_parameters():
            ref = dense_params[name].grad
            errors[name] = ((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        history.append(errors)
        dense_opt.step(), opt.step(), dense_opt.zero_grad(), opt.zero_grad()
    dense_params = dict(dense.named_parameters())
    drift = max(((p - dense_params[n]).abs().max() / dense_params[n].abs().max()).item()
                for n, p in parallel.module.named_parameters())
    return history, drift, rank


def _loss(model, step, replica, total):
    ids, labels = batch(100 * replica + step, total)
    return model(ids, labels=labels).loss


@pytest.mark.timeout(900)
def test_data_times_context_parallel():
    """DP 2 x CP 2 on 4 ranks (tensorpar's data-parallel wrapper over the context groups)."""
    _assert_close(run_distributed(_dp_cp, 4, "llama", 61, 3, timeout=600), 3)


def test_keyword_input_ids_and_refusals():
    model = context_parallel(build("llama"))
    ids, labels = batch(0, 5)
    assert model(input_ids=ids, labels=labels).loss.ndim == 0
    with pytest.raises(ValueError, match="attention_mask must be a padding mask"):
        model(ids, attention_mask=torch.ones(2, 1, 5, 5, dtype=torch.bool))  # 4-D
    with pytest.raises(ValueError, match="already context parallel"):
        context_parallel(model)


DISAGREEMENTS = ("input_ids", "labels", "attention_mask", "position_ids", "length", "batch",
                 "num_items_in_batch", "no_grad", "refused", "logits_to_keep",
                 "position_ids shape")


def _call_disagreeing(case, rank, model, ids, labels):
    """Call ``model`` as ``case`` has it: rank 1 differs from the others in one input."""
    kwargs = {"labels": labels}
    odd = rank == 1
    if case == "input_ids" and odd:
        ids = ids.flip(-1)
    if case == "labels" and odd:
        kwargs["labels"] = labels.roll(1, -1)
    if case == "attention_mask":
        mask = torch.ones_like(ids)
        mask[0, :3] = 0 if odd else 1  # padding on rank 1 only (all ones masks nothing)
        kwargs["attention_mask"] = mask
    if case == "position_ids":
        kwargs["position_ids"] = torch.arange(ids.shape[1]).unsqueeze(0) + (1 if odd else 0)
    if case == "length" and odd:
        ids, kwargs["labels"] = ids[:, :-2], labels[:, :-2]
    if case == "batch" and odd:
        ids, kwargs["labels"] = ids[:1], labels[:1]
    if case == "num_items_in_batch":
        kwargs["num_items_in_batch"] = torch.tensor(20 + int(odd))
    if case == "refused" and odd:
        kwargs["token_type_ids"] = torch.zeros_like(ids)
    if case == "logits_to_keep" and odd:  # a tensor (transformers takes one): refused, not raw
        kwargs["logits_to_keep"] = torch.tensor([0, 1])
    if case == "position_ids shape" and odd:  # another length: refused
        kwargs["position_ids"] = torch.arange(ids.shape[1] + 1).unsqueeze(0)
    with torch.set_grad_enabled(not (case == "no_grad" and odd)):
        return model(ids, **kwargs)


def _disagreeing_inputs(world):
    """Each case refused on every rank (type and message), then a call equal to dense."""
    rank = dist.get_rank()
    dense, parallel = build("llama"), context_parallel(build("llama"))
    ids, labels = batch(0, 13)
    refused = {}
    for case in DISAGREEMENTS:
        try:
            _call_disagreeing(case, rank, parallel, ids, labels)
            refused[case] = None
        except Exception as e:  # the test compares what each rank raised
            refused[case] = (type(e).__name__, str(e))
    return refused, _errors(dense, parallel, ids, labels)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_on_the_inputs_are_refused_on_every_rank(world):
    """A rank given another batch (or none, or another shape) is refused on every rank.

    Before, other tokens, labels, masks or positions on one rank gave every rank the same
    wrong loss, silently, and another shape crashed the ranks in gloo.
    """
    results = run_distributed(_disagreeing_inputs, world, world, timeout=600)
    expected = {"input_ids": "input_ids differ", "labels": "labels differ",
                "attention_mask": "the padding of attention_mask differ",
                "position_ids": "position_ids differ", "length": "shapes",
                "batch": "shapes", "num_items_in_batch": "num_items_in_batch differ",
                "no_grad": "whether gradients are on", "refused": "refused their inputs",
                "logits_to_keep": "refused their inputs",
                "position_ids shape": "refused their inputs"}
    for rank, (refused, errors) in enumerate(results):
        for case, words in expected.items():
            got = refused[case]
            assert got is not None, f"rank {rank}: {case} was not refused"
            kind, message = got
            if case == "refused" and rank == 1:  # the rank's own error
                assert "token_type_ids" in message, message
                continue
            if case == "logits_to_keep" and rank == 1:
                assert kind == "ValueError" and "logits_to_keep is not supported" in message, \
                    message
                continue
            if case == "position_ids shape" and rank == 1:
                assert kind == "ValueError" and "position_ids must be shaped" in message, message
                continue
            assert kind == "CollectiveArgumentError", (rank, case, got)
            assert words in message, (rank, case, message)
            if case not in ("length", "batch", "refused", "logits_to_keep",
                            "position_ids shape"):
                assert "rank(s) [1]" in message, message
        assert errors["loss"] < LOSS_TOL, errors  # nothing left over from the refusals
        assert max(v for k, v in errors.items() if k != "loss") < GRAD_TOL, errors


def _attention_differs():
    attention = "ulysses" if dist.get_rank() == 1 else "ring"
    parallel = context_parallel(build("llama"), attention=attention)
    ids, labels = batch(0, 12)
    try:
        parallel(ids, labels=labels)
    except CollectiveArgumentError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_ranks_given_other_attentions_are_refused_on_every_rank():
    """Ring attention on one rank and Ulysses on another: refused before any exchange."""
    for message in run_distributed(_attention_differs, 2, timeout=100):
        assert message is not None and "attention (context_parallel's attention=) differ" \
            in message, message


def _models_differ(what):
    model = build("llama")
    if dist.get_rank() == 1:
        if what == "layers":  # one more decoder layer
            import transformers
            config = transformers.LlamaConfig(**{**SMALL, **ARCHS["llama"][2],
                                                 "num_hidden_layers": 3})
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(config).double()
        elif what == "rope_theta":
            model.config.rope_theta = 5e5
            model.model.rotary_emb.__init__(model.config)
        elif what == "eval":
            model.eval()
        elif what == "frozen":  # another parameter frozen: its gradient is summed elsewhere
            model.lm_head.requires_grad_(False)
        else:  # loaded from another path: the same model
            model.config._name_or_path = "/elsewhere/llama"
    parallel = context_parallel(model)
    if what == "cast" and dist.get_rank() == 1:  # after the call, on one rank
        parallel.float()
    ids, labels = batch(0, 12)
    try:
        parallel(ids, labels=labels).loss.backward()
    except CollectiveArgumentError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["layers", "rope_theta", "eval", "cast", "frozen"])
def test_ranks_given_other_models_or_modes_are_refused_on_every_rank(what):
    # another depth hung every rank; another rope_theta gave a wrong loss, silently; a
    # cast on one rank aborted the processes in gloo
    for message in run_distributed(_models_differ, 2, what, timeout=100):
        assert message is not None and "differ between rank 0 and rank(s) [1]" in message, \
            message


def _parameters_changed_after_conversion(how):
    """A parameter that trains after ``context_parallel`` but was not there, or was frozen,
    when it ran: its gradient is summed over the group as every other's."""
    dense = build("llama")
    parallel = context_parallel(build("llama").requires_grad_(how != "unfrozen"))
    if how == "unfrozen":
        parallel.requires_grad_(True)
    else:  # new parameter objects (as to_empty after a conversion on the meta device)
        parallel.load_state_dict(dense.state_dict(), assign=True)
    return _errors(dense, parallel, *batch(0, 13))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["unfrozen", "assigned"])
def test_parameters_unfrozen_or_replaced_after_conversion_get_the_dense_gradient(how):
    for errors in run_distributed(_parameters_changed_after_conversion, 2, how, timeout=100):
        worst = max((v, k) for k, v in errors.items() if k != "loss")
        assert errors["loss"] < LOSS_TOL and worst[0] < GRAD_TOL, worst


@pytest.mark.timeout(120)
def test_the_same_model_loaded_from_other_paths_is_the_same_model():
    assert run_distributed(_models_differ, 2, "path", timeout=100) == [None, None]


def _compiled(world, attention):
    """A compiled context-parallel Llama against dense (a padding mask on one row); then
    another batch on rank 1."""
    dense, parallel = build("llama"), context_parallel(build("llama"), attention=attention)
    compiled = torch.compile(parallel, backend="eager")
    ids, labels = batch(0, 13)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    errors = backward_errors(dense, parallel, dense(ids, labels=labels, attention_mask=mask).loss,
                             compiled(ids, labels=labels, attention_mask=mask).loss)
    try:
        compiled(ids.flip(-1) if dist.get_rank() == 1 else ids, labels=labels)
        refused = None
    except CollectiveArgumentError as e:
        refused = str(e)
    return errors, refused


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_compiled_model_equals_dense_and_still_compares_the_ranks(attention):
    """torch.compile over a context-parallel model (its hooks traced with it) equals dense."""
    for errors, refused in run_distributed(_compiled, 2, 2, attention, timeout=600):
        assert errors["loss"] < LOSS_TOL, errors
        assert max(v for k, v in errors.items() if k != "loss") < GRAD_TOL, errors
        assert refused is not None and "input_ids differ" in refused, refused


def test_padding_goes_to_the_tokens_device():
    """A mask on another device than input_ids (dense moves it to the embedding's) follows
    the tokens: ``meta`` stands for an accelerator here."""
    from tensorpar.context import hf

    model = context_parallel(build("llama"))
    ids = torch.randint(0, 50, (2, 8), device="meta")
    mask = torch.ones(2, 8, dtype=torch.long)  # on the CPU
    mask[0, :2] = 0
    _, kwargs = hf._before(model, (ids,), {"attention_mask": mask})
    assert kwargs[hf.CALL].visible.on_device.device == ids.device


def _exchange_devices(world):
    """The device hint each rank's input comparison uses, rank 1 refusing its inputs."""
    from tensorpar.comm._group import Group

    model = context_parallel(build("llama"))
    ids, labels = batch(0, 9)
    hints, real = [], Group.comm_device

    def spy(self, hint=None):
        hints.append(hint)
        return real(self, hint)

    Group.comm_device = spy
    try:
        kwargs = {"token_type_ids": torch.zeros_like(ids)} if dist.get_rank() == 1 else {}
        with pytest.raises(ValueError):
            model(ids, labels=labels, **kwargs)
    finally:
        Group.comm_device = real
    return hints[0]


@pytest.mark.timeout(300)
def test_a_refusing_rank_compares_on_the_same_device_as_the_others():
    """The comparison's buffer goes where the model's embedding is, on every rank: a rank
    whose inputs were refused once put it on the group's default device (with a CPU and a
    CUDA backend in one group, the ranks would meet in two backends and wait for ever)."""
    hints = run_distributed(_exchange_devices, 2, 2, timeout=120)
    assert hints == [torch.device("cpu")] * 2, hints


def _same_values_other_dtypes(world):
    model = context_parallel(build("llama"))
    ids, labels = batch(0, 9)
    narrow = dist.get_rank() == 1
    out = model(ids.int() if narrow else ids, labels=labels,
                num_items_in_batch=torch.tensor(16, dtype=torch.int32 if narrow else torch.int64))
    return out.loss.item()


@pytest.mark.timeout(300)
def test_the_same_values_in_other_dtypes_agree():
    losses = run_distributed(_same_values_other_dtypes, 2, 2, timeout=120)
    assert losses[0] == losses[1], losses
