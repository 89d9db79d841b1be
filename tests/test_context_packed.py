"""context_parallel with packed sequences: documents of one row never see each other.

A row of several documents carries ``position_ids`` that restart (transformers' packed
format, which its own masks turn into one causal block per document). Each rank sees the
whole ``position_ids``, so it knows every position's document without communication; ring
attention then masks keys of other documents. Loss, every gradient and three AdamW steps
equal dense (float32 rounding, as in ``test_context_parallel``).
"""

import pytest
import torch
import torch.distributed as dist

from tensorpar.nn import context_parallel
from tensorpar.testing import run_distributed
from tests.test_context_parallel import (
    ARCHS,
    GRAD_TOL,
    _assert_close,
    backward_errors,
    batch,
    build,
)

pytest.importorskip("transformers")

# AdamW's first steps move an element by about lr * g / (|g| + eps): where |g| is near eps,
# float32 rounding of g (Gemma's norms compute in float32: 2e-8 absolute here, packed or
# not) changes the step by a good part of lr. With the default eps (1e-8) Gemma3's second
# step's gradients came out 2.4e-4 off dense; with 1e-6, 3.6e-6, and its parameters after
# three steps 1.2e-5 of each tensor's largest entry (the bar below). A wrong mask puts the
# first step's gradients 1e-3 off.
EPS = 1e-6
DRIFT_TOL = {"gemma3": 5e-5}


def packed_positions(total, lengths, start=0):
    """Positions of a row of documents of ``lengths`` (the last one fills the row)."""
    out, at = [], 0
    for n in lengths:
        n = min(n, total - at)
        out += list(range(start, start + n))
        at += n
    return out + list(range(start, start + total - at))


