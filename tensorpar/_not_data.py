"""A mixin for objects that stand where a tensor would but hold no data.

Every way of using the object as a tensor (``torch.*`` functions through
``__torch_function__``, tensor methods, operators, indexing, ``bool()``) calls
``self._not_data(operation)``, which the subclass implements by raising its own error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

import torch

__all__ = ["NotData"]


class NotData:
    """Refuses every data operation through `_not_data`."""

    __slots__ = ()

    def _not_data(self, op: str) -> NoReturn:
        raise NotImplementedError

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> NoReturn:
        name = f"torch.{getattr(func, '__name__', func)}"
        for item in _flatten((*args, *(kwargs or {}).values())):
            if isinstance(item, NotData):
                item._not_data(name)
        raise TypeError(f"{name}: no tensor-standing object among the arguments")

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("__") and hasattr(torch.Tensor, name):
            self._not_data(f"Tensor.{name}")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")

    def __getitem__(self, index: Any) -> NoReturn:
        self._not_data("indexing")

    def __setitem__(self, index: Any, value: Any) -> NoReturn:
        self._not_data("index assignment")

    def __bool__(self) -> NoReturn:
        self._not_data("bool()")

    def __iter__(self) -> NoReturn:
        self._not_data("iteration")


def _flatten(items: Iterable[Any]) -> Iterable[Any]:
    for item in items:
        if isinstance(item, (list, tuple)):
            yield from _flatten(item)
        else:
            yield item


def _data_op(symbol: str) -> Callable[..., NoReturn]:
    def op(self: NotData, *args: Any) -> NoReturn:
        self._not_data(f"operator {symbol}")
    return op


for _name, _symbol in [
    ("add", "+"), ("sub", "-"), ("mul", "*"), ("truediv", "/"), ("floordiv", "//"),
    ("mod", "%"), ("pow", "**"), ("matmul", "@"), ("and", "&"), ("or", "|"), ("xor", "^"),
    ("lshift", "<<"), ("rshift", ">>"),
]:
    for _prefix in ("", "r", "i"):
        setattr(NotData, f"__{_prefix}{_name}__", _data_op(_symbol))
for _name, _symbol in [("neg", "-"), ("pos", "+"), ("abs", "abs()"), ("invert", "~"),
                       ("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="),
                       ("float", "float()"), ("int", "int()"), ("index", "index()"),
                       ("complex", "complex()"), ("array", "numpy conversion")]:
    setattr(NotData, f"__{_name}__", _data_op(_symbol))
