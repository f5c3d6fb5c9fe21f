"""Automatic maintenance (memwal_query.maintain.policy), real Lance tables.

- The policy: which regions a pass merges (generations, rows), validation, defaults.
- A pass does every step (merge, catch-up, snapshots, GC) and a second pass over a quiet
  table commits nothing; a dry run changes nothing.
- Concurrency, deterministically: a maintainer is paused at *every* storage access it
  makes (FileIO calls and Lance opens/scans/commits, counted in its thread); at each
  pause the test runs a writer flush, a reader or another maintainer, then lets it go
  on. Readers always equal a dict model; at the end the base table holds every key once.
- ``memwal maintain`` (one pass, --dry-run, --json, --watch). ``mqs.maintain`` is tested in
  tests/test_spark.py (it shares that module's SparkSession).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import lance
import pyarrow as pa
import pytest
from click.testing import CliRunner
from lance.optimize import Compaction, CompactionTask

import memwal_query as mq
from memwal_query.cli.commands import main
from memwal_query.maintain.policy import (
    MaintenanceFailedError,
    MaintenancePolicy,
    indexes_behind,
    maintain,
    snapshots_stale,
)
from memwal_query.storage import locking, paths
from memwal_query.storage.io import LocalFileIO

from helpers import basic_rows, parity_spec

NOW = MaintenancePolicy(merge_over_generations=0, retention=dt.timedelta(0))
"""Merge everything, keep no old base version: the policy that does the most."""


def _table(tmp_path: Any, rows: int = 20, name: str = "t") -> mq.MemWalTable:
    """Two regions (even / odd keys), a maintained BTREE index on ``name``."""
    uri = str(tmp_path / name)
    lance.write_dataset(basic_rows(range(rows)), uri)
    ds = lance.dataset(uri)
    ds.create_scalar_index("name", "BTREE", name="name_idx")
    return mq.MemWalTable.initialize(
        uri, region_spec=parity_spec(lance.dataset(uri)), maintained_indexes=["name_idx"]
    )


def _writer(t: mq.MemWalTable, parity: int) -> Any:
    return t.writer(region_values={"p": parity})


def _flushed(t: mq.MemWalTable, parity: int, ids: list[int]) -> Any:
    """A writer of region ``parity`` that has flushed one generation of ``ids``."""
    w = _writer(t, parity)
    w.put(basic_rows(ids))
    w.flush()
    return w


def _state(t: mq.MemWalTable) -> dict[int, float]:
    got = mq.MemWalTable.open(t.uri).to_table(columns=["id", "val"])
    ids = got.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "a key twice"
    return dict(zip(ids, got.column("val").to_pylist(), strict=True))


def _base_state(uri: str) -> dict[int, float]:
    got = lance.dataset(uri).to_table(columns=["id", "val"])
    ids = got.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "a key twice in the base table"
    return dict(zip(ids, got.column("val").to_pylist(), strict=True))


def _gen_dirs(t: mq.MemWalTable) -> set[str]:
    out = set()
    for rid in t.catalog.region_ids():
        out |= {f"{rid}/{n}" for n in os.listdir(paths.region_dir(t.uri, rid)) if "_gen_" in n}
    return out


# -- policy --------------------------------------------------------------------------------
def test_policy_defaults_and_validation() -> None:
    p = MaintenancePolicy()
    assert (p.merge_over_generations, p.merge_over_rows, p.retention) == (
        4,
        100_000,
        dt.timedelta(hours=1),
    )
    assert p.catch_up and p.refresh_snapshots and p.gc
    from memwal_query.maintain import merger

    assert (p.batch_rows(), p.retries()) == (merger.DEFAULT_BATCH_ROWS, merger.DEFAULT_MAX_RETRIES)
    assert MaintenancePolicy(merge_batch_rows=0, max_retries=3).batch_rows() == 0
    assert p.wants_merge(4, 100_000) is None
    assert p.wants_merge(5, 0) == "5 unmerged generations > 4"
    assert p.wants_merge(1, 100_001) == "100001 unmerged rows > 100000"
    assert (
        p.compact_fragments == 16
        and MaintenancePolicy(compact_fragments=None).compact_fragments is None
    )
    assert (p.compact_deleted_share, p.compact_rewrite_rows) == (0.1, 2_000_000)
    assert MaintenancePolicy(compact_rewrite_rows=None).compact_rewrite_rows is None
    for bad in (
        {"merge_over_generations": -1},
        {"merge_over_rows": 1.5},
        {"max_retries": True},
        {"compact_fragments": -1},
        {"compact_rewrite_rows": -1},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            MaintenancePolicy(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="retention"):
        MaintenancePolicy(retention=dt.timedelta(seconds=-1))


def test_pass_merges_only_regions_over_the_policy(tmp_path: Any) -> None:
    t = _table(tmp_path)
    even, odd = _writer(t, 0), _writer(t, 1)
    for i in range(3):  # region "even": 3 generations of 1 row
        even.put(basic_rows([100 + 2 * i], val=[float(i)]))
        even.flush()
    odd.put(basic_rows(range(101, 141, 2)))  # region "odd": 1 generation of 20 rows
    odd.flush()
    policy = MaintenancePolicy(merge_over_generations=2, merge_over_rows=50, gc=False)
    dry = t.maintenance.maintain(policy, dry_run=True)
    version = t.catalog.dataset().version
    assert {(r.region_id, tuple(r.generations), r.rows, r.merge) for r in dry.regions} == {
        (even.region_id, (1, 2, 3), 3, True),
        (odd.region_id, (1,), 20, False),
    }
    assert dry.merged == [] and dry.snapshots_refreshed and dry.catch_up == []
    assert t.catalog.dataset().version == version  # a dry run commits nothing
    assert snapshots_stale(t.catalog)

    report = t.maintenance.maintain(policy)
    assert [(m.region_id, m.generation) for m in report.merged] == [
        (even.region_id, g) for g in (1, 2, 3)
    ]
    assert report.catch_up == ["name_idx"] and report.snapshots_refreshed
    assert report.index_catchup == {"name_idx": {even.region_id: 3}}
    assert t.catalog.index().merged_generations() == {even.region_id: 3}
    assert not snapshots_stale(t.catalog) and indexes_behind(t.catalog) == []
    # Rows: the odd region is over merge_over_rows=10.
    report = t.maintenance.maintain(
        MaintenancePolicy(merge_over_generations=2, merge_over_rows=10, gc=False)
    )
    assert [(m.region_id, m.generation) for m in report.merged] == [(odd.region_id, 1)]
    assert "20 unmerged rows > 10" in "\n".join(report.lines())
    assert not report.collected and not any("remove" in x for x in report.lines())
    even.close()
    odd.close()


def test_pass_collects_and_a_quiet_pass_commits_nothing(tmp_path: Any) -> None:
    t = _table(tmp_path)
    w = _writer(t, 0)
    for i in range(3):
        w.put(basic_rows([2 * i], val=[100.0 + i]))
        w.flush()
    before = _state(t)
    report = t.maintenance.maintain(NOW)
    assert report.gc_paths and all(
        paths.region_dir(t.uri, w.region_id) in p for p in report.gc_paths
    )
    assert _gen_dirs(t) == set()  # merged, caught up, no old version left: all collected
    assert _state(t) == before == _base_state(t.uri)
    version = t.catalog.dataset().version
    quiet = t.maintenance.maintain(NOW)
    assert (quiet.regions, quiet.merged, quiet.catch_up, quiet.gc_paths) == ([], [], [], [])
    assert not quiet.snapshots_refreshed
    assert t.catalog.dataset().version == version  # nothing to do: nothing committed
    # A generation flushed now is the only work of the next pass.
    w.put(basic_rows([1000]))
    w.flush()
    assert [r.generations for r in t.maintenance.maintain(NOW, dry_run=True).regions] == [[4]]
    w.close()


def test_failed_step_does_not_stop_the_others(tmp_path: Any, monkeypatch: Any) -> None:
    t = _table(tmp_path)
    w = _flushed(t, 0, [2])
    t.maintenance.maintain(NOW)  # generation 1 merged, indexed, collected
    w.put(basic_rows([4]))
    w.flush()
    from memwal_query.maintain import catchup

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk on fire")

    monkeypatch.setattr(catchup, "catch_up_indexes", broken)
    with pytest.raises(MaintenanceFailedError, match="catch up: OSError: disk on fire") as e:
        t.maintenance.maintain(NOW)
    report = e.value.report
    assert [m.generation for m in report.merged] == [2]  # merged before the failure
    assert report.snapshots_refreshed and not report.ok
    assert "failed: catch up: OSError: disk on fire" in report.lines()
    assert indexes_behind(t.catalog) == ["name_idx"]
    # GC ran after the failed step, and kept what the index does not cover yet.
    assert {n.rsplit("_", 1)[1] for n in _gen_dirs(t)} == {"2"}
    monkeypatch.undo()
    assert t.maintenance.maintain(NOW).catch_up == ["name_idx"]
    assert _gen_dirs(t) == set()
    w.close()


# -- concurrency: pause the maintainer at every storage access ----------------------------
class _Stepper:
    """Pauses one thread at each storage access it makes, until told to go on."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.tid: int | None = None
        self.paused = threading.Event()
        self.resume = threading.Event()
        self.where = ""
        self.locked = False  # the paused thread holds the table's index lock
        self.done = False

    def hit(self, what: str) -> None:
        if threading.get_ident() != self.tid:
            return
        self.where = what
        self.locked = bool(getattr(locking._held, self.uri, 0))
        self.resume.clear()
        self.paused.set()
        assert self.resume.wait(120)

    def steps(self) -> Iterator[str]:
        """Yields at each pause (the thread waits) until the thread is done."""
        while True:
            assert self.paused.wait(120)
            self.paused.clear()
            if self.done:
                return
            yield self.where
            self.resume.set()


