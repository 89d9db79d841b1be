"""Context parallelism: a sequence split over the ranks of a group.

`ring_attention` computes exact attention over the whole sequence from each rank's chunk;
`context_parallel` makes a transformers decoder LM keep only its rank's share of the
sequence from the embedding on. Both are exported from `tensorpar.nn`.
"""

from tensorpar.context.attention import ring_attention
from tensorpar.context.hf import context_parallel

__all__ = ["context_parallel", "ring_attention"]
