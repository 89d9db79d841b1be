"""Context parallelism: a sequence split over the ranks of a group.

`ring_attention` computes exact attention over the whole sequence from each rank's chunk
(`ulysses_attention`: the same by two all-to-alls);
`context_parallel` makes a transformers decoder LM keep only its rank's share of the
sequence from the embedding on; `distributed_fft2` is a 2-D FFT of a field split along one
dim, and `distributed_rfft2_apply` a map of a real field's spectrum (a spectral
convolution). All are exported from `tensorpar.nn`.
"""

from tensorpar.context.attention import ring_attention
from tensorpar.context.fft import distributed_fft2, distributed_rfft2_apply
from tensorpar.context.hf import context_parallel
from tensorpar.context.ulysses import ulysses_attention

__all__ = ["context_parallel", "distributed_fft2", "distributed_rfft2_apply",
           "ring_attention", "ulysses_attention"]