@pytest.fixture
def stepper(monkeypatch: Any) -> dict[str, _Stepper]:
    box: dict[str, _Stepper] = {}

    def hook(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            s = box.get("s")
            if s is not None:
                s.hit(f"{getattr(owner, '__name__', owner)}.{name}")
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)

    for name in (
        "read",
        "write",
        "put_if_not_exists",
        "exists",
        "list",
        "is_dir",
        "size",
        "delete",
        "delete_tree",
    ):
        hook(LocalFileIO, name)
    hook(lance, "dataset")
    for name in (
        "checkout_version",
        "to_table",
        "scanner",
        "count_rows",
        "cleanup_old_versions",
        "commit",
    ):
        hook(lance.LanceDataset, name)
    lance_dataset = sys.modules["lance.dataset"]
    hook(lance_dataset.MergeInsertBuilder, "execute")
    hook(lance_dataset.DatasetOptimizer, "optimize_indices")
    hook(lance_dataset.DatasetOptimizer, "compact_files")
    hook(Compaction, "plan")
    hook(CompactionTask, "execute")
    hook(Compaction, "commit")
    return box


_MUTATING = {
    "write",
    "put_if_not_exists",
    "delete",
    "delete_tree",
    "execute",
    "optimize_indices",
    "compact_files",
    "cleanup_old_versions",
    "commit",
}


