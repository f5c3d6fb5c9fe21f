"""pylance's native MemWAL planners at the shapes of ``benchmarks/scale.py``.

pylance 14 offers ``lance.mem_wal.LsmScanner`` (``from_snapshots``),
``LsmPointLookupPlanner`` and ``LsmVectorSearchPlanner`` (IVF_PQ only; no full-text
planner). They are given the table written by memwal_query as it is on storage: the
base dataset and one ``ShardSnapshot`` per region listing the region's unmerged
flushed generations (``{hex}_gen_{i}`` directories, the same layout the native writer
produces). Each figure is checked against memwal_query's answer for the same query;
a planner that fails, or answers with other rows, duplicate keys or another row count,
is reported as such instead of a figure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lance
import numpy as np
import pyarrow as pa
from _common import pct
from lance.mem_wal import LsmPointLookupPlanner, LsmScanner, LsmVectorSearchPlanner, ShardSnapshot

import memwal_query as mq

SCAN_COLUMNS = ["id", "text"]
SLOW_SECONDS = 5.0  # a call slower than this is timed once


def snapshots(t: mq.MemWalTable) -> list[ShardSnapshot]:
    """One native snapshot per region: its unmerged flushed generations."""
    merged = t.catalog.index().merged_generations()
    out = []
    for region_id in t.catalog.region_ids():
        m = t.catalog.region_manifest(region_id)
        if m is None:
            continue
        snap = ShardSnapshot(region_id).with_current_generation(m.current_generation)
        for g in m.flushed_generations:
            if g.generation > merged.get(region_id, 0):
                snap = snap.with_sstable(g.generation, g.path)
        out.append(snap)
    return out


def timed_p50(fn: Callable[[int], Any], reps: int) -> tuple[float, list[Any]]:
    """(p50 ms, answers) of ``fn(0..reps-1)`` after one untimed call (one timed call
    when that one took longer than SLOW_SECONDS)."""
    s = time.perf_counter()
    fn(0)
    if time.perf_counter() - s > SLOW_SECONDS:
        reps = 1
    lat, answers = [], []
    for i in range(reps):
        s = time.perf_counter()
        answers.append(fn(i))
        lat.append(time.perf_counter() - s)
    return pct(lat, 50) * 1e3, answers


def _guard(fn: Callable[[], dict[str, Any]], keys: list[str]) -> dict[str, Any]:
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001 - a Rust panic is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        msg = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
        return {k: msg for k in keys}


def _dups(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


def native_measure(
    t: mq.MemWalTable, n: int, queries: np.ndarray, reps: int, truth: Callable[[np.ndarray], list]
) -> dict[str, Any]:
    """Ours and native at one shape: scan (+ plain Lance), lookup, vector search.

    ``truth(q)`` is the exact top-k ids of query ``q`` over the deduplicated rows.
    Figures are p50 ms; a native figure is replaced by a string saying why when the
    planner fails or answers wrongly.
    """
    base = lance.dataset(t.uri)
    snaps = snapshots(t)
    out: dict[str, Any] = {}
    ours_scan, ours_tables = timed_p50(lambda i: t.to_table(columns=SCAN_COLUMNS), 3)
    out["scan"] = ours_scan
    out["plain"], _ = timed_p50(lambda i: base.to_table(columns=SCAN_COLUMNS), 3)
    want = ours_tables[0]
    want_ids = np.sort(want.column("id").to_numpy())

    def scan() -> dict[str, Any]:
        ms, got = timed_p50(
            lambda i: LsmScanner.from_snapshots(base, snaps).project(SCAN_COLUMNS).to_table(), 3
        )
        ids = np.sort(got[0].column("id").to_numpy())
        if len(ids) != len(np.unique(ids)):
            return {"n_scan": f"wrong: {len(ids) - len(np.unique(ids)):,} duplicate keys"}
        if len(ids) != len(want_ids) or not np.array_equal(ids, want_ids):
            return {"n_scan": f"wrong: {len(ids):,} rows, ours {len(want_ids):,}"}
        if not _same_rows(got[0], want):
            return {"n_scan": "wrong: other values"}
        return {"n_scan": ms}

    out.update(_guard(scan, ["n_scan"]))
    keys = np.random.default_rng(1).integers(0, n, reps + 1)

    def lookup() -> dict[str, Any]:
        planner = LsmPointLookupPlanner(base, snaps)
        arrs = [pa.array([k], pa.int64()) for k in keys]
        ms, got = timed_p50(lambda i: planner.plan_lookup(arrs[i], SCAN_COLUMNS).to_table(), reps)
        for i, g in enumerate(got):
            ours = t.lookup(arrs[i], columns=SCAN_COLUMNS)
            if not _same_rows(g, ours):
                why = f"wrong: key {keys[i]}: {g.num_rows} row(s), ours {ours.num_rows}"
                return {"n_lookup": why}
        return {"n_lookup": ms}

    out.update(_guard(lookup, ["n_lookup"]))

    def vector() -> dict[str, Any]:
        planner = LsmVectorSearchPlanner(base, snaps, "vec")
        rec, dup = [], 0

        def run(i: int) -> list[int]:
            q = queries[i % len(queries)]
            plan = planner.plan_search(pa.array(q, pa.float32()), k=10, nprobes=20, columns=["id"])
            return plan.to_table().column("id").to_pylist()

        ms, got = timed_p50(run, reps)
        for i, ids in enumerate(got):
            dup += _dups(ids)
            rec.append(len(set(truth(queries[i % len(queries)])) & set(ids)) / 10)
        if dup:
            return {"n_vector": f"wrong: {dup} duplicate keys in {len(got)} answers"}
        return {"n_vector": ms, "n_recall": float(np.mean(rec))}

    out.update(_guard(vector, ["n_vector", "n_recall"]))
    return out


def _same_rows(a: pa.Table, b: pa.Table) -> bool:
    cols = [c for c in SCAN_COLUMNS if c in a.column_names and c in b.column_names]
    if a.num_rows != b.num_rows:
        return False
    return a.select(cols).sort_by("id").equals(b.select(cols).sort_by("id"))


def ratio(ours: float, native: Any) -> Any:
    """ours / native, or the native cell's reason."""
    return ours / native if isinstance(native, float) and native else "-"


def native_rows(results: list[tuple[tuple[int, int], dict[str, Any]]]) -> list[list[Any]]:
    """Rows of the native table printed by scale.py."""
    rows = []
    for (regions, gens), m in results:
        rows.append(
            [
                f"{regions} x {gens}",
                m["scan"],
                m["scan"] / m["plain"],
                m["n_scan"],
                ratio(m["scan"], m["n_scan"]),
                m["lookup"],
                m["n_lookup"],
                ratio(m["lookup"], m["n_lookup"]),
                m["vector"],
                m["recall"],
                m["n_vector"],
                m.get("n_recall", "-"),
                ratio(m["vector"], m["n_vector"]),
            ]
        )
    return rows


NATIVE_HEADER = [
    "regions x gens",
    "our scan ms",
    "x plain Lance",
    "native LsmScanner ms",
    "ours/native",
    "our lookup ms",
    "native lookup ms",
    "ours/native",
    "our vector ms",
    "recall",
    "native vector ms",
    "native recall",
    "ours/native",
]
