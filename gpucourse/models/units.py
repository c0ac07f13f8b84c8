"""Numbers as a learner reads them: one formatter per quantity, three significant figures.

    human_bytes(2**24)               '16 MiB'     binary units, for buffers (powers of two)
    human_bytes(31.4e9, decimal=True) '31.4 GB'   decimal units, for model memory (as the ZeRO paper)
    human_seconds(0.00284)           '2.84 ms'    µs, ms, s, min, h
    human_percent(0.004)             '0.4 %'      never '0 %' for a small non-zero fraction
    human_si(1.9e9, "B/s")           '1.9 GB/s'   decimal prefixes: rates (bandwidth, FLOP/s) and counts
"""
from __future__ import annotations

SI_PREFIXES = (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def human_si(value: float, unit: str) -> str:
    """1.9e9, 'B/s' -> '1.9 GB/s'; 3.12e14, 'FLOP/s' -> '312 TFLOP/s'; 12, 'B' -> '12 B'."""
    for prefix, scale in SI_PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def human_bytes(n: float, *, decimal: bool = False) -> str:
    """8 -> '8 B', 1536 -> '1.5 KiB', 2**24 -> '16 MiB'; decimal=True: 512e6 -> '512 MB' (human_si)."""
    if decimal:
        return human_si(n, "B")
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:g} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"


def human_seconds(t: float) -> str:
    """2.5e-6 -> '2.5 µs', 0.00284 -> '2.84 ms', 9.18 -> '9.18 s', 150 -> '2.5 min', 9000 -> '2.5 h'."""
    if abs(t) >= 2 * 3600:
        return f"{t / 3600:.3g} h"
    if abs(t) >= 120:
        return f"{t / 60:.3g} min"
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if abs(t) >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t * 1e6:.3g} µs"


def human_percent(fraction: float, decimals: int = 0) -> str:
    """0.5 -> '50 %', 0.0149 -> '1 %', 0.004 -> '0.4 %' (one significant digit, not '0 %'); decimals=1: '45.3 %'."""
    percent = 100 * fraction
    if percent == 0 or abs(percent) >= 10 ** -decimals:
        return f"{percent:.{decimals}f} %"
    return f"{percent:.1g} %"
