"""Shared helpers of the benchmark scripts: timing and table printing."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np


def timed(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of ``repeat`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def pct(xs: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs), p))


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    """Print a Markdown table (pasteable into the README and issue notes)."""
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        print("| " + " | ".join(_fmt(c) for c in r) + " |")


def _fmt(c: object) -> str:
    if isinstance(c, float):
        if c >= 1000:
            return f"{c:,.0f}"
        if c >= 10:
            return f"{c:.1f}"
        return f"{c:.3g}"
    return str(c)
