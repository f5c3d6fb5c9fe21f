"""A maintenance pass leaves the base table as cheap to read as before it.

- the merge of every due region in one commit (row and byte budgets);
- compaction decided by the read cost the merge leaves (fragments with deletion files,
  deleted-row share, small fragments), on real Lance tables;
- the primary-key BTREE extended in the same pass and by ``catch_up_indexes()``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import lance
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.maintain import basefiles, merger
from memwal_query.maintain.basefiles import ReadCost, compaction_reason, read_cost
from memwal_query.maintain.policy import MaintenancePolicy

from helpers import basic_rows, parity_spec, write_generation

MERGE_ONLY = MaintenancePolicy(
    merge_over_generations=0,
    gc=False,
    retention=None,
    compact_fragments=None,
    catch_up=False,
    refresh_snapshots=False,
)


def _table(tmp_path: Any, rows: int) -> mq.MemWalTable:
    uri = str(tmp_path / "t")
    lance.write_dataset(basic_rows(range(rows)), uri, max_rows_per_file=rows)
    return mq.MemWalTable.initialize(uri, region_spec=parity_spec(lance.dataset(uri)))


def _generation(t: mq.MemWalTable, parity: int, puts: list[int], deletes: list[int], model):
    write_generation(t, model, {"p": parity}, puts, deletes, -1.0)


def _state(t: mq.MemWalTable) -> dict[int, float]:
    got = mq.MemWalTable.open(t.uri).to_table(columns=["id", "val"]).to_pylist()
    assert len({r["id"] for r in got}) == len(got), "a key twice"
    return {r["id"]: r["val"] for r in got}


def _base(uri: str) -> dict[int, float]:
    got = lance.dataset(uri).to_table(columns=["id", "val"]).to_pylist()
    assert len({r["id"] for r in got}) == len(got), "a key twice in the base table"
    return {r["id"]: r["val"] for r in got}


def _key_index(uri: str) -> Any:
    return next(d for d in lance.dataset(uri).describe_indices() if d.field_names == ["id"])


def test_rule_by_read_cost() -> None:
    clean = ReadCost(4, 0, 4_000_000, 0, 0, 0, 0.0)
    assert compaction_reason(clean, 16, 0.1, 1_000) == (None, 0.1)
    # a merge left deletion files on 2M rows: rewritten when the pass merged >= 1M rows
    touched = ReadCost(4, 0, 4_000_000, 50_000, 2, 2_000_000, 0.05)
    assert compaction_reason(touched, 16, 0.1, 999_999)[0] is None
    reason, share = compaction_reason(touched, 16, 0.1, 1_000_000)
    assert reason is not None and "deletion files" in reason and share == 0.0
    # a fragment with a large deleted share: rewritten at the policy's share
    worn = ReadCost(4, 0, 4_000_000, 600_000, 2, 2_000_000, 0.3)
    assert compaction_reason(worn, 16, 0.1, 10) == (compaction_reason(worn, 16, 0.1, 10)[0], 0.1)
    assert "30%" in (compaction_reason(worn, 16, 0.1, 10)[0] or "")
    assert compaction_reason(worn, 16, None, 10)[0] is None
    # the floor: fragments with deletion files holding at most rewrite_rows rows are
    # rewritten whatever the pass merged; 0 and None leave only the rule by merged rows
    reason, share = compaction_reason(touched, 16, 0.1, 10, 2_000_000)
    assert reason == (
        "2 fragment(s) with deletion files, 2000000 row(s) <= compact_rewrite_rows 2000000"
    )
    assert share == 0.0
    assert compaction_reason(touched, 16, 0.1, 10, 1_999_999)[0] is None
    assert compaction_reason(touched, 16, 0.1, 10, 0)[0] is None
    assert compaction_reason(touched, 16, 0.1, 10, None)[0] is None
    assert "2 x 1000000 merged" in (compaction_reason(touched, 16, 0.1, 1_000_000, 10)[0] or "")
    small = ReadCost(20, 17, 20_000, 0, 0, 0, 0.0)
    assert "17 small" in (compaction_reason(small, 16, 0.1, 0)[0] or "")
    with pytest.raises(ValueError, match="compact_deleted_share"):
        MaintenancePolicy(compact_deleted_share=1.5)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="compact_rewrite_rows"):
            MaintenancePolicy(compact_rewrite_rows=bad)  # type: ignore[arg-type]


def test_deletion_files_spread_over_a_large_base_are_kept() -> None:
    # What a pass leaves on a 10M-row base after 1M upserts and 50k deletes at random
    # keys: every base fragment carries a deletion file with ~8.5% of its rows deleted,
    # and the merged rows have their own fragment. Rewriting all ten costs many times
    # the merge: the defaults keep them until a fragment passes the deleted share.
    merged = 1_000_000 + 50_000
    spread = ReadCost(11, 6, 10_998_089, 846_040, 10, 10_000_000, 0.0853)
    assert compaction_reason(spread, 16, 0.1, merged, 2_000_000) == (None, 0.1)
    # the next pass of the same size pushes a fragment past the share: rewritten then
    # (within the pass's budget, the most deleted fragments first)
    worn = ReadCost(12, 7, 11_998_089, 1_700_000, 11, 11_000_000, 0.17)
    reason, share = compaction_reason(worn, 16, 0.1, merged, 2_000_000)
    assert reason is not None and "17%" in reason and share == 0.1
    # touched fragments that hold few rows against the merge are rewritten at once
    local = ReadCost(11, 6, 10_998_089, 846_040, 2, 2_000_000, 0.42)
    reason, share = compaction_reason(local, 16, 0.1, merged, 2_000_000)
    assert reason is not None and "deletion files" in reason and share == 0.0


def test_pass_merges_every_region_in_one_commit_and_rewrites_what_it_touched(
    tmp_path: Any,
) -> None:
    t = _table(tmp_path, 200)
    model = {k: float(k) for k in range(200)}
    for g in range(3):  # both regions, upserts and deletes in each generation
        _generation(t, 0, [2 * g, 300 + 2 * g], [100 + 2 * g], model)
        _generation(t, 1, [2 * g + 1, 301 + 2 * g], [101 + 2 * g], model)
    before = lance.dataset(t.uri).version
    report = t.maintenance.maintain(MERGE_ONLY)
    assert len(report.merged) == 6
    assert lance.dataset(t.uri).version == before + 1  # one commit for both regions
    cost = read_cost(t.catalog)
    assert cost.with_deletions == 1 and cost.deleted == 12  # 6 updated, 6 deleted
    assert _state(t) == model
    # the merge touched a 200-row fragment: more than 2x the 18 rows merged, left as is
    # by the rule by merged rows alone (the default floor rewrites it: see below)
    policy = dataclasses.replace(MERGE_ONLY, compact_fragments=16, compact_rewrite_rows=None)
    report = t.maintenance.maintain(policy)
    assert not report.compact_due and read_cost(t.catalog).with_deletions == 1

    # a bigger pass (120 keys) rewrites them: reads get back to files without deletions
    merged = t.catalog.index().merged_generations()
    _generation(t, 0, list(range(0, 240, 2)), [], model)
    report = t.maintenance.maintain(policy)
    assert report.compact_due and "deletion files" in (report.compact_reason or "")
    assert report.compacted["fragments_removed"] >= 1
    assert any("deletion files" in line for line in report.lines())
    cost = read_cost(t.catalog)
    assert cost.with_deletions == 0 and cost.deleted == 0
    assert _state(t) == model and _base(t.uri) == model
    assert t.catalog.index().merged_generations() != merged  # the merge's progress carried over


def _touched(tmp_path: Any, policy: MaintenancePolicy) -> tuple[mq.MemWalTable, Any]:
    # one updated and one deleted key of a 200-row fragment: 1% deleted rows (below
    # Lance's 10%, which Lance's filtered scans already pay ~2x for), 200 rows in the
    # fragment, more than twice the 3 rows merged
    t = _table(tmp_path, 200)
    model = {k: float(k) for k in range(200)}
    _generation(t, 0, [4, 500], [6], model)
    report = t.maintenance.maintain(policy)
    assert report.merged and _state(t) == model and _base(t.uri) == model
    return t, report


def test_default_pass_rewrites_deletion_files_below_the_floor(tmp_path: Any) -> None:
    policy = dataclasses.replace(MERGE_ONLY, compact_fragments=16)
    assert (policy.compact_deleted_share, policy.compact_rewrite_rows) == (0.1, 2_000_000)
    t, report = _touched(tmp_path / "default", policy)
    assert report.compact_due
    assert report.compact_reason == (
        "1 fragment(s) with deletion files, 200 row(s) <= compact_rewrite_rows 2000000"
    )
    cost = read_cost(t.catalog)
    assert cost.with_deletions == 0 and cost.deleted == 0
    # nothing left to rewrite: the next pass does not compact again
    assert not t.maintenance.maintain(policy).compact_due

    # without the floor the same pass leaves the deletion file (1% < 10%, 200 > 2 x 3)
    for rows in (None, 0, 199):
        none = dataclasses.replace(policy, compact_rewrite_rows=rows)
        t, report = _touched(tmp_path / f"floor{rows}", none)
        assert not report.compact_due and read_cost(t.catalog).with_deletions == 1
    # with compact_deleted_share=0.0 every fragment with a deletion file, any size
    zero = dataclasses.replace(policy, compact_deleted_share=0.0, compact_rewrite_rows=None)
    t, report = _touched(tmp_path / "zero", zero)
    assert report.compact_due and read_cost(t.catalog).with_deletions == 0
    assert "1 fragment(s) with deletion files (2 deleted of 200 rows)" in (
        report.compact_reason or ""
    )


def test_pass_rewrites_fragments_with_many_deleted_rows(tmp_path: Any) -> None:
    t = _table(tmp_path, 100)
    model = {k: float(k) for k in range(100)}
    _generation(t, 0, [1000], list(range(0, 60, 2)), model)  # 30% of the base deleted
    policy = dataclasses.replace(MERGE_ONLY, compact_fragments=16, compact_rewrite_rows=None)
    report = t.maintenance.maintain(policy)
    assert report.compact_due and "30% deleted rows > 10%" in (report.compact_reason or "")
    assert read_cost(t.catalog).deleted == 0
    assert _state(t) == model and _base(t.uri) == model


def test_key_index_extended_by_the_pass_and_by_catch_up(tmp_path: Any) -> None:
    t = _table(tmp_path, 100)
    model = {k: float(k) for k in range(100)}
    name = _key_index(t.uri).name
    _generation(t, 0, [0, 500], [2], model)
    t.maintenance.merge()
    ds = lance.dataset(t.uri)
    assert ds.stats.index_stats(name)["num_unindexed_rows"] > 0
    t.maintenance.catch_up_indexes()  # no names: the primary-key BTREE too
    ds = lance.dataset(t.uri)
    assert ds.stats.index_stats(name)["num_unindexed_rows"] == 0
    assert len(_key_index(t.uri).segments) == 2  # a delta segment for the new rows
    for g in range(5):  # segments are merged into one above the policy's limit (4)
        _generation(t, 1, [1001 + 2 * g], [], model)
        t.maintenance.maintain(dataclasses.replace(MERGE_ONLY, catch_up=True))
        assert lance.dataset(t.uri).stats.index_stats(name)["num_unindexed_rows"] == 0
        assert len(_key_index(t.uri).segments) <= 4
    got = t.lookup(pa.array([500, 1009, 2], pa.int64()), columns=["id", "val"]).to_pylist()
    assert {r["id"]: r["val"] for r in got} == {500: -1.0, 1009: -1.0}
    assert _state(t) == model


def test_key_index_covers_the_merged_rows_when_the_compaction_starts(
    tmp_path: Any, monkeypatch: Any
) -> None:
    t = _table(tmp_path, 100)
    model = {k: float(k) for k in range(100)}
    name = _key_index(t.uri).name
    _generation(t, 0, [0, 4, 500, 502], [2], model)
    unindexed: list[int] = []
    real = basefiles.compact_base

    def compact(table: Any, *args: Any, **kwargs: Any) -> Any:
        unindexed.append(lance.dataset(t.uri).stats.index_stats(name)["num_unindexed_rows"])
        return real(table, *args, **kwargs)

    monkeypatch.setattr(basefiles, "compact_base", compact)
    policy = dataclasses.replace(
        MERGE_ONLY, compact_fragments=16, compact_deleted_share=0.0, catch_up=True
    )
    report = t.maintenance.maintain(policy)
    assert report.merged and report.compacted and not report.errors
    assert unindexed == [0]  # extended right after the merge
    assert report.extended == [name]
    assert lance.dataset(t.uri).stats.index_stats(name)["num_unindexed_rows"] == 0
    got = t.lookup(pa.array([500, 4, 2], pa.int64()), columns=["id", "val"]).to_pylist()
    assert {r["id"]: r["val"] for r in got} == {500: -1.0, 4: -1.0}
    assert _state(t) == model == _base(t.uri)


def test_budget_splits_regions_into_commits(tmp_path: Any, monkeypatch: Any) -> None:
    t = _table(tmp_path, 100)
    model = {k: float(k) for k in range(100)}
    _generation(t, 0, [0, 2], [4], model)
    _generation(t, 1, [1, 3], [5], model)
    sizes = {
        g.in_memory_bytes
        for r in t.catalog.region_ids()
        for g in t.catalog.region_manifest(r).flushed_generations
    }
    assert all(sizes)
    before = lance.dataset(t.uri).version
    merger.merge(t.catalog, batch_bytes=min(sizes))  # one region's generation per commit
    assert lance.dataset(t.uri).version == before + 2
    assert _state(t) == model and _base(t.uri) == model


def test_cli_compact_deleted_share_and_rewrite_rows(tmp_path: Any) -> None:
    import json

    from click.testing import CliRunner

    from memwal_query.cli.commands import main

    t = _table(tmp_path, 100)
    model = {k: float(k) for k in range(100)}
    _generation(t, 0, [0], [2], model)  # 2% of the base fragment deleted
    t.maintenance.maintain(MERGE_ONLY)
    args = ["maintain", t.uri, "--dry-run", "--json", "--merge-over-generations", "0"]

    def report(*more: str) -> dict[str, Any]:
        out = CliRunner().invoke(main, [*args, *more])
        assert out.exit_code == 0, out.output
        return json.loads(out.output)

    default = report()  # the 100-row fragment is below the default floor
    assert default["compact_due"]
    assert "100 row(s) <= compact_rewrite_rows 2000000" in default["compact_reason"]
    assert report("--compact-rewrite-rows", "100")["compact_due"]
    assert not report("--compact-rewrite-rows", "99")["compact_due"]
    assert not report("--compact-rewrite-rows", "0")["compact_due"]  # 2% < 10%
    every = report("--compact-rewrite-rows", "0", "--compact-deleted-share", "0")
    assert every["compact_due"] and "with deletion files (" in every["compact_reason"]
    half = report("--compact-rewrite-rows", "0", "--compact-deleted-share", "0.01")
    assert half["compact_due"] and "2% deleted rows > 1%" in half["compact_reason"]
    assert CliRunner().invoke(main, [*args, "--compact-deleted-share", "2"]).exit_code == 2
    assert CliRunner().invoke(main, [*args, "--compact-rewrite-rows", "-1"]).exit_code == 2
