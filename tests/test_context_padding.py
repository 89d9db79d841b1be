"""Padding masks under context parallelism: padded keys hidden from every query, as dense.

A batch of rows of different lengths is padded to one length; transformers' ``attention_mask``
(``(B, T)``, 0 at padding) then hides the padded keys from every query. `ring_attention` and
`ulysses_attention` take it as ``key_mask`` (the whole sequence's, on every rank), and
`context_parallel` passes the model's ``attention_mask`` on: output, loss, every gradient and
the logits at every position (padding included) equal dense. A query that sees no key (left
padding) gets a zero output and no gradient, as SDPA gives it.
"""

import pytest
import torch
import torch.distributed as dist

from tensorpar.testing import run_distributed
from tests.test_context_packed import DRIFT_TOL
from tests.test_context_parallel import GRAD_TOL, LOSS_TOL, backward_errors, batch, build

TOL = 1e-10


def key_mask_of(total, kind):
    """``(2, total)`` masks: ``left`` (row 0 padded across the first cut), ``right`` (one row
    padded at the end, the other at both ends), ``holes`` (scattered zeros, a row of none
    kept)."""
    keep = torch.ones(2, total, dtype=torch.bool)
    if kind == "left":
        keep[0, :11] = False
    elif kind == "right":
        keep[0, total - 6:] = False
        keep[1, :2] = keep[1, total - 3:] = False
    elif kind == "holes":
        keep[0] = torch.rand(total, generator=torch.Generator().manual_seed(5)) < 0.6
        keep[1] = False
    return keep


def _ring_errors(lengths, causal, window, heads, kernel, kind, ulysses=False, as_ints=False):
    """This rank's output and q/k/v gradients against SDPA with the padding's mask."""
    import torch.nn.functional as F

    from tensorpar.context import _blocks
    from tensorpar.nn import ring_attention, ulysses_attention
    from tests.test_ring_attention import chunk_errors, dense_mask

    rank = dist.get_rank() if dist.is_initialized() else 0
    total, dim = sum(lengths), 5
    keep = key_mask_of(total, kind)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, h, total, dim, generator=g, dtype=torch.float64)
               for h in (heads[0], heads[1], heads[1]))
    dout = torch.randn(2, heads[0], total, dim, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = (dense_mask(total, causal, window) & keep[:, None, :]).unsqueeze(1)
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=mask,
                                         enable_gqa=heads[0] != heads[1])
    ref.backward(dout)
    start = sum(lengths[:rank])
    mine = slice(start, start + lengths[rank])
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    attention = ulysses_attention if ulysses else ring_attention
    fused = _blocks._fused
    if kernel == "math":
        _blocks._fused = lambda t: False
    try:
        out = attention(*local, is_causal=causal, window=window, enable_gqa=heads[0] != heads[1],
                        key_mask=keep.long() if as_ints else keep)
        out.backward(dout[:, :, mine])
    finally:
        _blocks._fused = fused
    return chunk_errors(out, ref, local, leaves, mine)


RING_CASES = [((9, 14), True, None, (4, 4), "auto", "left"),
              ((9, 14), True, None, (4, 2), "math", "left"),
              ((9, 14), False, None, (4, 2), "auto", "right"),
              ((5, 0, 8), True, 4, (4, 4), "math", "right"),
              ((5, 0, 8), False, 3, (4, 4), "auto", "holes"),
              ((6, 1, 7, 9), True, None, (6, 3), "auto", "holes"),
              ((6, 1, 7, 9), True, 5, (4, 4), "math", "left")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", RING_CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_ring_attention_with_a_key_mask_equals_sdpa(case):
    lengths = case[0]
    for rank, errors in enumerate(run_distributed(_ring_errors, len(lengths), *case,
                                                  timeout=300)):
        for name, err in errors.items():
            assert err < TOL, f"rank {rank}: {name} off by {err}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [((9, 14), True, None, (4, 2), "auto", "left"),
                                  ((5, 0, 8), False, 3, (4, 4), "auto", "holes")],
                         ids=["causal-gqa-left", "window-empty-chunk-holes"])
def test_ulysses_attention_with_a_key_mask_equals_sdpa(case):
    lengths = case[0]
    for rank, errors in enumerate(run_distributed(_ring_errors, len(lengths), *case, True, True,
                                                  timeout=300)):
        for name, err in errors.items():
            assert err < TOL, f"rank {rank}: {name} off by {err}"


def test_ring_attention_with_a_key_mask_one_rank():
    for kind in ("left", "right", "holes"):
        for kernel in ("auto", "math"):
            errors = _ring_errors((17,), True, None, (4, 2), kernel, kind, as_ints=True)
            assert max(errors.values()) < TOL, (kind, kernel, errors)


