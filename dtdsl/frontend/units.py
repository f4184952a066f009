"""Units of measure: which suffixes measure what, and their factors to SI base units.

Sizes go to bytes, bandwidths to bytes per second, FLOP rates to FLOP per
second, durations to seconds. ``k`` and ``M`` scale plain counts by 10^3 and
10^6; ``%`` is a fraction (90% = 0.9).
"""

from __future__ import annotations

from types import MappingProxyType

__all__ = ["DIMENSIONS", "Dimension", "dimension_of"]


class Dimension:
    """A kind of quantity: its name, an example for messages and its units' factors."""

    def __init__(self, name: str, example: str, factors: dict[str, float]) -> None:
        self.name = name
        self.example = example
        self.factors = MappingProxyType(factors)

    def __repr__(self) -> str:
        return f"Dimension({self.name!r})"


_BITS = 1 / 8
DIMENSIONS = MappingProxyType({
    "size": Dimension("a size", "80 GiB", {
        "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
        "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}),
    "bandwidth": Dimension("a bandwidth", "400 Gb/s", {
        "Mb/s": 1e6 * _BITS, "Mbps": 1e6 * _BITS, "Gb/s": 1e9 * _BITS, "Gbps": 1e9 * _BITS,
        "Tb/s": 1e12 * _BITS, "Tbps": 1e12 * _BITS,
        "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12}),
    "flops": Dimension("a FLOP rate", "989 TFLOPS", {
        "GFLOPS": 1e9, "GFLOP/s": 1e9, "TFLOPS": 1e12, "TFLOP/s": 1e12,
        "PFLOPS": 1e15, "PFLOP/s": 1e15}),
    "time": Dimension("a duration", "30 s", {"s": 1, "ms": 1e-3, "us": 1e-6}),
    "fraction": Dimension("a percentage", "90%", {"%": 0.01}),
    "count": Dimension("a number", "4k", {"k": 1e3, "M": 1e6}),
})


def dimension_of(unit: str) -> str:
    """The dimension key of a unit suffix ("GiB" -> "size")."""
    for key, dim in DIMENSIONS.items():
        if unit in dim.factors:
            return key
    raise KeyError(unit)
