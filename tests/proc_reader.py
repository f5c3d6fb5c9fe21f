"""A reader process: prints, as one JSON object, the keys every default reader of a
table returns (SQL through ``mq.register``, ``to_table``, ``count_rows``, ``lookup`` of
the keys given, exact vector search, DuckDB and Polars over the provider).

Usage: ``python proc_reader.py URI KEY...`` (the table of tests/proc_writer.py).
"""

from __future__ import annotations

import json
import sys

import datafusion
import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
from proc_writer import DIM

import memwal_query as mq


def main(uri: str, keys: list[int]) -> None:
    t = mq.MemWalTable.open(uri)
    ctx = datafusion.SessionContext()
    mq.register(ctx, "t", uri)
    out = {
        "sql": ctx.sql("SELECT id FROM t").to_arrow_table()["id"].to_pylist(),
        "to_table": t.to_table(columns=["id"])["id"].to_pylist(),
        "count_rows": t.count_rows(),
        "lookup": t.lookup(pa.array(keys, pa.int64()))["id"].to_pylist(),
        "vector": t.vector_search("vec", np.zeros(DIM, np.float32), k=100_000, nprobes=1_000)[
            "id"
        ].to_pylist(),
    }
    con = duckdb.connect()
    con.register("t", t.provider())
    out["duckdb"] = con.sql("SELECT id FROM t").to_arrow_table()["id"].to_pylist()
    polars = pl.SQLContext(t=pl.scan_pyarrow_dataset(t.provider()))
    out["polars"] = polars.execute("SELECT id FROM t").collect()["id"].to_list()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], [int(k) for k in sys.argv[2:]])