def _put(model: dict[int, float], w: Any, step: int) -> None:
    """A new key, an update and a delete in ``w``'s region, flushed; ``model`` follows."""
    parity = 0 if w.region_values == {"p": 0} else 1
    new, old = 1000 + 2 * step + parity, 2 * (step % 10) + parity
    w.put(basic_rows([new, old], val=[float(step), -float(step)]))
    gone = 2 * ((step + 5) % 10) + parity
    w.delete(pa.table({"id": pa.array([gone], pa.int64())}))
    w.flush()
    model.update({new: float(step), old: -float(step)})
    model.pop(gone, None)


@pytest.mark.slow
def test_paused_maintainer_loses_nothing_and_doubles_nothing(
    tmp_path: Any, stepper: dict[str, _Stepper]
) -> None:
    t = _table(tmp_path)
    model = {i: float(i) for i in range(20)}
    writers = [_writer(mq.MemWalTable.open(t.uri), p) for p in (0, 1)]
    for i, w in enumerate(writers):  # work for the paused maintainer
        _put(model, w, i)
    other = mq.MemWalTable.open(t.uri)
    paused_table = mq.MemWalTable.open(t.uri)
    s = _Stepper(t.uri)
    out: dict[str, Any] = {}

    def run() -> None:
        s.tid = threading.get_ident()
        try:
            # compact_fragments=0: it compacts the base table on every pass. Its writers
            # are alive, so the recover step would only read (one WAL check per region,
            # tests/test_acknowledged.py pauses it): abandoned_after=None keeps this
            # schedule of pauses on the merge, compaction, catch-up and GC steps.
            policy = dataclasses.replace(NOW, compact_fragments=0, abandoned_after=None)
            out["report"] = maintain(paused_table.catalog, policy)
        except BaseException as e:  # noqa: BLE001 - checked below
            out["error"] = e
        finally:
            s.done = True
            s.paused.set()

    stepper["s"] = s
    th = threading.Thread(target=run)
    th.start()
    ops: list[Callable[[int], None]] = []
    seen: dict[str, int] = {}

    def flush(i: int) -> None:
        _put(model, writers[i % 2], i)

    def read(i: int) -> None:
        assert _state(t) == model, f"reader at access {i}"

    def other_maintainer(i: int, everything: bool = False) -> None:
        if s.locked:  # it would wait for the paused maintainer's lock: flush instead
            return flush(i)
        # Its own retention window (the default) keeps the versions the paused one reads;
        # the paused one (retention 0) deletes everything it may, under its competitors.
        # It leaves catch-up and snapshots to the paused one, except right before the
        # paused one extends the indexes: there it catches up first.
        policy = MaintenancePolicy(
            merge_over_generations=0,
            catch_up=everything,
            refresh_snapshots=everything,
            compact_fragments=0 if everything else None,
        )
        maintain(other.catalog, policy)
        assert _state(t) == model, f"after another maintainer at access {i}"

    ops = [flush, read, other_maintainer]
    # Each flush and each other maintainer adds base versions, which the paused one's GC
    # then reads one by one (more accesses, more ops...): after ``budget`` accesses the
    # competitor is a reader, before each access that changes storage (a reader's
    # answer can change only there, so every state the maintainer leaves is read).
    budget = 30
    n = 0
    for where in s.steps():
        # the catch-up's index optimisation (after the compaction; the one right after
        # the merge extends the key index first)
        if where == "DatasetOptimizer.optimize_indices" and "Compaction.plan" in seen:
            flush(n)  # a merge for the other maintainer to make and index
            other_maintainer(n, everything=True)
            flush(n + 1)  # and snapshots left stale for the paused one to refresh
        elif n < budget:
            ops[n % 3](n)
        elif where.rsplit(".", 1)[1] in _MUTATING:
            read(n)
        seen[where] = seen.get(where, 0) + 1
        n += 1
    th.join(60)
    stepper.pop("s")
    if "error" in out:
        raise AssertionError(f"maintainer failed at access {n} ({s.where})") from out["error"]
    assert n > 30, seen  # it did touch storage that often
    assert {"MergeInsertBuilder.execute", "LocalFileIO.delete_tree"} <= set(seen), seen
    assert {"DatasetOptimizer.optimize_indices", "LanceDataset.commit"} <= set(seen), seen
    assert {"Compaction.plan", "CompactionTask.execute", "Compaction.commit"} <= set(seen), seen
    # Everything flushed gets merged; the base table then is the model, each key once.
    maintain(other.catalog, NOW)
    assert _state(t) == model
    assert _base_state(t.uri) == model
    assert indexes_behind(t.catalog) == [] and not snapshots_stale(t.catalog)
    for w in writers:
        w.close()


