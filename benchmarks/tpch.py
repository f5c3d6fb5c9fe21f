"""TPC-H Q1-Q19 over ``orders`` and ``lineitem`` as LSM tables, before and after a merge.

``orders`` (key ``o_orderkey``) and ``lineitem`` (key ``l_orderkey, l_linenumber``)
are memwal_query tables with four bucket regions each (``bucket(o_orderkey, 4)``,
``bucket(l_orderkey, 4)``: an order and its lines share a region number); the other six
tables are in-memory Arrow tables registered in the same DataFusion context. Data:
``benchmarks/tpch_data.py`` (vectorised, TPC-H's schema and value distributions), scale
factor ``--sf`` (default 0.1). Then ``--rounds`` rounds (default 3) of changes through
``t.write`` and ``t.delete``, each flushed: ``--share`` (default 2%) of the orders
replaced whole with their lines (an order with fewer lines than before has the others
deleted), a quarter as many orders deleted with their lines, as many new ones inserted.

Each query is timed (median of ``--repeat`` runs after one warm-up) over:

- ``arrow``: the rows the changes leave (the model), in-memory Arrow tables;
- ``before``: the LSM tables with every round flushed, none merged;
- ``merge``: a copy of them after ``t.maintenance.merge()``;
- ``maintain``: another copy after one maintenance pass, ``t.maintenance.maintain()``
  with the default policy except ``merge_over_generations=1`` (so that the pass merges
  these few rounds; compaction and every other decision are the defaults);
- ``compact``: a third copy after ``t.maintenance.merge()`` and a compaction that
  rewrites every fragment with a deletion file (the reference: a clean base).

Every answer is checked against the ``arrow`` answer of the same query (sorted,
floats to a relative 1e-9): a wrong answer stops the run. Printed: per-query ms,
ratios to Arrow, their geometric means, after/before ratios, and the load average
(the machine is shared: quote the ratios).

Usage: ``python benchmarks/tpch.py [--sf 0.1] [--rounds 3] [--repeat 3] [--queries 1,6]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("LANCE_LOG", "error")

import datafusion  # noqa: E402
import lance  # noqa: E402
import pyarrow as pa  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tpch_data as td  # noqa: E402
from _common import machine, median, print_table, uptime  # noqa: E402
from tpch_data import LSM_TABLES, build, context  # noqa: E402

import memwal_query as mq  # noqa: E402
from memwal_query.maintain.basefiles import compact_base  # noqa: E402
from memwal_query.maintain.policy import MaintenancePolicy  # noqa: E402


def run_queries(
    contexts: dict[str, datafusion.SessionContext],
    sqls: dict[int, str],
    repeat: int,
    check: Callable[[str, int, pa.Table], None],
) -> dict[str, dict[int, float]]:
    """Median ms of each query in each context, after one warm-up run per context whose
    answer goes to ``check``. The contexts take turns run by run, so that a change of
    the machine's load hits them alike."""
    out: dict[str, dict[int, float]] = {stage: {} for stage in contexts}
    for q, sql in sqls.items():
        for stage, ctx in contexts.items():
            check(stage, q, ctx.sql(sql).to_arrow_table())
        runs: dict[str, list[float]] = {stage: [] for stage in contexts}
        for _ in range(repeat):
            for stage, ctx in contexts.items():
                started = time.perf_counter()
                ctx.sql(sql).to_arrow_table()
                runs[stage].append(time.perf_counter() - started)
        for stage in contexts:
            out[stage][q] = median(runs[stage]) * 1000
        print(f"  Q{q} ({uptime()})", flush=True)
    return out


