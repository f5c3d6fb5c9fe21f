"""Mergers in real processes: Appendix 2 races, kills, reads during a merge.

Each merger runs ``t.maintenance.merge(regions=[region])`` in its own Python process.
Hooks installed in that process only (never in the library) make the interleavings deterministic:

- ``--barrier N``: every merger stops right before its first commit until ``N``
  mergers got there (so they prepared the same generation from the same version);
- ``--pause``: the merger stops before and after every commit until the test says go;
- ``--kill-after-write``: Lance writes the merge's data files (``execute_uncommitted``),
  then the process is SIGKILLed before any commit.

The process prints one JSON line: generations it merged and the commit races it lost.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import lance
import pyarrow as pa
import pytest
from test_merger import base_view, make_generations, view

from memwal_query.format import index as mwindex

from helpers import basic_rows

MERGER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import memwal_query as mq
    from memwal_query.storage import crashpoints
    from memwal_query.maintain import merger

    uri, region, hold, mode, arg = sys.argv[1:6]
    real_point = crashpoints.point
    hits = {}

    def wait_for(path):
        deadline = time.monotonic() + 120
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {path}")
            time.sleep(0.01)

    def point(name):
        n = hits[name] = hits.get(name, 0) + 1
        if mode == "barrier" and name == "merge.before_commit" and n == 1:
            open(os.path.join(hold, f"{os.getpid()}.ready"), "w").close()
            deadline = time.monotonic() + 120
            while sum(f.endswith(".ready") for f in os.listdir(hold)) < int(arg):
                if time.monotonic() > deadline:
                    raise SystemExit("barrier timed out")
                time.sleep(0.01)
        if mode == "pause" and name in ("merge.before_commit", "merge.after_commit"):
            tag = f"{name}.{n}"
            open(os.path.join(hold, f"at.{tag}"), "w").close()
            wait_for(os.path.join(hold, f"go.{tag}"))
        real_point(name)

    crashpoints.point = point
    lost = []
    real_commit = merger._commit_generation

    def commit(table, ds, region_id, prep):
        try:
            return real_commit(table, ds, region_id, prep)
        except OSError as e:
            lost.append([prep.generation, ds.version, str(e)[:200]])
            raise

    merger._commit_generation = commit
    if mode == "kill-after-write":
        from lance.dataset import MergeInsertBuilder

        def execute(self, data, **kw):
            self.execute_uncommitted(data)  # Lance writes the data files ...
            os.kill(os.getpid(), signal.SIGKILL)  # ... and dies before committing

        MergeInsertBuilder.execute = execute
    t = mq.MemWalTable.open(uri)
    report = t.maintenance.merge(regions=[region], batch_rows=0)  # one commit per generation
    done = [m.generation for m in report.merged]
    print(json.dumps({"merged": done, "lost": lost}), flush=True)
    """
)


