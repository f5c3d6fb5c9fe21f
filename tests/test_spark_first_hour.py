"""The Spark integration's errors as a new user meets them, in a real process with its
own local Spark (its console is the process's stderr): bad read options and a missing
table fail at ``.load()`` with the typed cause (one line through ``mqs.read``), and a
NULL key in ``mqs.write`` fails with a typed error and no Java stack trace."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import lance
import pyarrow as pa
import pytest

import memwal_query as mq

from helpers import PK

ROOT = pathlib.Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, os, sys
os.environ["PYSPARK_PYTHON"] = sys.executable
from pyspark.sql import SparkSession
import memwal_query.spark as mqs

uri = sys.argv[1]
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
mqs.register_source(spark)
out = {}

def attempt(name, f):
    try:
        f()
        out[name] = None
    except Exception as e:
        out[name] = [type(e).__name__, str(e)]

reader = spark.read.format("memwal")
attempt("load_bad_option", lambda: reader.option("consistency", "bogus").load(uri))
attempt("load_missing", lambda: spark.read.format("memwal").load(uri + "-nothing"))
attempt("read_bad_option", lambda: mqs.read(spark, uri, rowsPerSplit="0"))
attempt("read_bad_column", lambda: mqs.read(spark, uri, columns="id,nope"))
print("---", file=sys.stderr, flush=True)
df = spark.createDataFrame([(1, 5.0), (None, 6.0)], "id long, x double")
attempt("write_null_key", lambda: mqs.write(df, uri))
spark.stop()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_spark_errors_are_typed_and_readable(tmp_path):
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("x", pa.float64())])
    lance.write_dataset(pa.table({"id": [1, 2], "x": [1.0, 2.0]}, schema=schema), uri)
    mq.MemWalTable.initialize(
        uri, region_spec=mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 2)
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, uri], capture_output=True, text=True, env=env, timeout=600
    )
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    # at .load(), naming the typed cause (Spark wraps it; the traceback is one frame)
    kind, text = got["load_bad_option"]
    assert "MemWalError: memwal data source: option consistency='bogus'" in text
    assert len(text.splitlines()) <= 6, text
    kind, text = got["load_missing"]
    assert "TableNotFoundError" in text and len(text.splitlines()) <= 6, text
    # through mqs.read: the typed error itself, one line
    assert got["read_bad_option"] == [
        "MemWalError",
        "memwal data source: option rowsPerSplit='0': give a positive number of rows",
    ]
    kind, text = got["read_bad_column"]
    assert kind == "SchemaError" and "['nope']" in text and "\n" not in text
    # a NULL key: typed, nothing written, no executor stack trace on the console
    assert got["write_null_key"] == [
        "PrimaryKeyError",
        "primary-key column 'id' has 1 NULL value(s)",
    ]
    console = p.stderr.split("---\n", 1)[1]
    assert "\tat org.apache" not in console and "Exception in task" not in console, console
    assert mq.MemWalTable.open(uri).to_table().sort_by("id")["x"].to_pylist() == [1.0, 2.0]
