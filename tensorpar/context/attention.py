"""``ring_attention``: exact attention over a sequence split across the ranks of a group."""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from typing import Any, cast

import torch

from tensorpar.collectives.functional import all_gather
from tensorpar.comm._group import Group, GroupLike, resolve_group
from tensorpar.context._autocast import as_sdpa_under_autocast
from tensorpar.context._blocks import Documents, Padding, Segment
from tensorpar.context._ring import RingSpec, ring_apply
from tensorpar.errors import CollectiveArgumentError, CollectiveTypeError
from tensorpar.validation import validation_enabled
from tensorpar.validation.calls import code_of

__all__ = ["agreed_lengths", "ring_attention"]

_FN = "ring_attention"
# one row per rank: [ok, T, B, H, Hkv, D, Dv, causal, window + 1, dtype code,
# the length of the documents or key mask + 1 (0: none), a fingerprint of them,
# the function called, scale given, the scale's bits, the lengths passed (0: none)]
_META = 16
_FUNCTIONS = ("ring_attention", "ulysses_attention")


class _WrongType(str):
    """A problem with an argument's type (raised as `CollectiveTypeError`)."""


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                   group: GroupLike = None, scale: float | None = None, enable_gqa: bool = False,
                   window: int | None = None, lengths: Sequence[int] | None = None,
                   documents: torch.Tensor | None = None,
                   key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention over a sequence split in contiguous chunks over ``group``.

    Rank ``r`` (a rank within ``group``) holds the ``r``-th chunk of the sequence's queries,
    keys and values; chunks may have any length, 0 included. The result is this rank's
    chunk of ``torch.nn.functional.scaled_dot_product_attention`` over the whole sequence,
    with the causal mask (and the window) following *global* positions; under autocast,
    in its dtype, as SDPA. The key/value chunks
    travel the ring by point-to-point messages while the current block computes; partial
    results are merged with their log-sum-exp (online softmax), so no rank ever holds the
    whole key/value sequence.

    Forward: ring pass of the key/value chunks. Backward: the same ring again, each chunk's
    key/value gradient travelling with it and returning to its owner; the query gradient
    stays local. (Not twice differentiable.)

    Args:
        q: this rank's queries.
        k: this rank's keys.
        v: this rank's values.
        is_causal: each position attends to itself and earlier *global* positions.
        group: the context-parallel group (``None``: the default group, resolved at call
            time).
        scale: the logits' factor (``None``: ``1 / sqrt(D)``, as SDPA).
        enable_gqa: allow fewer key/value heads than query heads (grouped-query attention:
            query head ``h`` uses key/value head ``h // (H / Hkv)``, as SDPA). The key/value
            heads travel unrepeated and are repeated on arrival.
        window: a sliding window: with ``is_causal`` a position sees the ``window`` positions
            ending at itself (``0 <= q_pos - k_pos < window``, transformers' convention);
            without, those with ``|q_pos - k_pos| < window``.
        lengths: every rank's chunk length, the same list on every rank, to skip the one
            small exchange that learns them (and checks that the ranks agree). Given on
            every rank or on none; lengths that are wrong on a rank, or given on some ranks
            only, are not detected (a hang, garbage, or the backend aborting the process)
            unless validation mode (`tensorpar.validation`) is on: the exchange then runs
            anyway and compares them.
        documents: packed sequences: each position's document over the *whole* sequence,
            ``(B, T)`` integers that never decrease along a row, the same on every rank (a
            query sees keys of its own document only, within the causal mask and the
            window). Blocks of keys in other documents are skipped, as the causal ones.
        key_mask: padding: which keys take part, ``(B, T)`` booleans (or 0/1 integers, as
            transformers' ``attention_mask``) over the *whole* sequence, the same on every
            rank. A key where it is False is hidden from every query; a query that sees no
            key at all gets a zero output (as SDPA gives it) and no gradient. Only the blocks
            across the padding's edge build a mask. Not with ``documents`` (a padded packed
            row's padding can be a document of its own).

    Returns:
        This rank's chunk of the attention output.

    Raises:
        CollectiveTypeError: an argument of the wrong type (every rank, after the exchange).
        CollectiveArgumentError: shapes, head counts, dtypes, ``is_causal``, ``window`` or
            ``scale`` that are inconsistent on a rank or differ between the ranks, or ranks
            calling another attention function (`ulysses_attention`) with it (raised on
            every rank); ``lengths`` malformed or disagreeing with this rank's chunk;
            ``documents`` or ``key_mask`` of another shape than ``(B, T)``, documents
            decreasing along a row, a key mask of values other than 0 and 1, either
            differing between the ranks (checked by the exchange; with ``lengths`` given,
            only this rank's own checks run), or both given.

    Shape:
        ``q``: ``(B, H, T_r, D)``; ``k``: ``(B, Hkv, T_r, D)``; ``v``: ``(B, Hkv, T_r, Dv)``;
        output: ``(B, H, T_r, Dv)``, where ``T_r`` is this rank's chunk length.

    Example:
        >>> import torch
        >>> from tensorpar.nn import ring_attention
        >>> q = k = v = torch.ones(1, 2, 3, 4)
        >>> ring_attention(q, k, v, is_causal=True).shape  # one rank: plain attention
        torch.Size([1, 2, 3, 4])
    """
    g = resolve_group(group, _FN)
    q, k, v, plain = as_sdpa_under_autocast(q, k, v)
    lengths = agreed_lengths(q, k, v, is_causal, scale, enable_gqa, window, lengths, documents,
                             g, _FN, key_mask)
    offsets = [sum(lengths[:r]) for r in range(g.size)]
    layout = tuple((Segment(offsets[r], lengths[r]),) for r in range(g.size))
    visible = Documents(documents, q.device) if documents is not None else \
        Padding(key_mask, q.device) if key_mask is not None else None
    with plain:
        return ring_apply(q, k, v, RingSpec(
            group=g, layout=layout, causal=is_causal, window=window,
            scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale),
            kv_groups=q.shape[1] // k.shape[1], visible=visible))


def agreed_lengths(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   scale: float | None, enable_gqa: bool, window: int | None,
                   lengths: Sequence[int] | None, documents: torch.Tensor | None, g: Group,
                   fn: str, key_mask: torch.Tensor | None = None) -> list[int]:
    """Every rank's chunk length, once the arguments are checked.

    Checked on every rank by the exchange, or on this rank only where ``lengths`` is given
    (validation mode: by the exchange, and ``lengths`` compared with it).
    """
    problem = _local_problem(q, k, v, is_causal, scale, enable_gqa, window) or \
        _documents_problem(documents, q) or _key_mask_problem(key_mask, documents, q)
    whole = documents if documents is not None else key_mask
    if lengths is not None:
        problem = problem or _check_lengths(lengths, g.size, g.rank, q)
    if lengths is None or validation_enabled():  # (validating: lengths given are compared)
        every: list[int] = _exchange(q, k, v, is_causal, window, problem, g.size, group=g,
                                     fn=fn, documents=documents, key_mask=key_mask,
                                     scale=scale, given=lengths)
        return every
    if not problem and whole is not None and whole.shape[1] != sum(lengths):
        problem = (f"{_whole_name(documents)} cover {whole.shape[1]} positions but the chunks "
                   f"{list(lengths)} make {sum(lengths)}")
    if problem:
        raise _error(problem, fn)
    return list(lengths)


def _documents_problem(documents: object, q: torch.Tensor) -> str | None:
    """What is wrong with ``documents`` on this rank (its length is checked later)."""
    if documents is None:
        return None
    if not isinstance(documents, torch.Tensor) or documents.is_floating_point() or \
            documents.is_complex() or documents.dtype == torch.bool:
        got = documents.dtype if isinstance(documents, torch.Tensor) else type(documents).__name__
        return _WrongType(f"documents must be a torch.Tensor of integers, got {got}")
    if documents.ndim != 2 or documents.shape[0] != q.shape[0]:
        return (f"documents must be (B, T) with B = {q.shape[0]} (q's batch), got shape "
                f"{tuple(documents.shape)}")
    if documents.shape[1] and not bool((documents.to(torch.int64).diff(dim=-1) >= 0).all()):
        return "documents must not decrease along a row (each document one run of positions)"
    return None


def _key_mask_problem(key_mask: object, documents: object, q: torch.Tensor) -> str | None:
    """What is wrong with ``key_mask`` on this rank (its length is checked later)."""
    if key_mask is None:
        return None
    if documents is not None:
        return ("documents and key_mask cannot both be given (a padded packed row's padding "
                "can be a document of its own)")
    if not isinstance(key_mask, torch.Tensor) or key_mask.is_floating_point() or \
            key_mask.is_complex():
        got = key_mask.dtype if isinstance(key_mask, torch.Tensor) else type(key_mask).__name__
        return _WrongType(f"key_mask must be a torch.Tensor of booleans or 0/1 integers, "
                          f"got {got}")
    if key_mask.ndim != 2 or key_mask.shape[0] != q.shape[0]:
        return (f"key_mask must be (B, T) with B = {q.shape[0]} (q's batch), got shape "
                f"{tuple(key_mask.shape)}")
    if key_mask.dtype != torch.bool and not bool(((key_mask == 0) | (key_mask == 1)).all()):
        return "key_mask must hold only 0 and 1 (1: the key takes part)"
    return None


def _whole_name(documents: torch.Tensor | None) -> str:
    return "documents" if documents is not None else "key_mask"


def _fingerprint(whole: torch.Tensor, documents: bool) -> int:
    """A hash of where the documents start, or of the key mask: alike where they mask alike.

    Document ids themselves do not count (the same split under other ids masks the same).
    """
    ids = whole.to("cpu", torch.int64)
    marks = ids.diff(dim=-1).ne(0) if documents else ids.ne(0)
    return digest(marks, b"documents" if documents else b"key_mask")


def digest(x: Any, tag: bytes = b"") -> int:
    """A 56-bit hash (it fits an int64) of ``tag`` and a tensor's shape and values.

    A number hashes as a 0-d tensor; ``None`` is 0. Values, not their dtype: integers hash
    as int64, floats as float64 (``input_ids`` of int32 on one rank and int64 on another
    are the same tokens).
    """
    if x is None:
        return 0
    data = torch.as_tensor(x).detach().to("cpu")
    wide = torch.float64 if data.is_floating_point() else \
        torch.complex128 if data.is_complex() else torch.int64
    data = data.to(wide).contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    hashed = hashlib.blake2b(tag + repr(tuple(data.shape)).encode() + raw,
                             digest_size=7).digest()
    return int.from_bytes(hashed, "little") | 1 << 56


def _local_problem(q: object, k: object, v: object, is_causal: object, scale: object,
                   enable_gqa: bool, window: object) -> str | None:
    """What is wrong with this rank's arguments, or ``None``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return _WrongType(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            return f"{name} must be 4-D (B, heads, T, D), got shape {tuple(t.shape)}"
    q, k, v = cast(torch.Tensor, q), cast(torch.Tensor, k), cast(torch.Tensor, v)
    if not q.is_floating_point() or q.dtype != k.dtype or q.dtype != v.dtype:
        return f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[2] != k.shape[2]:
        return (f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must agree in "
                f"batch and length, and k and v in heads")
    if q.shape[-1] != k.shape[-1]:
        return f"q's head dim {q.shape[-1]} differs from k's {k.shape[-1]}"
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv and not (enable_gqa and hkv > 0 and hq % hkv == 0):
        expected = "a divisor of q's" if enable_gqa else "q's (or pass enable_gqa=True)"
        return f"k and v have {hkv} heads and q has {hq}; expected {expected}"
    if not isinstance(is_causal, bool):
        return _WrongType(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        return _WrongType(f"window must be None or an int >= 1, got {window!r}")
    if window is not None and window < 1:
        return f"window must be None or an int >= 1, got {window!r}"
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        return _WrongType(f"scale must be None or a float, got {type(scale).__name__}")
    return None


def _check_lengths(lengths: object, size: int, rank: int, q: torch.Tensor) -> str | None:
    if not isinstance(lengths, Sequence) or len(lengths) != size or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lengths):
        return f"lengths must be {size} ints >= 0 (one per rank), got {lengths!r}"
    if lengths[rank] != q.shape[2]:
        return f"lengths[{rank}]={lengths[rank]} but this rank's chunk has length {q.shape[2]}"
    return None


_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@torch.compiler.disable  # type: ignore[untyped-decorator]  # (the ranks' data: one break)
def _exchange(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
              window: int | None, problem: str | None, size: int, group: Group,
              fn: str = _FN,
              documents: torch.Tensor | None = None,
              key_mask: torch.Tensor | None = None, scale: float | None = None,
              given: Sequence[int] | None = None) -> list[int]:
    """All-gather every rank's chunk length and shapes; raise on every rank if any disagree.

    ``documents`` or ``key_mask`` (checked by `_documents_problem` and `_key_mask_problem`):
    their length must be the whole sequence's, and every rank's the same. ``given``: the
    lengths this rank was passed (validation mode), compared with every rank's and with the
    chunks.
    """
    whole = documents if documents is not None else key_mask
    name = _whole_name(documents)
    row = [0] * _META
    if problem is None:
        code = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else len(_DTYPES)
        row = [1, q.shape[2], q.shape[0], q.shape[1], k.shape[1], q.shape[3], v.shape[3],
               int(is_causal), 0 if window is None else window + 1, code,
               0 if whole is None else whole.shape[1] + 1,
               0 if whole is None else _fingerprint(whole, documents is not None),
               _FUNCTIONS.index(fn),
               int(scale is not None), 0 if scale is None else _bits(float(scale)),
               0 if given is None else code_of(tuple(given))]
    if size == 1:
        if problem is None and whole is not None and whole.shape[1] != q.shape[2]:
            problem = f"{name} cover {whole.shape[1]} positions but the sequence has {q.shape[2]}"
        if problem is not None:
            raise _error(problem, fn)
        return [q.shape[2]]
    device = group.comm_device(q.device)
    meta = all_gather(torch.tensor([row], dtype=torch.int64, device=device), group=group,
                      sizes=[1] * size).tolist()
    if problem is not None:
        raise _error(problem, fn)
    bad = [r for r, m in enumerate(meta) if not m[0]]
    if bad:
        raise CollectiveArgumentError(f"{fn}: rank(s) {bad} of the group got bad arguments "
                                      f"(their own error says which)")
    total = sum(m[1] for m in meta)
    short = [(r, m[10] - 1) for r, m in enumerate(meta) if m[10] and m[10] - 1 != total]
    if short:
        raise CollectiveArgumentError(
            f"{fn}: the {name} given on rank(s) {[r for r, _ in short]} cover "
            f"{[n for _, n in short]} positions but the chunks {[m[1] for m in meta]} make "
            f"{total}")
    names = ["", "", "batch", "query heads", "key/value heads", "head dim", "value head dim",
             "is_causal", "window + 1", "dtype", "documents or key_mask (given or not)",
             "documents or key_mask (a fingerprint of their values)", "function called",
             "scale (given or not)", "scale", "lengths passed (a hash; 0: not passed)"]
    for i in range(2, _META):
        values = [m[i] for m in meta] if i != 10 else [bool(m[i]) for m in meta]
        if len(set(values)) > 1:
            shown = [_FUNCTIONS[v] for v in values] if i == 12 else \
                [_float(v) for v in values] if i == 14 else values
            raise CollectiveArgumentError(f"{fn}: the ranks disagree on the {names[i]}: "
                                          f"{shown} (rank order); expected one value")
    chunks = [m[1] for m in meta]
    if given is not None and list(given) != chunks:
        raise CollectiveArgumentError(f"{fn}: lengths={list(given)} were passed but the ranks' "
                                      f"chunks are {chunks} (rank order)")
    return chunks


def _bits(x: float) -> int:
    """A float's bits as an int64 (exact: compared, then shown as the float again)."""
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def _float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def _error(problem: str, fn: str = _FN) -> Exception:
    cls = CollectiveTypeError if isinstance(problem, _WrongType) else CollectiveArgumentError
    return cls(f"{fn}: {problem}")
