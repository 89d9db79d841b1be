"""Modules: model-parallel layers, plan-based parallelisation and the data-parallel wrapper."""

from tensorpar.context import (
    context_parallel,
    distributed_fft2,
    ring_attention,
    ulysses_attention,
)
from tensorpar.nn.clip import clip_grad_norm_, grad_norm
from tensorpar.nn.conv1d import ColumnParallelConv1D, RowParallelConv1D
from tensorpar.nn.convert import full_state_dict, load_full_state_dict, parallelize
from tensorpar.nn.data_parallel import DistributedDataParallel
from tensorpar.nn.embedding import ParallelEmbedding, VocabParallelEmbedding
from tensorpar.nn.experts import ExpertParallel, ParallelExperts
from tensorpar.nn.hf_plan import plan_from_transformers
from tensorpar.nn.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.nn.loss import vocab_parallel_cross_entropy
from tensorpar.nn.modules import Gather, Scatter
from tensorpar.nn.partial_grad import install_partial_grad
from tensorpar.nn.plan import (
    Builder,
    Colwise,
    EmbeddingDim,
    MlaKvAProj,
    PackedColwise,
    PartialGrad,
    Rowwise,
    SequenceGather,
    SequenceParallel,
    SequenceSplit,
    Vocab,
    match_module,
)
from tensorpar.nn.random import ParallelRNG

__all__ = [
    "Builder",
    "Colwise",
    "ColumnParallelConv1D",
    "ColumnParallelLinear",
    "DistributedDataParallel",
    "EmbeddingDim",
    "ExpertParallel",
    "Gather",
    "MlaKvAProj",
    "ParallelEmbedding",
    "ParallelExperts",
    "PackedColwise",
    "PartialGrad",
    "ParallelRNG",
    "RowParallelConv1D",
    "RowParallelLinear",
    "Rowwise",
    "Scatter",
    "SequenceGather",
    "SequenceParallel",
    "SequenceSplit",
    "Vocab",
    "VocabParallelEmbedding",
    "full_state_dict",
    "install_partial_grad",
    "load_full_state_dict",
    "match_module",
    "parallelize",
    "plan_from_transformers",
    "ring_attention",
    "ulysses_attention",
    "vocab_parallel_cross_entropy",
    "clip_grad_norm_",
    "context_parallel",
    "distributed_fft2",
    "grad_norm",
]
