"""Modules: model-parallel layers, plan-based parallelisation and the data-parallel wrapper."""

# The modules that were here before the packages stay attributes:
# ``from tensorpar.nn import linear`` works.
from tensorpar.context import (
    context_parallel,
    distributed_fft2,
    distributed_rfft2_apply,
    ring_attention,
    ulysses_attention,
)
from tensorpar.ddp import data_parallel as data_parallel
from tensorpar.ddp.data_parallel import DistributedDataParallel
from tensorpar.domain import (
    domain_layout,
    domain_mean,
    fully_shard_domain,
    halo_exchange,
    parallelize_domain,
)
from tensorpar.nn import convert as convert
from tensorpar.nn.convert import full_state_dict, load_full_state_dict, parallelize
from tensorpar.nn.experts import ExpertParallel, ParallelExperts
from tensorpar.nn.hf import checks as hf_checks  # noqa: F401
from tensorpar.nn.hf import experts as hf_experts  # noqa: F401
from tensorpar.nn.hf import mla as hf_mla  # noqa: F401
from tensorpar.nn.hf import plan as hf_plan  # noqa: F401
from tensorpar.nn.hf import sequence as hf_sequence  # noqa: F401
from tensorpar.nn.hf.plan import plan_from_transformers
from tensorpar.nn.layers import conv1d as conv1d
from tensorpar.nn.layers import embedding as embedding
from tensorpar.nn.layers import linear as linear
from tensorpar.nn.layers import loss as loss
from tensorpar.nn.layers import modules as modules
from tensorpar.nn.layers import random as random
from tensorpar.nn.layers.conv1d import ColumnParallelConv1D, RowParallelConv1D
from tensorpar.nn.layers.embedding import ParallelEmbedding, VocabParallelEmbedding
from tensorpar.nn.layers.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.nn.layers.loss import vocab_parallel_cross_entropy
from tensorpar.nn.layers.modules import Gather, Scatter
from tensorpar.nn.layers.random import ParallelRNG
from tensorpar.nn.plans import inplace_styles as inplace_styles
from tensorpar.nn.plans import plan as plan
from tensorpar.nn.plans import sequence_plan as sequence_plan
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
from tensorpar.nn.state import checkpoint as checkpoint
from tensorpar.nn.state import clip as clip
from tensorpar.nn.state import optim_checkpoint as optim_checkpoint
from tensorpar.nn.state import partial_grad as partial_grad
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
    "distributed_rfft2_apply",
    "domain_layout",
    "domain_mean",
    "fully_shard_domain",
    "halo_exchange",
    "parallelize_domain",
    "grad_norm",
]
