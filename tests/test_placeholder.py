import copy
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tensorpar
from tensorpar import PlaceholderError, TensorparError, TensorPlaceholder, WireFormatError
from tensorpar.placeholder import (
    HEADER_LEN,
    KIND_PLACEHOLDER,
    KIND_TENSOR,
    MAX_NDIM,
    decode_header,
    encode_header,
)


def make(**kw):
    args = {"requires_grad": True, "owner": 2}
    args.update(kw)
    return TensorPlaceholder((4, 3), torch.float32, **args)


def test_metadata_like_a_tensor():
    ph = make()
    t = torch.empty(4, 3)
    assert ph.shape == t.shape and isinstance(ph.shape, torch.Size)
    assert ph.dtype == torch.float32 and ph.device == torch.device("cpu")
    assert ph.requires_grad is True and ph.owner == 2 and ph.group is None
    assert ph.ndim == t.ndim == ph.dim() == 2
    assert ph.size() == t.size() and ph.size(0) == 4 and ph.size(-1) == 3
    assert ph.numel() == 12 and ph.nbytes == t.nbytes == 48 and ph.element_size() == 4
    assert len(ph) == 4


def test_like_copies_tensor_metadata():
    t = torch.zeros(2, 5, dtype=torch.float64, requires_grad=True)
    ph = TensorPlaceholder.like(t, owner=1)
    assert (ph.shape, ph.dtype, ph.requires_grad, ph.owner) == (t.shape, t.dtype, True, 1)
    with pytest.raises(TypeError, match="expected a tensor"):
        TensorPlaceholder.like([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["empty", "zeros"])
def test_materialise(method):
    ph = TensorPlaceholder((2, 3), torch.bfloat16, requires_grad=True)
    t = getattr(ph, method)()
    assert t.shape == (2, 3) and t.dtype == torch.bfloat16 and t.requires_grad
    assert not getattr(ph, method)(requires_grad=False).requires_grad
    if method == "zeros":
        assert t.count_nonzero() == 0


def test_repr_round_trips_and_str_is_short():
    for ph in [make(), TensorPlaceholder((), torch.int64), make(owner=None, requires_grad=False)]:
        again = eval(repr(ph), {"TensorPlaceholder": TensorPlaceholder, "torch": torch})
        assert again == ph and hash(again) == hash(ph)
    assert str(make()) == "placeholder(float32[4, 3], owner=2, requires_grad)"


def test_frozen_hashable_equal_by_metadata():
    a, b = make(), make()
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != make(owner=1) and a != make(requires_grad=False)
    assert a != TensorPlaceholder((4, 3), torch.float64, requires_grad=True, owner=2)
    with pytest.raises(AttributeError, match="immutable"):
        a.owner = 3  # type: ignore[misc]
    assert copy.copy(a) is a and copy.deepcopy(a) is a
    assert pickle.loads(pickle.dumps(a)) == a


def test_is_placeholder():
    assert tensorpar.is_placeholder(make())
    assert not tensorpar.is_placeholder(torch.zeros(1)) and not tensorpar.is_placeholder(None)


DATA_USES = {
    "torch.add": lambda ph: torch.add(ph, 1),
    "operator +": lambda ph: ph + 1,
    "reflected +": lambda ph: 1 + ph,
    "operator @": lambda ph: ph @ torch.ones(3),
    "Tensor.sum": lambda ph: ph.sum(),
    "Tensor.view": lambda ph: ph.view(-1),
    "indexing": lambda ph: ph[0],
    "comparison": lambda ph: ph < 1,
    "negation": lambda ph: -ph,
    "bool()": lambda ph: bool(ph),
    "float()": lambda ph: float(ph),
    "iteration": lambda ph: list(ph),
    "torch.cat": lambda ph: torch.cat([ph, ph]),
    "F.relu": lambda ph: torch.nn.functional.relu(ph),
}


@pytest.mark.parametrize("use", list(DATA_USES))
def test_using_as_data_raises_placeholder_error(use):
    with pytest.raises(PlaceholderError) as info:
        DATA_USES[use](make())
    message = str(info.value)
    assert "(4, 3)" in message and "float32" in message
    assert "holds no data" in message and "rank 2" in message
    assert isinstance(info.value, TensorparError) and isinstance(info.value, RuntimeError)


def test_unknown_attribute_is_attribute_error():
    with pytest.raises(AttributeError):
        make().not_a_tensor_method  # noqa: B018


def test_backward_without_graph_raises():
    with pytest.raises(PlaceholderError, match="no autograd graph"):
        make().backward()


@pytest.mark.parametrize("bad, error, match", [
    (dict(shape=5), TypeError, "sequence of ints"),
    (dict(shape=(2, -1)), ValueError, "non-negative"),
    (dict(dtype="float32"), TypeError, "torch.dtype"),
    (dict(dtype=torch.int64, requires_grad=True), ValueError, "floating point"),
    (dict(owner=-1), ValueError, "owner"),
])
def test_constructor_rejects_bad_input(bad, error, match):
    args = {"shape": (2, 3), "dtype": torch.float32}
    args.update(bad)
    shape, dtype = args.pop("shape"), args.pop("dtype")
    with pytest.raises(error, match=match):
        TensorPlaceholder(shape, dtype, **args)


# -- wire format ---------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]


@given(shape=st.lists(st.integers(0, 2**40), max_size=MAX_NDIM),
       dtype=st.sampled_from(DTYPES), grad=st.booleans(),
       kind=st.sampled_from([KIND_TENSOR, KIND_PLACEHOLDER]),
       device_type=st.sampled_from([None, "cpu", "cuda", "xpu", "mps", "meta"]))
def test_header_round_trips(shape, dtype, grad, kind, device_type):
    header = encode_header(kind, shape, dtype, grad, device_type=device_type)
    assert header.dtype == torch.int64 and header.shape == (HEADER_LEN,)
    decoded = decode_header(header)
    assert decoded.kind == kind and decoded.shape == torch.Size(shape)
    assert decoded.dtype == dtype and decoded.requires_grad == grad
    assert decoded.device_type == device_type


def test_an_unlisted_device_type_is_sent_as_unknown():
    decoded = decode_header(encode_header(KIND_TENSOR, (2,), torch.float32,
                                          device_type="privateuseone"))
    assert decoded.device_type is None and decoded.shape == (2,)


def _corrupt(index, value):
    header = encode_header(KIND_TENSOR, (2, 3), torch.float32, True)
    header[index] = value
    return header


@pytest.mark.parametrize("header, match", [
    (_corrupt(0, 12345), "magic"),
    (_corrupt(1, 9), "unknown kind"),
    (_corrupt(2, 999), "unknown dtype code 999"),
    (_corrupt(3, 7), "requires_grad=7"),
    (_corrupt(4, 99), "unknown device type code 99"),
    (_corrupt(5, MAX_NDIM + 1), "ndim"),
    (_corrupt(6, -4), "malformed dims"),
    (_corrupt(6 + 3, 1), "malformed dims"),
    (torch.zeros(HEADER_LEN, dtype=torch.int32), "int64"),
    (torch.zeros(HEADER_LEN + 1, dtype=torch.int64), "shape"),
])
def test_malformed_headers_raise(header, match):
    with pytest.raises(WireFormatError, match=match):
        decode_header(header)


def test_header_limits():
    with pytest.raises(ValueError, match="at most"):
        encode_header(KIND_TENSOR, [1] * (MAX_NDIM + 1), torch.float32)