def test_padding_masks_only_the_pairs_across_its_edge():
    from tensorpar.context._blocks import Padding, Segment, blocks

    cpu = torch.device("cpu")
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[0, :3] = keep[1, :5] = False  # left padding, rows of different lengths
    keep[:, 10:] = False  # and both rows padded at the end
    padding = Padding(keep, cpu)
    # keys no row keeps: skipped; the pair's keys trimmed to those some row keeps
    assert blocks(Segment(6, 6), Segment(10, 2), False, None, cpu, padding) == []
    assert blocks(Segment(6, 6), Segment(0, 3), False, None, cpu, padding) == []
    [piece] = blocks(Segment(6, 4), Segment(1, 11), False, None, cpu, padding)
    assert (piece.q, piece.k) == (Segment(6, 4), Segment(3, 7))
    assert piece.mask.shape == (2, 1, 4, 7)  # row 1 still pads keys 3 and 4
    assert piece.mask[0].all() and piece.mask[1, :, :, 2:].all()
    assert not piece.mask[1, :, :, :2].any()
    # keys every row keeps: as without padding (no mask)
    [piece] = blocks(Segment(8, 2), Segment(5, 3), True, None, cpu, padding)
    assert piece.mask is None and piece.k == Segment(5, 3)


def _bad_key_mask(case):
    from tensorpar.errors import CollectiveArgumentError, CollectiveTypeError
    from tensorpar.nn import ring_attention

    rank = dist.get_rank()
    q = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    keep = torch.ones(2, 6, dtype=torch.bool)
    documents = None
    if case == "float" and rank == 1:
        keep = keep.double()
    elif case == "values" and rank == 0:
        keep = torch.full((2, 6), 2)
    elif case == "shape" and rank == 1:
        keep = torch.ones(1, 6, dtype=torch.bool)
    elif case == "length" and rank == 0:
        keep = torch.ones(2, 7, dtype=torch.bool)
    elif case == "disagree" and rank == 0:
        keep[1, 0] = False
    elif case == "ints against booleans":  # the same mask either way: accepted
        keep = keep.long() if rank == 0 else keep
    elif case == "with documents" and rank == 1:
        documents = torch.zeros(2, 6, dtype=torch.int64)
    try:
        out = ring_attention(q, q, q, is_causal=True, key_mask=keep, documents=documents)
    except (CollectiveArgumentError, CollectiveTypeError) as error:
        return str(error)
    return f"ran: {tuple(out.shape)}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case,words", [
    ("float", "booleans or 0/1"), ("values", "only 0 and 1"), ("shape", "(B, T)"),
    ("length", "positions"), ("disagree", "disagree"), ("with documents", "both"),
    ("ints against booleans", "ran")])
def test_bad_key_masks_refused_on_every_rank(case, words):
    for rank, message in enumerate(run_distributed(_bad_key_mask, 2, case, timeout=120)):
        assert words in message or (words != "ran" and "bad arguments" in message), \
            f"rank {rank}: {message}"