def _fragments(uri: str) -> int:
    return len(lance.dataset(uri).get_fragments())


@pytest.mark.slow
def test_compaction_and_key_index_keep_the_answer(tmp_path: Any) -> None:
    """Merges leave small fragments and an unindexed primary-key index behind; a pass
    compacts the base (over the policy's limit) and extends the key index; the answer,
    the merge progress and an older base version stay as they were."""
    t = _table(tmp_path)
    model = {i: float(i) for i in range(20)}
    keep = MaintenancePolicy(
        merge_over_generations=0, gc=False, retention=None, compact_fragments=None, catch_up=False
    )
    writers = [_writer(t, p) for p in (0, 1)]
    for step in range(4):
        _put(model, writers[step % 2], step)
        assert t.maintenance.maintain(keep).small_fragments == 0  # it did not look
    before = lance.dataset(t.uri)
    pinned = t.lookup(pa.array([0, 1, 1000], pa.int64()), columns=["id", "val"])
    merged = t.catalog.index().merged_generations()
    frags = _fragments(t.uri)
    assert frags > 3
    key_index = next(d.name for d in before.describe_indices() if d.field_names == ["id"])
    assert before.stats.index_stats(key_index)["num_unindexed_rows"] > 0

    compact = MaintenancePolicy(
        merge_over_generations=0, gc=False, retention=None, compact_fragments=2
    )
    dry = t.maintenance.maintain(compact, dry_run=True)
    assert dry.compact_due and dry.small_fragments == frags and not dry.compacted
    assert dry.extended == [key_index] and dry.catch_up == ["name_idx"]
    assert any("would compact" in line for line in dry.lines())
    assert lance.dataset(t.uri).version == before.version  # nothing changed

    report = t.maintenance.maintain(compact)
    assert report.compacted["fragments_removed"] == frags
    assert _fragments(t.uri) == report.compacted["fragments_added"] < frags
    assert report.extended == [key_index] and report.to_dict()["extended"] == [key_index]
    assert report.to_dict()["compact_due"] and report.to_dict()["compacted"] == report.compacted
    now = lance.dataset(t.uri)
    assert now.stats.index_stats(key_index)["num_unindexed_rows"] == 0
    assert t.catalog.index().merged_generations() == merged  # the MemWAL index carried over
    assert indexes_behind(t.catalog) == [] and _state(t) == model and _base_state(t.uri) == model
    # the version before compaction still reads as it did (until GC removes it)
    old = t.lookup(pa.array([0, 1, 1000], pa.int64()), columns=["id", "val"], as_of=before.version)
    assert old.sort_by("id").equals(pinned.sort_by("id"))
    # a quiet pass: few fragments, nothing unindexed, nothing committed
    quiet = t.maintenance.maintain(dataclasses.replace(compact, compact_fragments=frags))
    assert not quiet.compact_due and not quiet.extended
    assert lance.dataset(t.uri).version == now.version
    # new writes after compaction merge on top of it
    _put(model, writers[0], 7)
    t.maintenance.maintain(compact)
    assert _state(t) == model and _base_state(t.uri) == model
    for w in writers:
        w.close()


