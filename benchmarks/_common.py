"""Shared helpers of the benchmark scripts: timing, table printing, the
``(id, val, cat)`` rows several benchmarks write, a local SparkSession, stopping a
child process."""

from __future__ import annotations

import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa


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
    """Print a Markdown table (pasteable into the README and docs)."""
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


PK = {"lance-schema:unenforced-primary-key": "true"}
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False, metadata=PK),
        pa.field("val", pa.float64()),
        pa.field("cat", pa.int32()),
    ]
)
"""Schema of the benchmark rows: ``id`` (primary key), ``val`` (random), ``cat`` (0..99)."""


def make_rows(ids: np.ndarray, rng: np.random.Generator) -> pa.Table:
    """Rows of :data:`SCHEMA` for keys ``ids``."""
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "val": pa.array(rng.random(len(ids))),
            "cat": pa.array(rng.integers(0, 100, len(ids)), pa.int32()),
        },
        schema=SCHEMA,
    )


# -- the lineitem-like rows of the 10M-row benchmarks (cold_read, maintain_scale) --
LINEITEM_SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), False, PK),
        pa.field("quantity", pa.int32()),
        pa.field("partkey", pa.int32()),
        pa.field("price", pa.float64()),
        pa.field("discount", pa.float64()),
        pa.field("comment", pa.string()),
    ]
)
WORDS = np.array([f"{a} {b}" for a in ("quick", "slow", "pending", "final") for b in range(64)])


def lineitem_rows(ids: np.ndarray, rng: np.random.Generator) -> pa.Table:
    """Rows of :data:`LINEITEM_SCHEMA` for keys ``ids`` (vectorised)."""
    n = len(ids)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "quantity": pa.array(rng.integers(1, 50, n, dtype=np.int32)),
            "partkey": pa.array(rng.integers(0, 200_000, n, dtype=np.int32)),
            "price": pa.array(rng.random(n) * 1e4),
            "discount": pa.array(rng.integers(0, 11, n) / 100.0),
            "comment": pa.array(WORDS[rng.integers(0, len(WORDS), n)]),
        },
        schema=LINEITEM_SCHEMA,
    )


def uptime() -> str:
    try:
        return "load " + " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "load ?"


def local_spark(app: str, cores: int = 2) -> Any:
    """A ``local[cores]`` SparkSession for benchmarks (no UI, quiet, workers run this
    interpreter)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", str(cores))
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 30) -> None:
    """Send ``sig`` to a child process and wait for it; kill it after ``timeout`` s."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
