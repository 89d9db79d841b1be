"""Modules: model-parallel layers, plan-based parallelisation and the data-parallel wrapper."""

from tensorpar.context import (
    context_parallel,
    distributed_fft2,
    ring_attention,
    ulysses_attention,
)
from tensorpar.ddp.data_parallel import DistributedDataParallel
from tensorpar.domain import domain_layout, domain_mean, halo_exchange, parallelize_domain
from tensorpar.nn.experts import ExpertParallel, ParallelExperts
from tensorpar.nn.hf.plan import plan_from_transformers
from tensorpar.nn.layers.conv1d import ColumnParallelConv1D, RowParallelConv1D
from tensorpar.nn.layers.embedding import ParallelEmbedding, VocabParallelEmbedding
from tensorpar.nn.layers.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.nn.layers.loss import vocab_parallel_cross_entropy
from tensorpar.nn.layers.modules import Gather, Scatter
from tensorpar.nn.layers.random import ParallelRNG
from tensorpar.nn.plans.convert import full_state_dict, load_full_state_dict, parallelize
from tensorpar.nn.plans.plan import (
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
from tensorpar.nn.state.clip import clip_grad_norm_, grad_norm
from tensorpar.nn.state.partial_grad import install_partial_grad
from tensorpar.pipeline import Pipeline, pipeline

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
    "Pipeline",
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
    "pipeline",
    "plan_from_transformers",
    "ring_attention",
    "ulysses_attention",
    "vocab_parallel_cross_entropy",
    "clip_grad_norm_",
    "context_parallel",
    "distributed_fft2",
    "domain_layout",
    "domain_mean",
    "halo_exchange",
    "parallelize_domain",
    "grad_norm",
]
