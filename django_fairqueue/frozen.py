"""Frozen dataclasses built as fast as mutable ones, for the records a worker makes per message.

A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__`` (its
own ``__setattr__`` refuses), several times the cost of a mutable one's plain assignments:
about 5 us for a claimed message's 14 fields, a tenth of a worker's Python time per message.
:func:`builder` returns a constructor that builds the instance as a mutable twin of the class
(the same fields, defaults and slots), then makes it an instance of the frozen class: the same
slots are the same memory layout, so CPython allows the class to change. What comes out is an
ordinary instance of the frozen class (equal, hashed, printed, copied, pickled and immutable as
one its own constructor built); the constructor checks its arguments as the class's does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def builder(cls: type[T]) -> Callable[..., T]:
    """A constructor for ``cls``, a frozen dataclass with slots, no ``__post_init__`` and every
    field in ``__init__``, that takes the same arguments as ``cls`` and builds it faster."""
    params = getattr(cls, "__dataclass_params__", None)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if (
        params is None
        or not params.frozen
        or "__slots__" not in cls.__dict__
        or hasattr(cls, "__post_init__")
        or not all(f.init for f in fields)
    ):
        raise TypeError(f"{cls.__name__} is not a frozen dataclass with slots built by __init__")
    twin: Any = dataclasses.make_dataclass(
        f"_Building{cls.__name__}",
        [
            (
                f.name,
                f.type,
                dataclasses.field(
                    default=f.default, default_factory=f.default_factory, kw_only=f.kw_only
                ),
            )
            for f in fields
        ],
        slots=True,
        eq=False,
    )

    def build(*args: Any, **kwargs: Any) -> T:
        instance = twin(*args, **kwargs)
        instance.__class__ = cls
        return instance  # type: ignore[no-any-return]

    return build
