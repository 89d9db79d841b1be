"""tensorpar: placeholder-aware, autograd-safe collectives for model-parallel PyTorch."""

from tensorpar._comm import CollectiveRecord, CommCounter
from tensorpar.errors import (
    CollectiveArgumentError,
    CollectiveTypeError,
    PlaceholderError,
    TensorparError,
    WireFormatError,
)
from tensorpar.functional import gather, scatter
from tensorpar.placeholder import TensorPlaceholder, is_placeholder

__version__ = "0.1.0"

__all__ = [
    "CollectiveArgumentError",
    "CollectiveRecord",
    "CollectiveTypeError",
    "CommCounter",
    "PlaceholderError",
    "TensorPlaceholder",
    "TensorparError",
    "WireFormatError",
    "__version__",
    "gather",
    "is_placeholder",
    "scatter",
]