def packed_batch(seed, total):
    ids, labels = batch(seed, total)
    rows = [packed_positions(total, [9, 23, 4, 1, 11]),  # documents across the chunk cuts
            packed_positions(total, [total // 2], start=3)]  # positions need not start at 0
    return ids, labels, torch.tensor(rows)


def _errors(dense, parallel, ids, labels, position_ids, mask):
    # without a cache, as training runs: with one transformers attends across documents
    extra = {"position_ids": position_ids, "use_cache": False}
    if mask:
        extra["attention_mask"] = torch.ones_like(ids)
    return backward_errors(dense, parallel, dense(ids, labels=labels, **extra).loss,
                           parallel(ids, labels=labels, **extra).loss)


def _train(arch, total, steps, mask=False):
    dense, parallel = build(arch), context_parallel(build(arch))
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=1e-3, eps=EPS)
    opt = torch.optim.AdamW(parallel.parameters(), lr=1e-3, eps=EPS)
    history = []
    for step in range(steps):
        history.append(_errors(dense, parallel, *packed_batch(step, total), mask))
        dense_opt.step(), opt.step(), dense_opt.zero_grad(), opt.zero_grad()
    dense_params = dict(dense.named_parameters())
    drift = max(((p - dense_params[n]).abs().max() / dense_params[n].abs().max()).item()
                for n, p in parallel.named_parameters())
    return history, drift, dist.get_rank() if dist.is_initialized() else 0


def _packing_matters(arch, total):
    """How far the dense logits with documents masked apart are from those without."""
    model = build(arch)
    ids, _, positions = packed_batch(0, total)
    packed = model(ids, position_ids=positions, use_cache=False).logits
    return (packed - model(ids, position_ids=positions).logits).abs().max().item()




@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_packed_trains_like_dense(arch, world):
    assert _packing_matters(arch, 61) > 1e-4
    _assert_close(run_distributed(_train, world, arch, 61, 3, timeout=600), 3,
                  drift_tol=DRIFT_TOL.get(arch, GRAD_TOL))


@pytest.mark.timeout(900)
def test_packed_with_all_ones_mask_four_ranks():
    """An all-ones mask beside packed positions: transformers then attends across the
    documents, and so does context_parallel."""
    _assert_close(run_distributed(_train, 4, "llama", 13, 1, True, timeout=600), 1)


def test_packed_single_rank():
    _assert_close([_train("qwen3", 17, 1)], 1)


def _documents_of(total, batch, seed, same_rows=False):
    """Nondecreasing document ids per row, with runs of 1 and ids that need not start at 0."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        if not same_rows or b == 0:
            starts = torch.rand(total, generator=g) < 0.2
            starts[0] = False
        rows.append((starts.cumsum(0) * (b + 1) + 5 * b).tolist())
    return torch.tensor(rows)


def _ring_errors(lengths, causal, window=None, heads=(4, 4), kernel="auto", pass_lengths=False,
                 documents_kind="rows differ", ulysses=False):
    """This rank's output and q/k/v gradients against SDPA with the documents' mask.

    ``documents_kind``: each row its own documents, the ``"same rows"`` (the batch planned
    as one), or ``"masked"``: pieces capped at 2, so the pairs a boundary crosses run as
    one masked block instead. ``ulysses``: `ulysses_attention` instead.
    """
    import torch.nn.functional as F

    from tensorpar.context import _blocks
    from tensorpar.nn import ring_attention, ulysses_attention
    from tests.test_ring_attention import chunk_errors, dense_mask

    rank = dist.get_rank() if dist.is_initialized() else 0
    total, batch_size, dim = sum(lengths), 2, 5
    attention = ulysses_attention if ulysses else ring_attention
    documents = _documents_of(total, batch_size, seed=3, same_rows=documents_kind == "same rows")
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(batch_size, h, total, dim, generator=g, dtype=torch.float64)
               for h in (heads[0], heads[1], heads[1]))
    dout = torch.randn(batch_size, heads[0], total, dim, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = dense_mask(total, causal, window) & (documents[:, :, None] == documents[:, None, :])
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=mask.unsqueeze(1),
                                         enable_gqa=heads[0] != heads[1])
    ref.backward(dout)
    start = sum(lengths[:rank])
    mine = slice(start, start + lengths[rank])
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    fused, cap = _blocks._fused, _blocks.MAX_PIECES
    if kernel == "math":
        _blocks._fused = lambda t: False
    if documents_kind == "masked":
        _blocks.MAX_PIECES = 2
    try:
        out = attention(*local, is_causal=causal, window=window, documents=documents,
                        enable_gqa=heads[0] != heads[1],
                        lengths=list(lengths) if pass_lengths else None)
        out.backward(dout[:, :, mine])
    finally:
        _blocks._fused, _blocks.MAX_PIECES = fused, cap
    return chunk_errors(out, ref, local, leaves, mine)


RING_CASES = [((9, 14), True, None, (4, 4), "auto", False, "rows differ"),
              ((9, 14), False, None, (4, 2), "math", True, "same rows"),
              ((9, 14), True, 4, (4, 4), "auto", False, "masked"),
              ((9, 14), False, None, (4, 2), "math", False, "masked"),
              ((5, 0, 8), True, 4, (4, 2), "auto", False, "same rows"),
              ((5, 0, 8), False, 3, (4, 4), "math", False, "rows differ"),
              ((6, 1, 7, 9), True, None, (6, 3), "auto", True, "rows differ")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", RING_CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", "_"))
def test_ring_attention_with_documents_equals_sdpa(case):
    lengths = case[0]
    for rank, errors in enumerate(run_distributed(_ring_errors, len(lengths), *case,
                                                  timeout=300)):
        for name, err in errors.items():
            assert err < 1e-10, f"rank {rank}: {name} off by {err}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [((9, 14), True, None, (4, 2), "auto", False, "rows differ"),
                                  ((5, 0, 8), False, 3, (4, 4), "auto", True, "same rows")],
                         ids=["causal-gqa", "window-empty-chunk"])
def test_ulysses_attention_with_documents_equals_sdpa(case):
    lengths = case[0]
    for rank, errors in enumerate(run_distributed(_ring_errors, len(lengths), *case, True,
                                                  timeout=300)):
        for name, err in errors.items():
            assert err < 1e-10, f"rank {rank}: {name} off by {err}"


def test_ring_attention_with_documents_one_rank():
    for causal in (False, True):
        for kind in ("rows differ", "same rows", "masked"):
            errors = _ring_errors((11,), causal, 3, documents_kind=kind)
            assert max(errors.values()) < 1e-10, (causal, kind, errors)


def test_pieces_follow_the_documents():
    """A pair of segments runs as one block per shared document (none across documents)."""
    from tensorpar.context._blocks import CAUSAL, Documents, Segment, blocks

    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3]])
    documents = Documents(ids, torch.device("cpu"))
    diagonal = blocks(Segment(2, 6), Segment(2, 6), True, None, torch.device("cpu"), documents)
    assert [(p.q, p.k) for p in diagonal] == [
        (Segment(2, 1), Segment(2, 1)), (Segment(3, 2), Segment(3, 2)),
        (Segment(5, 3), Segment(5, 3))]
    assert [p.mask for p in diagonal] == [None, CAUSAL, CAUSAL]  # one position: no mask
    earlier = blocks(Segment(6, 4), Segment(0, 6), True, None, torch.device("cpu"), documents)
    assert [(p.q, p.k, p.mask) for p in earlier] == [(Segment(6, 3), Segment(5, 1), None)]
    assert blocks(Segment(9, 1), Segment(0, 5), True, None, torch.device("cpu"),
                  documents) == []


def _bad_documents(case):
    from tensorpar.errors import CollectiveArgumentError, CollectiveTypeError
    from tensorpar.nn import ring_attention

    rank = dist.get_rank()
    q = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    documents = torch.zeros(2, 6, dtype=torch.int64)
    if case == "decreasing" and rank == 1:
        documents[1, 4] = -1
    elif case == "length" and rank == 0:
        documents = torch.zeros(2, 5, dtype=torch.int64)
    elif case == "float" and rank == 1:
        documents = documents.double()
    elif case == "disagree" and rank == 0:
        documents[0, 5] = 1
    elif case == "same sum":  # two splits whose position-weighted id sums agree (26)
        documents[0] = torch.tensor([0, 0, 0, 1, 2, 2] if rank == 0 else [0, 1, 1, 1, 1, 2])
    elif case == "unsigned" and rank == 1:
        documents = torch.tensor([[0, 1, 0, 0, 0, 0]] * 2, dtype=torch.uint8)
    try:
        ring_attention(q, q, q, is_causal=True, documents=documents)
    except (CollectiveArgumentError, CollectiveTypeError) as error:
        return str(error)
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case,words", [("decreasing", "decrease"), ("length", "positions"),
                                        ("float", "integers"), ("disagree", "disagree"),
                                        ("same sum", "disagree"), ("unsigned", "decrease")])
def test_bad_documents_refused_on_every_rank(case, words):
    for rank, message in enumerate(run_distributed(_bad_documents, 2, case, timeout=120)):
        assert message is not None, f"rank {rank} did not raise"
        assert words in message or "bad arguments" in message, message


def _cache_or_checkpointing(arch, setting):
    """Packed positions where transformers' rule depends on the cache: both sides the same."""
    dense, parallel = build(arch), context_parallel(build(arch))
    if setting == "checkpointing":  # the config's cache, switched off by checkpointing
        for model in (dense, parallel):
            model.gradient_checkpointing_enable()
            model.train()
    ids, labels, positions = packed_batch(0, 29)
    inputs = {"labels": labels, "position_ids": positions}
    errors = backward_errors(dense, parallel, dense(ids, **inputs).loss,
                             parallel(ids, **inputs).loss)
    return [errors], 0.0, dist.get_rank()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("setting", ["cache", "checkpointing"])
def test_packed_follows_transformers_cache_rule(setting):
    """With the config's cache on, transformers attends across the documents (so does
    context_parallel); gradient checkpointing in training switches the cache off, and the
    documents are masked apart on both sides."""
    _assert_close(run_distributed(_cache_or_checkpointing, 2, "llama", setting, timeout=300), 1)


def _two_forwards_then_backward(arch, total):
    """Under gradient checkpointing: a packed forward, an unpacked one, one backward of both.

    The recompute of the first forward's attention must use the first call's documents,
    not the documents of the forward that ran last.
    """
    dense, parallel = build(arch), context_parallel(build(arch))
    for model in (dense, parallel):
        model.gradient_checkpointing_enable()
        model.train()
    ids, labels, positions = packed_batch(0, total)
    other_ids, other_labels = batch(1, total)

    def both(model):
        return model(ids, labels=labels, position_ids=positions).loss + \
            model(other_ids, labels=other_labels).loss

    errors = backward_errors(dense, parallel, both(dense), both(parallel))
    return [errors], 0.0, dist.get_rank() if dist.is_initialized() else 0


@pytest.mark.timeout(600)
def test_checkpoint_recompute_uses_its_own_call():
    _assert_close(run_distributed(_two_forwards_then_backward, 2, "llama", 29, timeout=300), 1)
    _assert_close([_two_forwards_then_backward("qwen3", 17)], 1)
