"""TPC-H Q1-Q19 in SQL over LSM tables answer what the same queries answer over the
rows themselves.

``orders`` and ``lineitem`` (composite key ``l_orderkey, l_linenumber``) are LSM tables
with four bucket regions each; the other six TPC-H tables are in-memory Arrow tables in
the same DataFusion session. After three rounds of replaced, deleted and inserted
orders (two flushed, the last one left in the WAL), every query's answer equals the
answer over in-memory Arrow tables of the model's rows: before any merge (base,
generations and WAL tails deduplicated under joins, aggregates, subqueries and pushed
filters), and after a maintenance pass (merged base, compacted by the default policy).
Data and queries: ``benchmarks/tpch_data.py``, the module ``benchmarks/tpch.py`` times.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.maintain.basefiles import read_cost
from memwal_query.maintain.policy import MaintenancePolicy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import tpch_data as td  # noqa: E402

SF = 0.002  # 3,000 orders, ~12,000 lineitems


@pytest.fixture(scope="module")
def tpch(tmp_path_factory: Any) -> tuple[dict[str, pa.Table], list[td.Round], dict[int, pa.Table]]:
    tables = td.generate(SF, seed=5)
    rounds, final = td.change_rounds(tables, SF, rounds=3, share=0.05, seed=6)
    root = str(tmp_path_factory.mktemp("tpch"))
    uris = td.build(root, tables, rounds, unflushed=1)
    ctx = td.context(final)
    expected = {q: ctx.sql(sql).to_arrow_table() for q, sql in td.queries(SF).items()}
    return uris, final, expected


def _check(ctx: Any, expected: dict[int, pa.Table]) -> None:
    wrong = {}
    for q, sql in td.queries(SF).items():
        why = td.differ(ctx.sql(sql).to_arrow_table(), expected[q])
        if why is not None:
            wrong[q] = why
    assert not wrong, wrong


def test_model_answers_are_not_trivial(tpch: Any) -> None:
    _, final, expected = tpch
    empty = sorted(q for q, t in expected.items() if t.num_rows == 0)
    assert len(empty) <= 2, f"queries with empty answers at SF {SF}: {empty}"
    assert final["lineitem"].num_rows > 10_000


def test_queries_before_and_after_maintenance(tpch: Any) -> None:
    uris, final, expected = tpch
    _check(td.context(final, uris), expected)
    for uri in uris.values():
        t = mq.MemWalTable.open(uri)
        report = t.maintenance.maintain(MaintenancePolicy(merge_over_generations=0))
        assert report.merged and not report.errors
        # the merge left deletion files; the default policy rewrote those fragments
        # (they hold fewer rows than its compact_rewrite_rows)
        assert report.compact_due and read_cost(t.catalog).with_deletions == 0
    _check(td.context(final, uris), expected)