def fragments(uris: dict[str, str]) -> str:
    """What the base tables' fragments look like (count, deletion files)."""
    out = []
    for name, uri in uris.items():
        frags = lance.dataset(uri).get_fragments()
        dels = sum(f.metadata.deletion_file is not None for f in frags)
        out.append(f"{name}: {len(frags)} fragments, {dels} with deletion files")
    return "; ".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sf", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--share", type=float, default=0.02)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--queries", default="", help="comma-separated query numbers (all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    print(f"# TPC-H over LSM tables, SF {args.sf} ({machine()})", flush=True)
    started = time.perf_counter()
    tables = td.generate(args.sf, args.seed)
    rounds, final = td.change_rounds(tables, args.sf, args.rounds, args.share, args.seed + 1)
    sqls = td.queries(args.sf)
    if args.queries:
        sqls = {q: sqls[q] for q in map(int, args.queries.split(","))}
    print(
        f"data {time.perf_counter() - started:.1f} s: "
        f"{tables['orders'].num_rows} orders, {tables['lineitem'].num_rows} lineitems; "
        f"per round {rounds[0].orders.num_rows} orders / {rounds[0].lineitem.num_rows} "
        f"lineitems written, {rounds[0].orders_deleted.num_rows} / "
        f"{rounds[0].lineitem_deleted.num_rows} deleted",
        flush=True,
    )

    expected: dict[int, pa.Table] = {}

    def check(stage: str, q: int, got: pa.Table) -> None:
        if stage == "arrow":
            if got.num_rows == 0:
                raise SystemExit(f"Q{q}: empty answer over the model")
            expected[q] = got
            return
        why = td.differ(got, expected[q])
        if why is not None:
            raise SystemExit(f"Q{q} {stage}: wrong answer: {why}")

    root = tempfile.mkdtemp(prefix="tpch-")
    notes: list[str] = []
    try:
        started = time.perf_counter()
        uris = {"before": build(f"{root}/before", tables, rounds)}
        notes.append(f"writes and flushes: {time.perf_counter() - started:.1f} s")
        for stage in ("merge", "maintain", "compact"):
            shutil.copytree(f"{root}/before", f"{root}/{stage}")
            uris[stage] = {n: f"{root}/{stage}/{n}" for n in LSM_TABLES}

        started = time.perf_counter()
        for uri in uris["merge"].values():
            mq.MemWalTable.open(uri).maintenance.merge()
        notes.append(f"merge {time.perf_counter() - started:.1f} s; {fragments(uris['merge'])}")

        started = time.perf_counter()
        for name, uri in uris["maintain"].items():
            done = mq.MemWalTable.open(uri).maintenance.maintain(
                MaintenancePolicy(merge_over_generations=1)
            )
            notes.append(f"maintain {name}: compaction: {done.compact_reason or 'none'}")
        notes.append(
            f"maintain {time.perf_counter() - started:.1f} s; {fragments(uris['maintain'])}"
        )

        started = time.perf_counter()
        for uri in uris["compact"].values():
            t = mq.MemWalTable.open(uri)
            t.maintenance.merge()
            compact_base(t.catalog, deleted_share=0.0)
        notes.append(
            f"merge + compaction {time.perf_counter() - started:.1f} s; "
            f"{fragments(uris['compact'])}"
        )

        contexts = {"arrow": context(final, None)}
        contexts.update({stage: context(final, u) for stage, u in uris.items()})
        print(f"queries ({uptime()})", flush=True)
        times = run_queries(contexts, sqls, args.repeat, check)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print_report(times, notes)


def print_report(times: dict[str, dict[int, float]], notes: list[str]) -> None:
    arrow, before = times["arrow"], times["before"]
    lsm = [s for s in times if s != "arrow"]
    after = [s for s in lsm if s != "before"]
    rows: list[list[object]] = []
    for q in arrow:
        rows.append(
            [f"Q{q}"]
            + [times[s][q] for s in times]
            + [times[s][q] / arrow[q] for s in lsm]
            + [times[s][q] / before[q] for s in after]
        )
    geo: list[object] = ["geo-mean"] + [""] * len(times)
    geo += [td.geomean([times[s][q] / arrow[q] for q in arrow]) for s in lsm]
    geo += [td.geomean([times[s][q] / before[q] for q in arrow]) for s in after]
    rows.append(geo)
    header = ["query"] + [f"{s} ms" for s in times]
    header += [f"{s}/arrow" for s in lsm] + [f"{s}/before" for s in after]
    print_table(f"TPC-H, median ms ({uptime()})", header, rows)
    print()
    for n in notes:
        print(f"- {n}")
    print("every answer equal to the Arrow answer over the model's rows")


if __name__ == "__main__":
    main()
