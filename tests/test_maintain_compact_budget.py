"""A maintenance pass compacts at most a row budget of the base table.

Real Lance tables with many small fragments (Lance's target lowered to 100 rows so a
plan has many tasks): a pass rewrites the fragments with the largest deleted share
first, up to ``max(compact_rewrite_rows, 2 x merged rows)``, commits those tasks alone,
and the next pass goes on; answers, the primary-key index and a concurrent commit stay
right.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import lance
import pytest
from lance.optimize import Compaction

import memwal_query as mq
from memwal_query.maintain import basefiles
from memwal_query.maintain.basefiles import read_cost
from memwal_query.maintain.policy import MaintenanceFailedError, MaintenancePolicy

from helpers import basic_rows, write_generation

TARGET = 100  # Lance's target rows per fragment in these tests
FRAGMENTS = 10

POLICY = MaintenancePolicy(
    merge_over_generations=0,
    gc=False,
    retention=None,
    compact_fragments=16,
    compact_rewrite_rows=300,
    catch_up=False,
    refresh_snapshots=False,
)


@pytest.fixture
def small_target(monkeypatch: Any) -> None:
    real = basefiles.compact_base
    monkeypatch.setattr(basefiles, "compact_base", functools.partial(real, target_rows=TARGET))


def _worn(tmp_path: Any) -> tuple[mq.MemWalTable, dict[int, float]]:
    """Ten 100-row fragments; one merged generation deletes 15% of each, 40% of the
    last one, and upserts one key (176 rows merged: budget max(300, 352) = 352)."""
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(FRAGMENTS * 100)), uri, max_rows_per_file=100)
    t = mq.MemWalTable.initialize(uri)
    model = {k: float(k) for k in range(FRAGMENTS * 100)}
    deletes = [f * 100 + i for f in range(FRAGMENTS) for i in range(40 if f == 9 else 15)]
    write_generation(t, model, {"bucket": 0}, [5_000], deletes, -1.0)
    return t, model


def _check(t: mq.MemWalTable, model: dict[int, float]) -> None:
    got = mq.MemWalTable.open(t.uri).to_table(columns=["id", "val"]).to_pylist()
    assert len({r["id"] for r in got}) == len(got), "a key twice"
    assert {r["id"]: r["val"] for r in got} == model
    base = lance.dataset(t.uri).to_table(columns=["id", "val"]).to_pylist()
    assert {r["id"]: r["val"] for r in base} == model  # everything is merged
    # the primary-key BTREE answers lookups of rewritten and untouched fragments
    ds = lance.dataset(t.uri)
    for key in (20, 555, 960, 999, 5_000, 3):
        plan = ds.scanner(filter=f"id = {key}", columns=["id", "val"]).explain_plan()
        assert "ScalarIndexQuery" in plan
        rows = ds.to_table(filter=f"id = {key}", columns=["id", "val"]).to_pylist()
        assert rows == ([{"id": key, "val": model[key]}] if key in model else [])


def test_pass_rewrites_up_to_the_budget_and_the_next_pass_goes_on(
    tmp_path: Any, small_target: None
) -> None:
    t, model = _worn(tmp_path)
    report = t.maintenance.maintain(POLICY)
    assert report.merged and report.compact_due
    done, left = report.compacted["fragments_removed"], report.compacted["fragments_left"]
    assert 0 < done < FRAGMENTS and done + left == FRAGMENTS
    assert f"{done} fragment(s) rewritten within 352 row(s), {left} left" in (
        report.compact_reason or ""
    )
    assert any("left for the next pass" in line for line in report.lines())
    cost = read_cost(t.catalog)
    # the 40% fragment went first; the 15% ones wait
    assert cost.worst_deleted_share == pytest.approx(0.15)
    assert cost.with_deletions == left
    _check(t, model)

    passes = 1
    while read_cost(t.catalog).with_deletions:
        report = t.maintenance.maintain(POLICY)
        passes += 1
        assert report.compact_due and not report.merged
        # within 300 rows: one task of two 100-row fragments (a second would be 400)
        assert report.compacted["fragments_removed"] == 2
        assert report.compacted["fragments_left"] == left - 2
        left = report.compacted["fragments_left"]
        _check(t, model)
        assert passes <= FRAGMENTS
    assert passes > 2  # bounded: more than one pass after the first
    assert not t.maintenance.maintain(POLICY).compact_due


def test_share_zero_compacts_everything_in_one_pass(tmp_path: Any, small_target: None) -> None:
    t, model = _worn(tmp_path)
    policy = dataclasses.replace(POLICY, compact_deleted_share=0.0, compact_rewrite_rows=None)
    report = t.maintenance.maintain(policy)
    assert report.compacted["fragments_left"] == 0
    assert report.compacted["fragments_removed"] == FRAGMENTS
    assert read_cost(t.catalog).with_deletions == 0
    _check(t, model)


def test_each_task_result_commits_on_its_own(tmp_path: Any) -> None:
    uri = str(tmp_path / "d")
    lance.write_dataset(basic_rows(range(800)), uri, max_rows_per_file=100)
    ds = lance.dataset(uri)
    ds.create_scalar_index("id", "BTREE")
    ds.delete("id % 100 < 20")
    options: Any = {"target_rows_per_fragment": TARGET, "materialize_deletions_threshold": 0.1}
    tasks = Compaction.plan(lance.dataset(uri), options).tasks
    assert len(tasks) > 2
    expect = {k for k in range(800) if k % 100 >= 20}
    for task in (tasks[-1], tasks[0]):  # one task per commit, out of plan order
        ds = lance.dataset(uri)
        Compaction.commit(ds, [task.execute(ds)], options)
        ds = lance.dataset(uri)
        assert set(ds.to_table(columns=["id"])["id"].to_pylist()) == expect
        assert ds.to_table(filter="id = 750")["id"].to_pylist() == [750]
        assert ds.to_table(filter="id = 10")["id"].to_pylist() == []
    left = [f for f in lance.dataset(uri).get_fragments() if f.metadata.deletion_file]
    assert len(left) == 800 // 100 - sum(len(t.fragments) for t in (tasks[0], tasks[-1]))


@pytest.mark.parametrize("retries", [None, 1])
def test_commit_landing_between_plan_and_commit(
    tmp_path: Any, small_target: None, monkeypatch: Any, retries: int | None
) -> None:
    t, model = _worn(tmp_path)
    t.maintenance.maintain(dataclasses.replace(POLICY, compact_fragments=None))  # merge only
    calls = []
    real = Compaction.commit

    def commit_after_a_merge(dataset: Any, rewrites: Any, options: Any = None) -> Any:
        calls.append(dataset.version)
        if len(calls) == 1:  # another process's merge lands first, on the planned fragments
            rows = basic_rows([950, 951, 7_000], val=[9.0, 9.0, 9.0])
            base = lance.dataset(t.uri)
            base.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(
                rows
            )
            lance.dataset(t.uri).delete("id = 960")
            model.update({950: 9.0, 951: 9.0, 7_000: 9.0})
            model.pop(960)
        return real(dataset, rewrites, options)

    monkeypatch.setattr(Compaction, "commit", staticmethod(commit_after_a_merge))
    policy = dataclasses.replace(POLICY, max_retries=retries)
    # Lance refuses the rewrite (its fragments changed since the plan): the step is
    # retried on the newer version, or, with one attempt, fails with nothing rewritten
    if retries == 1:
        with pytest.raises(MaintenanceFailedError) as failed:
            t.maintenance.maintain(policy)
        assert "conflict" in failed.value.report.errors["compact"].lower()
        assert len(calls) == 1
        assert read_cost(t.catalog).with_deletions == FRAGMENTS
    else:
        report = t.maintenance.maintain(policy)
        assert len(calls) == 2 and calls[1] > calls[0]
        assert report.compacted["fragments_removed"] == 2
    _check(t, model)
