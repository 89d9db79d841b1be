"""TensorPlaceholder: the metadata of a tensor whose data lives on another rank.

Also holds the metadata wire format: a fixed-size int64 header (never pickle) that
collectives exchange so that ranks without data learn, or check, what the data looks like.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

from tensorpar._not_data import NotData
from tensorpar.errors import (
    CollectiveArgumentError,
    CollectiveTypeError,
    PlaceholderError,
    TensorparError,
    WireFormatError,
)

__all__ = ["TensorPlaceholder", "is_placeholder"]


class TensorPlaceholder(NotData):
    """Shape, dtype, device and ``requires_grad`` of a tensor that this rank holds no data for.

    A placeholder stands where ``None``, zeros or an uninitialised dummy would otherwise
    stand: the non-source ranks before a `scatter`, the non-destination
    ranks after a `gather`. It is frozen and hashable; equality compares
    the metadata, the owner and (by identity) the group.

    A placeholder returned by a collective also carries that collective's place in the
    autograd graph: `backward` on it joins the mirrored backward collective.

    Using it as data (``ph + 1``, ``torch.add(ph, 1)``, ``ph.sum()``, ``ph[0]``) raises
    `PlaceholderError`, naming the rank that holds the data.

    Args:
        shape: the full shape of the tensor.
        dtype: its dtype.
        device: the device a buffer for it would live on (this rank's device).
        requires_grad: whether the tensor takes part in autograd.
        owner: the rank **within** ``group`` that holds the data, if known.
        group: the process group ``owner`` refers to (``None``: the default group).

    Example:
        >>> import torch
        >>> from tensorpar import TensorPlaceholder
        >>> ph = TensorPlaceholder((4, 3), torch.float32, requires_grad=True, owner=1)
        >>> ph
        TensorPlaceholder((4, 3), torch.float32, device='cpu', requires_grad=True, owner=1)
        >>> print(ph)
        placeholder(float32[4, 3], owner=1, requires_grad)
        >>> ph.numel(), ph.nbytes, ph.size(-1)
        (12, 48, 3)
        >>> ph.zeros().shape
        torch.Size([4, 3])
    """

    __slots__ = ("_anchor", "_device", "_dtype", "_group", "_owner", "_requires_grad", "_shape")

    _shape: torch.Size
    _dtype: torch.dtype
    _device: torch.device
    _requires_grad: bool
    _owner: int | None
    _group: weakref.ReferenceType[dist.ProcessGroup] | None  # weak: see `group`
    _anchor: torch.Tensor | None

    def __init__(self, shape: Iterable[int], dtype: torch.dtype, *,
                 device: torch.device | str = "cpu", requires_grad: bool = False,
                 owner: int | None = None, group: dist.ProcessGroup | None = None,
                 _anchor: torch.Tensor | None = None) -> None:
        if isinstance(shape, int):
            raise CollectiveTypeError(
                f"TensorPlaceholder: shape must be a sequence of ints, got int "
                f"{shape}; use ({shape},) for a 1-D tensor")
        dims = tuple(shape)
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
            raise CollectiveArgumentError(
                f"TensorPlaceholder: shape must hold non-negative ints, got {dims}")
        if not isinstance(dtype, torch.dtype):
            raise CollectiveTypeError(
                f"TensorPlaceholder: dtype must be a torch.dtype, "
                f"got {type(dtype).__name__} {dtype!r}")
        if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
            raise CollectiveArgumentError(
                f"TensorPlaceholder: requires_grad=True needs a floating point or "
                f"complex dtype, got {dtype}")
        if owner is not None and (isinstance(owner, bool) or not isinstance(owner, int)
                                  or owner < 0):
            raise CollectiveArgumentError(
                f"TensorPlaceholder: owner must be None or a rank >= 0, got {owner!r}")
        if group is not None and dist.is_initialized() and group is dist.group.WORLD:
            group = None  # one spelling for the default group, so equality holds
        if _anchor is None and requires_grad:
            _anchor = _leaf(dtype, torch.device(device))
        set_ = object.__setattr__
        set_(self, "_shape", torch.Size(dims))
        set_(self, "_dtype", dtype)
        set_(self, "_device", torch.device(device))
        set_(self, "_requires_grad", bool(requires_grad))
        set_(self, "_owner", owner)
        set_(self, "_group", None if group is None else weakref.ref(group))
        set_(self, "_anchor", _anchor)

    @classmethod
    def like(cls, tensor: torch.Tensor, *, owner: int | None = None,
             group: dist.ProcessGroup | None = None) -> TensorPlaceholder:
        """A placeholder with ``tensor``'s shape, dtype, device and ``requires_grad``."""
        if not isinstance(tensor, torch.Tensor):
            raise CollectiveTypeError(
                f"TensorPlaceholder.like: expected a tensor, "
                f"got {type(tensor).__name__}")
        return cls(tensor.shape, tensor.dtype, device=tensor.device,
                   requires_grad=tensor.requires_grad, owner=owner, group=group)

    # -- tensor-like metadata -------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        """The full shape, as a ``torch.Size``."""
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        """The dtype."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        """The device a local buffer for this tensor lives on."""
        return self._device

    @property
    def requires_grad(self) -> bool:
        """Whether the tensor takes part in autograd."""
        return self._requires_grad

    @property
    def owner(self) -> int | None:
        """The rank within `group` that holds the data (``None`` if unknown)."""
        return self._owner

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group `owner` refers to (``None``: the default group).

        Held weakly, like every process group tensorpar refers to, so a placeholder does not
        keep its group alive past ``destroy_process_group``.

        Raises:
            TensorparError: that group has been destroyed.
        """
        if self._group is None:
            return None
        group = self._group()
        if group is None:
            raise TensorparError("TensorPlaceholder: its process group has been destroyed "
                                 "(destroy_process_group)")
        return group

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self._shape)

    def dim(self) -> int:
        """Number of dimensions, as ``Tensor.dim()``."""
        return len(self._shape)

    def size(self, dim: int | None = None) -> Any:
        """The shape, or the length of dimension ``dim`` (negative dims allowed)."""
        if dim is None:
            return self._shape
        return self._shape[_normalize_dim("TensorPlaceholder.size", dim, self.ndim)]

    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self._shape)

    def element_size(self) -> int:
        """Bytes per element."""
        return self._dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes the data takes (``numel() * element_size()``)."""
        return self.numel() * self._dtype.itemsize

    # -- materialisation ------------------------------------------------------------------
    def empty(self, *, device: torch.device | str | None = None,
              requires_grad: bool | None = None) -> torch.Tensor:
        """An uninitialised tensor with this metadata (e.g. a receive buffer)."""
        return torch.empty(self._shape, dtype=self._dtype, device=device or self._device,
                           requires_grad=self._requires_grad if requires_grad is None
                           else requires_grad)

    def zeros(self, *, device: torch.device | str | None = None,
              requires_grad: bool | None = None) -> torch.Tensor:
        """A zero tensor with this metadata."""
        return torch.zeros(self._shape, dtype=self._dtype, device=device or self._device,
                           requires_grad=self._requires_grad if requires_grad is None
                           else requires_grad)

    # -- autograd -------------------------------------------------------------------------
    def backward(self) -> None:
        """Join the backward pass of the collective that produced this placeholder.

        On a rank that holds no data of a `gather` result, the gradient
        comes from the destination rank: this call takes part in the backward scatter and
        accumulates this rank's share into the gradients of its own inputs.

        Raises:
            PlaceholderError: the placeholder was not produced by a differentiable
                collective (constructed by hand, or its input did not require grad).
        """
        anchor = self._anchor
        if anchor is None or anchor.grad_fn is None:  # none, or this placeholder's own leaf
            raise PlaceholderError(f"{self} has no autograd graph to run backward through: it was "
                                   f"not produced by a collective whose input requires grad")
        torch.autograd.backward(anchor, torch.zeros_like(anchor))

    # -- presentation, equality, pickling -------------------------------------------------
    def __repr__(self) -> str:
        return (f"TensorPlaceholder({tuple(self._shape)}, {self._dtype}, "
                f"device='{self._device}', requires_grad={self._requires_grad}, "
                f"owner={self._owner})")

    def __str__(self) -> str:
        dims = ", ".join(str(d) for d in self._shape)
        dtype = str(self._dtype).removeprefix("torch.")
        grad = ", requires_grad" if self._requires_grad else ""
        return f"placeholder({dtype}[{dims}], owner={self._owner}{grad})"

    def _key(self) -> tuple[Any, ...]:
        return (self._shape, self._dtype, self._device, self._requires_grad, self._owner)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorPlaceholder):
            return NotImplemented
        return self._key() == other._key() and self._group == other._group  # same referent

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self) -> tuple[Any, ...]:
        # The group handle and the autograd anchor are local to this process.
        return (_rebuild, (tuple(self._shape), self._dtype, str(self._device),
                           self._requires_grad, self._owner))

    def __copy__(self) -> TensorPlaceholder:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> TensorPlaceholder:
        return self

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"TensorPlaceholder is immutable; cannot set {name!r}")

    # -- everything a tensor does with its data raises ------------------------------------
    def _not_data(self, op: str) -> NoReturn:
        where = "on another rank" if self._owner is None else f"on rank {self._owner}"
        raise PlaceholderError(
            f"{op}: got a TensorPlaceholder for a {str(self._dtype).removeprefix('torch.')} "
            f"tensor of shape {tuple(self._shape)}; this rank{_this_rank(self._group)} holds no "
            f"data for it, the data lives {where}")

    def __len__(self) -> int:
        if not self._shape:
            raise CollectiveTypeError("len() of a 0-d TensorPlaceholder")
        return self._shape[0]


def _leaf(dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The empty leaf standing for a placeholder that requires grad in the autograd graph.

    A collective called with the placeholder on a rank without data takes it as its input,
    which keeps the rank in the backward pass. Made here, outside any compiled function, it
    is an input of a graph that ``torch.compile`` traces (a graph cannot make a leaf that
    requires grad). None while dynamo traces, or on a device this process cannot use; the
    eager collectives then make one per call.
    """
    if torch.compiler.is_compiling():
        return None
    if device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available()
                                and (device.index or 0) < torch.cuda.device_count()):
        return torch.empty(0, dtype=dtype, device=device, requires_grad=True)
    return None