def padded_batch(seed, total, side):
    """Ids, labels (-100 at padding unless ``side`` ends in ``+labels``) and the mask."""
    ids, labels = batch(seed, total)
    mask = torch.ones_like(ids)
    if side.startswith("left"):  # rows of different lengths, padded before them
        mask[0, :total // 2 + 1], mask[1, :3] = 0, 0
    else:
        mask[0, total - total // 3:], mask[1, total - 2:] = 0, 0
    if not side.endswith("+labels"):
        labels = labels.masked_fill(mask == 0, -100)
    return ids, labels, mask


def _train_padded(arch, total, steps, side):
    """Loss, gradients, logits at every position, and parameters after AdamW steps."""
    from tensorpar.context.layout import positions, zigzag_layout
    from tensorpar.nn import context_parallel

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    dense, parallel = build(arch), context_parallel(build(arch))
    if arch.startswith("gemma"):  # eager attention gives NaN at a query with no key
        dense.config._attn_implementation = "sdpa"
    mine = positions(zigzag_layout(total, world), rank)
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(parallel.parameters(), lr=1e-3, eps=1e-6)
    history = []
    for step in range(steps):
        ids, labels, mask = padded_batch(step, total, side)
        want = dense(ids, labels=labels, attention_mask=mask)
        got = parallel(ids, labels=labels, attention_mask=mask)
        logits = (got.logits - want.logits[:, mine]).abs().max().item()
        errors = backward_errors(dense, parallel, want.loss, got.loss)
        history.append({**errors, "logits": logits})
        dense_opt.step(), opt.step(), dense_opt.zero_grad(), opt.zero_grad()
    params = dict(dense.named_parameters())
    drift = max(((p - params[n]).abs().max() / params[n].abs().max()).item()
                for n, p in parallel.named_parameters())
    return history, drift, rank


def _padding_matters(arch, total, side):
    """How far the dense logits with the mask are from those without (right padding changes
    only the padded positions' logits: a causal mask already hides them from the rest)."""
    model = build(arch)
    model.config._attn_implementation = "sdpa"
    ids, _, mask = padded_batch(0, total, side)
    return (model(ids, attention_mask=mask).logits - model(ids).logits).abs().max()


def _assert_trains_like_dense(results, steps, drift_tol=GRAD_TOL):
    for history, drift, rank in results:
        assert len(history) == steps
        for step, errors in enumerate(history):
            assert errors["loss"] < LOSS_TOL, f"rank {rank} step {step}: loss {errors['loss']}"
            assert errors["logits"] < GRAD_TOL, f"rank {rank} step {step}: {errors['logits']}"
            worst = max((v, k) for k, v in errors.items() if k not in ("loss", "logits"))
            assert worst[0] < GRAD_TOL, f"rank {rank} step {step}: {worst[1]} off by {worst[0]}"
        assert drift < drift_tol, f"rank {rank}: parameters after {steps} steps off by {drift}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world,arch,side", [(2, "llama", "left"), (3, "qwen3", "right"),
                                             (2, "mistral", "left+labels"),
                                             (3, "gemma3", "left"), (2, "gemma3", "right")])
def test_padded_batch_trains_like_dense(world, arch, side):
    assert _padding_matters(arch, 37, side) > 1e-4
    _assert_trains_like_dense(run_distributed(_train_padded, world, arch, 37, 3, side,
                                              timeout=600), 3, DRIFT_TOL.get(arch, GRAD_TOL))


def test_padded_batch_single_rank():
    _assert_trains_like_dense([_train_padded("llama", 19, 1, "right+labels")], 1)


def _bad_mask(case):
    from tensorpar.nn import context_parallel

    model = context_parallel(build("llama"))
    ids, labels = batch(0, 9)
    mask = {"halves": torch.full((2, 9), 0.5), "values": torch.full((2, 9), 2),
            "4-d": torch.ones(2, 1, 9, 9, dtype=torch.bool),
            "short": torch.ones(2, 8, dtype=torch.long)}[case]
    try:
        model(ids, labels=labels, attention_mask=mask)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("case,words", [("halves", "only 0 and 1"), ("values", "only 0 and 1"),
                                        ("4-d", "shaped as input_ids"),
                                        ("short", "shaped as input_ids")])
def test_context_parallel_refuses_masks_other_than_padding(case, words):
    message = _bad_mask(case)
    assert message is not None and words in message, message


def test_the_benchmarks_padded_compute_on_one_segment_is_the_rings_attention():
    """The benchmark's compute for the padded layer (kept queries against kept keys only).

    On one rank the kept queries are one span starting where the kept keys do: its one
    causal SDPA is the attention itself (where a span sees keys before it, the benchmark
    sums two pieces' arithmetic without merging them: the cost, not the values).
    """
    from tensorpar.bench.workloads.context import _attend, _padded_spans
    from tensorpar.comm._group import resolve_group
    from tensorpar.context._blocks import Padding
    from tensorpar.context._ring import RingSpec, ring_apply
    from tensorpar.context.layout import contiguous_layout

    total, padded = 23, 7
    layout = contiguous_layout([total])  # (one segment)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, total, 4, generator=g, dtype=torch.float64) for _ in range(3))
    keep = (torch.arange(total) >= padded).unsqueeze(0)
    spec = RingSpec(group=resolve_group(None, "test"), layout=layout, causal=True, window=None,
                    scale=0.5, kv_groups=1, visible=Padding(keep, q.device))
    spans = _padded_spans(layout, 0, padded)
    assert spans == [(padded, padded, total - padded, padded)]
    ideal = _attend(q * 0.5 * 4 ** 0.5, k, v, spans)  # SDPA scales 1/sqrt(D)
    assert (ring_apply(q, k, v, spec) - ideal).abs().max() < TOL


def _shorter_than_the_group(attention):
    from tensorpar.nn import context_parallel

    model = context_parallel(build("llama"), attention=attention)
    ids, labels = batch(0, 2)
    try:
        model(ids, labels=labels)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_a_sequence_shorter_than_the_group_is_refused_on_every_rank(attention):
    """A rank without a position would fail inside the model while its peers wait in the
    attention's exchange (they hung): every rank refuses it before communicating."""
    for rank, message in enumerate(run_distributed(_shorter_than_the_group, 3, attention,
                                                   timeout=120)):
        assert message is not None and "shorter than the group" in message, (rank, message)
