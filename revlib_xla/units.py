"""Byte counts in words and back: :func:`format_bytes` (``1536`` -> ``'1.50 KiB'``) and :func:`parse_bytes`
(``'512MiB'`` -> 536870912.0), with the units the second accepts (:data:`BYTE_UNITS`). Imports nothing of the
package: every layer may use it."""

from __future__ import annotations

import re

__all__ = ["BYTE_UNITS", "format_bytes", "parse_bytes"]


def format_bytes(n: int) -> str:
    """``1536`` -> ``'1.50 KiB'``: binary units, two decimals, exact bytes below 1 KiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


#: Units :func:`parse_bytes` accepts (lower case): decimal ones are powers of 1000, binary ones powers of 1024.
BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | float | str, what: str = "size") -> float:
    """A positive byte count from a number of bytes or a string with a unit: ``"1GB"`` is 10**9 bytes, ``"512MiB"``
    512 * 2**20, ``"1.5 GiB"`` 1.5 * 2**30. Decimal units (kB, MB, GB, TB) are powers of 1000 and binary ones (KiB,
    MiB, GiB, TiB) powers of 1024, as their names say (SI and IEC); case and spaces are ignored. ``what`` names the
    argument in the error raised for anything else."""
    given = value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", value.lower())
        unit = BYTE_UNITS.get(match.group(2) or "b") if match else None
        if match is None or unit is None:
            raise ValueError(
                f"{what}={value!r}: expected a number of bytes or a number with a unit, one of "
                f"B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. "
                f"'1GB' or '512MiB'"
            )
        value = float(match.group(1)) * unit
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{what}={value!r}: expected a number of bytes or a string such as '1GB' or '512MiB', not "
            f"{type(value).__name__}"
        )
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"{what}={given!r}: must be a positive, finite number of bytes")
    return value