def _rebuild(shape: tuple[int, ...], dtype: torch.dtype, device: str, requires_grad: bool,
             owner: int | None) -> TensorPlaceholder:
    return TensorPlaceholder(shape, dtype, device=device, requires_grad=requires_grad, owner=owner)


def _this_rank(ref: weakref.ReferenceType[dist.ProcessGroup] | None) -> str:
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    group = None if ref is None else ref()
    if ref is not None and group is None:  # the group is gone: no rank to name
        return ""
    return f" (rank {dist.get_rank(group)})"


def is_placeholder(x: object) -> bool:
    """True if ``x`` is a `TensorPlaceholder`.

    Example:
        >>> import torch, tensorpar
        >>> tensorpar.is_placeholder(torch.zeros(2)), tensorpar.is_placeholder(
        ...     tensorpar.TensorPlaceholder((2,), torch.float32))
        (False, True)
    """
    return isinstance(x, TensorPlaceholder)


def _normalize_dim(fn: str, dim: object, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise CollectiveTypeError(f"{fn}: dim must be an int, got {type(dim).__name__}")
    if ndim == 0:
        raise CollectiveArgumentError(f"{fn}: dim={dim} is out of range for a 0-d tensor")
    if not -ndim <= dim < ndim:
        raise CollectiveArgumentError(
            f"{fn}: dim={dim} is out of range for a {ndim}-d tensor "
            f"(expected {-ndim} <= dim < {ndim})")
    return dim % ndim


# ---------------------------------------------------------------------------------------
# Wire format: [magic, kind, dtype code, requires_grad, device type code, ndim,
#               dim_0 .. dim_{MAX_NDIM-1}, root]
# ---------------------------------------------------------------------------------------

FORMAT_VERSION = 3
MAGIC = 0x7470_0000 + FORMAT_VERSION  # "tp" and the format version
MAX_NDIM = 12
HEADER_LEN = 7 + MAX_NDIM

KIND_TENSOR = 0       # the rank passed a tensor (metadata valid)
KIND_PLACEHOLDER = 1  # the rank passed a placeholder (metadata valid)
KIND_NONE = 2         # the rank passed None (no metadata)
KIND_OTHER = 3        # the rank passed something else (no metadata)
_KINDS = (KIND_TENSOR, KIND_PLACEHOLDER, KIND_NONE, KIND_OTHER)

# Codes are part of the wire format: append only, never reorder.
_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "uint8", "int8", "int16", "int32",
                "int64", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
                "uint16", "uint32", "uint64", "complex32")