def _segments(uri: str, name: str) -> int:
    return next(len(d.segments) for d in lance.dataset(uri).describe_indices() if d.name == name)


def test_catch_up_merges_index_segments_over_the_limit(tmp_path: Any) -> None:
    t = _table(tmp_path)
    merge_only = MaintenancePolicy(
        merge_over_generations=0, catch_up=False, gc=False, retention=None, compact_fragments=None
    )
    for step in range(3):  # a delta segment per catch-up, as Lance adds to vector indexes
        _flushed(t, step % 2, [100 + step]).close()
        t.maintenance.maintain(merge_only)
        ds = lance.dataset(t.uri)
        ds.optimize.optimize_indices(index_names=["name_idx"], num_indices_to_merge=0)
    many = _segments(t.uri, "name_idx")
    assert many >= 3
    _flushed(t, 0, [200]).close()
    t.maintenance.maintain(dataclasses.replace(merge_only, catch_up=True, max_index_segments=many))
    assert _segments(t.uri, "name_idx") >= many  # not over the limit: left as they are
    _flushed(t, 1, [201]).close()
    t.maintenance.maintain(dataclasses.replace(merge_only, catch_up=True, max_index_segments=2))
    assert _segments(t.uri, "name_idx") == 1 and indexes_behind(t.catalog) == []
    got = lance.dataset(t.uri).to_table(filter="name = 'n201'", columns=["id"])
    assert got.column("id").to_pylist() == [201]  # through the merged index