def start(uri: str, region: str, hold, mode: str = "-", arg: str = "-") -> subprocess.Popen:
    """A merger process (see module docs)."""
    return subprocess.Popen(
        [sys.executable, "-c", MERGER, uri, region, str(hold), mode, arg],
        env={k: v for k, v in os.environ.items() if k != "MEMWAL_CRASH_AT"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def progress_history(table, region: str) -> list[int]:
    """merged_generations[region] of every base version, oldest first."""
    out = []
    for v in lance.dataset(table.uri).versions():
        idx = mwindex.read_index(table.catalog.io, lance.dataset(table.uri, version=v["version"]))
        out.append(0 if idx is None else idx.merged_generations().get(region, 0))
    return out


def data_files(uri: str) -> set[str]:
    return set(os.listdir(os.path.join(uri, "data")))


@pytest.mark.slow
def test_appendix2_scenario1_racing_on_the_same_generation(table, tmp_path):
    """Both mergers prepare generation 1 from the same version; the loser's commit is
    refused, it re-reads merged_gen >= 1 and moves on (Appendix 2, scenario 1)."""
    region, model = make_generations(table, n=3)
    hold = tmp_path / "hold"
    hold.mkdir()
    v0 = lance.dataset(table.uri).version
    procs = [start(table.uri, region, hold, "barrier", "2") for _ in range(2)]
    outs = [finish(p) for p in procs]
    merged = sorted(g for o in outs for g in o["merged"])
    assert merged == [1, 2, 3]  # none merged twice, none skipped
    lost_on_1 = [o for o in outs if any(g == 1 for g, _, _ in o["lost"])]
    assert len(lost_on_1) == 1  # exactly one merger lost the race on generation 1 ...
    loser = lost_on_1[0]
    assert 1 not in loser["merged"]  # ... and did not merge it again
    gen, read_version, msg = next(x for x in loser["lost"] if x[0] == 1)
    assert read_version == v0  # it had prepared generation 1 from the same version
    assert "stale" in msg.lower() or "conflict" in msg.lower() or "concurrent" in msg.lower()
    assert table.catalog.index().merged_generations() == {region: 3}
    history = progress_history(table, region)
    assert history == sorted(history)  # progress never went backwards
    # Exactly one commit per generation carried its progress (data + marker together).
    steps = [b for a, b in zip(history, history[1:]) if b != a]
    assert steps == [1, 2, 3]
    assert base_view(table) == model
    assert view(table) == model


@pytest.mark.slow
def test_killed_between_data_write_and_commit_then_rerun(table, tmp_path):
    """Lance wrote the merge's data files, the process died before committing: the table
    is unchanged (the files are unreferenced), and a rerun merges everything once."""
    region, model = make_generations(table, n=2)
    before_files = data_files(table.uri)
    v0 = lance.dataset(table.uri).version
    p = start(table.uri, region, tmp_path, "kill-after-write")
    p.communicate(timeout=180)
    assert p.returncode == -9  # SIGKILLed
    assert data_files(table.uri) - before_files  # data really was written ...
    assert lance.dataset(table.uri).version == v0  # ... but never committed
    assert table.catalog.index().merged_generations() == {}
    assert view(table) == model
    assert finish(start(table.uri, region, tmp_path))["merged"] == [1, 2]
    assert table.catalog.index().merged_generations() == {region: 2}
    assert base_view(table) == model
    assert lance.dataset(table.uri).count_rows() == len(model)
    assert progress_history(table, region)[-3:] == [0, 1, 2]


def _wait(path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"merger never reached {path.name}"
        time.sleep(0.01)


@pytest.mark.slow
def test_reads_before_during_and_after_a_running_merge_agree(table, tmp_path):
    """A merger process is held before and after each of its commits; every read (and a
    read plan resolved before the merge started) returns exactly the model."""
    region, model = make_generations(table, n=3)
    early = table.provider()
    early_parts = early.get_fragments()  # read plan resolved before the merge
    assert view(table) == model
    hold = tmp_path / "hold"
    hold.mkdir()
    p = start(table.uri, region, hold, "pause")
    seen = []
    for g in (1, 2, 3):
        for when in ("before_commit", "after_commit"):
            tag = f"merge.{when}.{g}"
            _wait(hold / f"at.{tag}", p)
            merged = table.catalog.index().merged_generations().get(region, 0)
            seen.append(merged)
            assert merged == (g - 1 if when == "before_commit" else g)
            assert view(table) == model, tag
            assert table.count_rows() == len(model)
            got = table.lookup(pa.table({"id": pa.array(sorted(model)[:5], pa.int64())}))
            assert got.column("id").to_pylist() == sorted(model)[:5]
            (hold / f"go.{tag}").touch()
    assert finish(p)["merged"] == [1, 2, 3]
    assert seen == [0, 1, 1, 2, 2, 3]
    rows = pa.Table.from_batches(
        [b for part in early_parts for b in part.scanner(early.schema).to_batches()],
        schema=early.schema,
    ).to_pylist()
    assert {r["id"]: (r["val"], r["name"]) for r in rows} == model  # the early plan
    assert view(table) == model and base_view(table) == model


def test_last_write_of_a_key_wins_within_one_generation(table):
    """put/put, put/delete, delete/put and duplicate keys in one batch, one generation."""
    w = table.writer()
    w.put(basic_rows([1, 2, 3, 500], val=[10.0, 20.0, 30.0, 5.0]))
    w.put(basic_rows([1], val=[11.0]))  # put, put: the second wins
    w.delete(pa.table({"id": pa.array([2, 501], pa.int64())}))  # put, delete: deleted
    w.delete(pa.table({"id": pa.array([3], pa.int64())}))
    w.put(basic_rows([3], val=[33.0]))  # delete, put: present again
    w.put(basic_rows([4, 4, 502, 502], val=[40.0, 44.0, 50.0, 55.0]))  # dupes in a batch
    w.flush()
    w.close()
    expected = {k: float(k) for k in range(100) if k != 2}
    expected.update({1: 11.0, 3: 33.0, 4: 44.0, 500: 5.0, 502: 55.0})
    got = {r["id"]: r["val"] for r in table.to_table().to_pylist()}
    assert got == expected
    assert table.maintenance.merge().by_region() == {w.region_id: [1]}
    base = {r["id"]: r["val"] for r in lance.dataset(table.uri).to_table().to_pylist()}
    assert base == expected
    assert lance.dataset(table.uri).count_rows() == len(expected)  # no duplicate keys