_CODE_TO_DTYPE: dict[int, torch.dtype] = {
    code: getattr(torch, name) for code, name in enumerate(_DTYPE_NAMES) if hasattr(torch, name)
}
_DTYPE_TO_CODE = {dtype: code for code, dtype in _CODE_TO_DTYPE.items()}
# The sender's device type, so that a rank that passed None receives on the same kind of
# device. Append only; -1: a type not listed (the receiver uses the group's device).
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "meta")
_DEVICE_TYPE_TO_CODE = {name: code for code, name in enumerate(_DEVICE_TYPES)}


class Header(NamedTuple):
    """A decoded metadata header."""

    kind: int
    shape: torch.Size
    dtype: torch.dtype | None
    requires_grad: bool
    device_type: str | None = None  # None: not sent, or a type the format does not list
    root: int = -1  # the src/dst the rank called the collective with (-1: none)

    @property
    def tensor_dtype(self) -> torch.dtype:
        """The dtype of a header that describes a tensor (a source's, after the checks)."""
        assert self.dtype is not None, "a header without metadata"
        return self.dtype

    def describes_the_same(self, other: Header) -> bool:
        """Same shape, dtype and ``requires_grad`` (the device may differ between ranks)."""
        return (self.shape, self.dtype, self.requires_grad) == \
            (other.shape, other.dtype, other.requires_grad)

    def describe(self) -> str:
        if self.dtype is None:
            return "no metadata"
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}" + (
            " requiring grad" if self.requires_grad else "")


