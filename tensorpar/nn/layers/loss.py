"""Cross entropy over logits whose vocabulary is split across a group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from tensorpar.collectives._split import check_sizes
from tensorpar.collectives.functional import all_gather, all_reduce
from tensorpar.collectives.regions import reduce_from_group
from tensorpar.comm._group import Group, GroupLike, resolve_group

__all__ = ["vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor, *,
                                 group: GroupLike = None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0,
                                 reduction: Literal["mean", "sum", "none"] = "mean",
                                 sizes: Sequence[int] | None = None) -> torch.Tensor:
    """``F.cross_entropy`` over logits split along the vocabulary, without gathering them.

    Each rank holds the logits of its slice of the vocabulary (the output of a
    ``ColumnParallelLinear`` with ``gather_output=False``). The log-sum-exp is shifted by
    the global maximum (numerically stable) and the partial sums travel in one all-reduce
    (plus one for the maximum). The inputs are not modified.

    Args:
        local_logits: ``(*, V_rank)``: this rank's slice of the logits.
        target: ``(*)``: class indices in ``[0, V)`` or ``ignore_index``.
        group: the tensor-parallel group the vocabulary is split over.
        ignore_index: targets with this value contribute nothing (and are not counted in
            the mean).
        label_smoothing: as in ``F.cross_entropy``.
        reduction: ``"mean"`` (over non-ignored targets), ``"sum"`` or ``"none"``.
        sizes: every rank's vocabulary slice length; exchanged once when not given.

    Returns:
        The loss, identical on every rank, in the dtype ``F.cross_entropy`` gives: float32
        under autocast, else the logits' (float16/bfloat16 logits are computed in float32).

    Raises:
        ValueError: bad ``reduction``/``label_smoothing``, or shapes that do not match.

    Shape:
        ``local_logits``: ``(N, V_rank)`` or ``(*, V_rank)``; ``target``: ``(N,)`` or ``(*)``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from tensorpar.nn import vocab_parallel_cross_entropy
        >>> logits, target = torch.randn(5, 11), torch.tensor([0, 3, 10, -100, 7])
        >>> loss = vocab_parallel_cross_entropy(logits, target)  # one rank: every class
        >>> torch.allclose(loss, F.cross_entropy(logits, target))
        True
    """
    fn = "vocab_parallel_cross_entropy"
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{fn}: reduction={reduction!r}; expected 'mean', 'sum' or 'none'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{fn}: label_smoothing={label_smoothing} must be in [0, 1]")
    if local_logits.shape[:-1] != target.shape:
        raise ValueError(f"{fn}: logits {tuple(local_logits.shape)} and target "
                         f"{tuple(target.shape)} disagree: expected target of shape "
                         f"{tuple(local_logits.shape[:-1])}")
    g = resolve_group(group, fn)
    if sizes is None:
        sizes = _exchange_sizes(local_logits, g)
    sizes = check_sizes(fn, sizes, g.size)
    start, vocab = sum(sizes[: g.rank]), sum(sizes)

    logits = local_logits.float() if local_logits.dtype in (torch.float16, torch.bfloat16) \
        else local_logits
    # the dtype F.cross_entropy returns: autocast runs it in float32, else the logits' dtype
    out_dtype = logits.dtype if torch.is_autocast_enabled(local_logits.device.type) \
        else local_logits.dtype
    local_max = logits.detach().amax(dim=-1) if logits.shape[-1] else \
        logits.new_full(logits.shape[:-1], float("-inf"))
    global_max = all_reduce(local_max, op="max", group=g)
    shifted = logits - global_max.unsqueeze(-1)

    ignored = target == ignore_index
    local_target = target - start
    mine = (local_target >= 0) & (local_target < logits.shape[-1]) & ~ignored
    index = local_target.masked_fill(~mine, 0).unsqueeze(-1)
    picked = shifted.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0) if logits.shape[-1] \
        else shifted.new_zeros(target.shape)
    # one all-reduce for the three partial sums: sum(exp), the target logit, sum(logits)
    parts = [shifted.exp().sum(-1), picked]
    if label_smoothing:
        parts.append(shifted.sum(-1))
    summed = reduce_from_group(torch.stack(parts), group=g)
    log_sum_exp = summed[0].log()
    loss = log_sum_exp - summed[1]
    if label_smoothing:
        smooth = log_sum_exp - summed[2] / vocab
        loss = (1 - label_smoothing) * loss + label_smoothing * smooth
    loss = loss.masked_fill(ignored, 0.0)
    if reduction == "none":
        return loss.to(out_dtype)
    total = loss.sum()
    if reduction == "sum":
        return total.to(out_dtype)
    return (total / (~ignored).sum()).to(out_dtype)


@torch.compiler.disable  # type: ignore[untyped-decorator]  # (a metadata exchange: one break)
def _exchange_sizes(local_logits: torch.Tensor, g: Group) -> tuple[int, ...]:
    if g.is_single:
        return (local_logits.shape[-1],)
    mine = torch.tensor([local_logits.shape[-1]], dtype=torch.int64,
                        device=g.comm_device(local_logits.device))
    every = all_gather(mine, group=g)
    return tuple(int(v) for v in every.tolist())
