"""A unit's activation recomputation mode (``recompute = ...`` in a spec,
``UnitPlan.recompute`` in a plan), in a module of its own so the program and the plan
share it."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

from pydantic import BeforeValidator

__all__ = ["Recompute", "RecomputeMode"]


class Recompute(str, Enum):
    """How much of a unit's layers backward recomputes instead of keeping, in
    Megatron-LM's words (``--recompute-granularity``): nothing, the attention core
    (``selective``: each layer's scaled dot-product attention, ``parallel.recompute``),
    or the whole layer (``full``: only each layer's input kept). True when it recomputes
    anything, so older ``if module.recompute`` reads stay right for "at all"; ordered
    by how much is recomputed (``rank``), which is also the order of memory saved."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    def __bool__(self) -> bool:
        return self is not Recompute.NONE

    @property
    def rank(self) -> int:
        return _RECOMPUTE_ORDER.index(self)

    @classmethod
    def of(cls, value: object) -> Recompute:
        """The mode ``value`` names: a mode or its name, or an old spec's or plan's
        bool (true: ``full``, false: ``none``)."""
        if isinstance(value, bool):
            return cls.FULL if value else cls.NONE
        return cls(value)


_RECOMPUTE_ORDER = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)


def _recompute_mode(value: object) -> object:
    """A pydantic before-validator: old bools read as modes (``Recompute.of``)."""
    return Recompute.of(value) if isinstance(value, (bool, str)) else value


RecomputeMode = Annotated[Recompute, BeforeValidator(_recompute_mode)]