def encode_header(kind: int, shape: Sequence[int] = (), dtype: torch.dtype | None = None,
                  requires_grad: bool = False, device_type: str | None = None,
                  root: int = -1) -> torch.Tensor:
    """Encode metadata as a CPU ``(HEADER_LEN,)`` int64 tensor.

    ``device_type`` is the described tensor's (``"cpu"``, ``"cuda"``, ...); ``root`` the
    ``src``/``dst`` this rank called a rooted collective with (``-1``: none), so that every
    rank can check that all of them named the same one.
    """
    if len(shape) > MAX_NDIM:
        raise CollectiveArgumentError(
            f"tensorpar supports tensors of at most {MAX_NDIM} dimensions in "
            f"collectives, got {len(shape)}")
    if dtype is not None and dtype not in _DTYPE_TO_CODE:
        raise CollectiveArgumentError(f"tensorpar cannot send metadata of dtype {dtype}")
    values = [MAGIC, kind, -1 if dtype is None else _DTYPE_TO_CODE[dtype], int(requires_grad),
              _DEVICE_TYPE_TO_CODE.get(device_type, -1) if device_type else -1,
              len(shape), *shape, *([0] * (MAX_NDIM - len(shape))), root]
    return torch.tensor(values, dtype=torch.int64)


def decode_header(header: torch.Tensor) -> Header:
    """Decode a header made by `encode_header`.

    Raises:
        WireFormatError: wrong dtype or length, bad magic number, unknown kind or dtype code,
            or inconsistent dimensions.
    """
    if not isinstance(header, torch.Tensor):
        raise WireFormatError(f"metadata header must be an int64 tensor, got "
                              f"{type(header).__name__}")
    if header.dtype != torch.int64 or header.shape != (HEADER_LEN,):
        raise WireFormatError(f"metadata header must be an int64 tensor of shape ({HEADER_LEN},), "
                              f"got {header.dtype} of shape {tuple(header.shape)}")
    magic, kind, code, grad, device_code, ndim, *dims, root = header.tolist()
    if magic != MAGIC:
        raise WireFormatError(f"metadata header has magic number {magic:#x}, expected {MAGIC:#x}: "
                              f"the peer is not speaking tensorpar's format version "
                              f"{FORMAT_VERSION}")
    if kind not in _KINDS:
        raise WireFormatError(f"metadata header has unknown kind {kind}")
    if root < -1:
        raise WireFormatError(f"metadata header has root={root}, expected a rank >= 0 or -1")
    if kind in (KIND_NONE, KIND_OTHER):
        return Header(kind, torch.Size(()), None, False, root=root)
    if code not in _CODE_TO_DTYPE:
        raise WireFormatError(f"metadata header has unknown dtype code {code} "
                              f"(known: 0..{len(_DTYPE_NAMES) - 1})")
    if not 0 <= ndim <= MAX_NDIM:
        raise WireFormatError(f"metadata header has ndim={ndim}, expected 0 <= ndim <= {MAX_NDIM}")
    if grad not in (0, 1):
        raise WireFormatError(f"metadata header has requires_grad={grad}, expected 0 or 1")
    if any(d < 0 for d in dims[:ndim]) or any(dims[ndim:]):
        raise WireFormatError(f"metadata header has malformed dims {dims} for ndim={ndim}")
    if not -1 <= device_code < len(_DEVICE_TYPES):
        raise WireFormatError(f"metadata header has unknown device type code {device_code} "
                              f"(known: -1..{len(_DEVICE_TYPES) - 1})")
    device_type = _DEVICE_TYPES[device_code] if device_code >= 0 else None
    return Header(kind, torch.Size(dims[:ndim]), _CODE_TO_DTYPE[code], bool(grad), device_type,
                  root)
