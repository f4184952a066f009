"""The ``#SBATCH`` settings of a bundle's ``slurm.sbatch`` that ``dtc compile`` takes:
checked here (light: ``dtc``'s argument parser uses it), written by the template."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["SlurmOptions", "slurm_name", "slurm_time"]

# Slurm's time limits: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds (sbatch(1), --time).
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?\Z")
_SLURM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\Z")


def slurm_time(text: str) -> str:
    """``text`` if it is a time limit sbatch takes (``UNLIMITED``, or minutes, MM:SS,
    HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, with minutes and seconds below 60 and hours
    below 24 after a day count, and not zero); ValueError saying why otherwise."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return text.upper()
    m = _TIME.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a Slurm time limit (MINUTES, HH:MM:SS, "
                         "D-HH:MM:SS, ... or UNLIMITED)")
    days, first, *rest = m.groups()
    fields = [int(first)] + [int(v) for v in rest if v is not None]
    if days is not None:       # D-HH[:MM[:SS]]
        limits = (24, 60, 60)
    else:                      # MM, MM:SS, HH:MM:SS: the first field is unbounded
        limits = (None, 60) if len(fields) <= 2 else (None, 60, 60)
    for value, limit in zip(fields, limits, strict=False):
        if limit is not None and value >= limit:
            raise ValueError(f"{text!r}: {value} is out of range (below {limit})")
    if int(days or 0) == 0 and not any(fields):
        raise ValueError(f"{text!r} is no time at all (UNLIMITED asks for no limit)")
    return text


def slurm_name(text: str, what: str) -> str:
    """``text`` if it can be a Slurm partition or account name (letters, digits, '_',
    '.', '-'; partitions may be a comma-separated list); ValueError otherwise."""
    parts = text.split(",") if what == "partition" else [text]
    if not all(_SLURM_NAME.match(p) for p in parts):
        also = "; several: a comma-separated list" if what == "partition" else ""
        raise ValueError(f"{text!r} is not a Slurm {what} name (letters, digits, '_', '.', "
                         f"'-'{also})")
    return text


@dataclass(frozen=True)
class SlurmOptions:
    """``dtc compile --time/--partition/--account`` (None: slurm.sbatch has a commented
    line to fill in instead)."""

    time: str | None = None
    partition: str | None = None
    account: str | None = None

    def check(self) -> None:
        """ValueError for a value sbatch would not take."""
        if self.time is not None:
            slurm_time(self.time)
        if self.partition is not None:
            slurm_name(self.partition, "partition")
        if self.account is not None:
            slurm_name(self.account, "account")
