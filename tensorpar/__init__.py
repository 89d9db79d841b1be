"""tensorpar: placeholder-aware, autograd-safe collectives for model-parallel PyTorch."""

# The modules that were here before the packages stay attributes:
# ``from tensorpar import functional`` works.
from tensorpar import nn as nn
from tensorpar.collaborative import CollaborativeTensor, sync_collectives
from tensorpar.collectives import functional as functional
from tensorpar.collectives import regions as regions
from tensorpar.collectives.functional import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from tensorpar.collectives.regions import (
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    split_to_group,
)
from tensorpar.comm._comm import CollectiveRecord, CommCounter
from tensorpar.ddp import reducer as reducer
from tensorpar.ddp.reducer import BucketedAllReduce
from tensorpar.errors import (
    CollectiveArgumentError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CollectiveTypeError,
    PeerLostError,
    PlaceholderError,
    ReducerError,
    TensorparError,
    UnresolvedCollectiveError,
    WireFormatError,
)
from tensorpar.hierarchical import topology as topology
from tensorpar.hierarchical.topology import Topology
from tensorpar.launch import init_distributed
from tensorpar.nn.convert import full_state_dict, load_full_state_dict, parallelize
from tensorpar.nn.state.checkpoint import load_sharded_state_dict, sharded_state_dict
from tensorpar.nn.state.optim_checkpoint import (
    load_sharded_optimizer_state_dict,
    sharded_optimizer_state_dict,
)
from tensorpar.placeholder import TensorPlaceholder, is_placeholder
from tensorpar.validation import validation, validation_enabled

__version__ = "0.1.0"

__all__ = [
    "BucketedAllReduce",
    "CollaborativeTensor",
    "CollectiveArgumentError",
    "CollectiveMismatchError",
    "CollectiveRecord",
    "CollectiveTimeoutError",
    "CollectiveTypeError",
    "CommCounter",
    "PeerLostError",
    "PlaceholderError",
    "ReducerError",
    "TensorPlaceholder",
    "TensorparError",
    "Topology",
    "UnresolvedCollectiveError",
    "WireFormatError",
    "__version__",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "copy_to_group",
    "full_state_dict",
    "gather",
    "gather_from_group",
    "init_distributed",
    "is_placeholder",
    "load_full_state_dict",
    "load_sharded_state_dict",
    "parallelize",
    "reduce",
    "reduce_from_group",
    "reduce_scatter",
    "scatter",
    "sharded_state_dict",
    "split_to_group",
    "sync_collectives",
    "validation",
    "validation_enabled",
    "load_sharded_optimizer_state_dict",
    "sharded_optimizer_state_dict",
]
