"""A memo for the cost model's answers to scalar questions (``memo_on_scalars``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["memo_on_scalars"]


_SCALARS = (int, float, str, np.number, np.bool_)


def memo_on_scalars(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method(self, unit, ...)`` kept per (unit, arguments) in the model's ``_times`` when
    every argument is a Python or numpy scalar: the planner asks the same few layouts' memory and
    synchronisation of every candidate placement (tens of thousands of numpy calls on
    scalars). Array arguments, and array results, are computed each time."""
    name = method.__name__

    @functools.wraps(method)
    def memo(self: Any, unit: Any, *args: Any, **kwargs: Any) -> Any:
        if not all(isinstance(a, _SCALARS) for a in (*args, *kwargs.values())):
            return method(self, unit, *args, **kwargs)
        key = (name, id(unit), args, tuple(sorted(kwargs.items())))
        hit = self._times.get(key)
        if hit is None or hit[0] is not unit:
            value = method(self, unit, *args, **kwargs)
            parts = value if isinstance(value, tuple) else (value,)
            if any(isinstance(v, np.ndarray) for v in parts):
                return value
            hit = self._times[key] = (unit, value)
        return hit[1]
    return memo