# -- command line ----------------------------------------------------------------------------
def test_cli_maintain_dry_run_pass_json_and_watch(tmp_path: Any) -> None:
    t = _table(tmp_path)
    w = _flushed(t, 1, [101, 103])
    runner = CliRunner()
    res = runner.invoke(main, ["maintain", t.uri, "--dry-run", "--merge-over-generations", "0"])
    assert res.exit_code == 0, res.output
    assert f"{w.region_id}: would merge [1] (1 unmerged generations > 0)" in res.output
    assert "would refresh region snapshots" in res.output
    assert t.catalog.index().merged_generations() == {}
    res = runner.invoke(main, ["maintain", t.uri, "--merge-over-rows", "1", "--retention", "0s"])
    assert res.exit_code == 0, res.output
    assert f"{w.region_id}: merged [1] (2 unmerged rows > 1)" in res.output
    assert "merging" not in res.output  # no progress bar when not on a terminal
    assert "catch up indexes ['name_idx']" in res.output
    assert t.catalog.index().merged_generations() == {w.region_id: 1}
    res = runner.invoke(main, ["maintain", t.uri, "--watch", "0", "--max-passes", "2", "--json"])
    assert res.exit_code == 0, res.output
    passes = [json.loads(line) for line in res.output.splitlines()]
    assert len(passes) == 2 and all(p["regions"] == [] and p["errors"] == {} for p in passes)
    res = runner.invoke(main, ["maintain", t.uri, "--max-generations", "-1"])
    assert res.exit_code == 2 and "--max-generations" in res.output
    w.close()


def test_cli_watch_reports_a_failed_pass_and_goes_on(tmp_path: Any, monkeypatch: Any) -> None:
    t = _table(tmp_path)
    w = _flushed(t, 0, [2])
    from memwal_query.maintain import catchup

    calls: list[int] = []

    def flaky(table: Any, names: Any = None, max_segments: Any = None) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk on fire")
        return real(table, names, max_segments)

    real = catchup.catch_up_indexes
    monkeypatch.setattr(catchup, "catch_up_indexes", flaky)
    args = ["maintain", t.uri, "--merge-over-generations", "0", "--watch", "0", "--max-passes", "2"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output  # the last pass succeeded
    assert "failed: catch up: OSError: disk on fire" in res.output
    assert "catch up indexes ['name_idx']" in res.output and len(calls) == 2
    assert indexes_behind(t.catalog) == []
    calls.clear()  # fails once more: without --watch, the exit status is 1
    w.put(basic_rows([4]))
    w.flush()
    res = CliRunner().invoke(main, ["maintain", t.uri, "--merge-over-generations", "0"])
    assert res.exit_code == 1 and "failed: catch up: OSError: disk on fire" in res.output
    w.close()
