"""Successful operations print no ERROR or WARN lines from Lance, unless the user asks
(``LANCE_LOG``): a real process's stderr, through full-text search, a flush that indexes
a small generation with the base's vector partitions, vector search and merge."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

SCRIPT = """
import memwal_query as mq  # first: it sets Lance's log filter before Lance is loaded
import lance, numpy as np, pyarrow as pa, sys

uri = sys.argv[1]
pk = {"lance-schema:unenforced-primary-key": "true"}
schema = pa.schema([pa.field("id", pa.int64(), False, pk), pa.field("text", pa.string()),
                    pa.field("vec", pa.list_(pa.float32(), 8))])
rng = np.random.default_rng(1)

def rows(ids):
    vec = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(len(ids) * 8, np.float32)), 8)
    text = [f"hello w{i % 7}" for i in ids]
    return pa.table({"id": ids, "text": text, "vec": vec}, schema=schema)

lance.write_dataset(rows(np.arange(2000)), uri)
ds = lance.dataset(uri)
ds.create_scalar_index("text", "INVERTED")
ds.create_index("vec", "IVF_PQ", num_partitions=4, num_sub_vectors=2)
print("---", file=sys.stderr, flush=True)  # what the user's own index builds said is above
t = mq.MemWalTable.initialize(uri, maintained_indexes=["vec_idx", "text_idx"])
t.write(rows(np.arange(3)))
t.flush()  # a 3-row generation indexed with the base's 4 partitions: some are empty
assert t.fts_search("text", "hello", k=3).num_rows == 3
assert t.vector_search("vec", rng.random(8), k=3).num_rows == 3
t.maintenance.merge()
t.close()
"""


def _stderr_after_setup(tmp_path, **env: str) -> list[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    if "LANCE_LOG" not in env:
        full.pop("LANCE_LOG", None)
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "t")],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    return p.stderr.split("---\n", 1)[1].splitlines()


def test_successful_operations_print_no_lance_errors_or_warnings(tmp_path):
    lines = _stderr_after_setup(tmp_path)
    assert not [line for line in lines if " ERROR " in line or " WARN " in line], lines


def test_lance_log_still_shows_everything_when_asked(tmp_path):
    lines = _stderr_after_setup(tmp_path, LANCE_LOG="warn")
    assert any("__lance_mem_wal has no fields" in line for line in lines), lines
    assert any("is empty" in line for line in lines), lines
