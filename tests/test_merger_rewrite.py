"""A batch as one ``Update`` commit of the merger's own, then its progress marker.

On a large base (``REWRITE_MIN_BASE_ROWS``; set to 0 here so a small table takes that
path) with a single integer key, a batch with upserts is two commits under the index
lock: the rows (new fragments for the upserts, deletion files for the rows they replace
and for the deleted keys), then the marker. A merger killed between them
(``merge.between_commits``, a real process and SIGKILL) leaves a base version whose
answer is the model, and the next merge makes the base the model again, every key once.
"""

import signal

import lance
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.maintain import merger

from helpers import base_id_val, expr_table, id_val_view, kill_merger_at, write_region

# region r holds the keys k with k % 2 == r
view, base_view = id_val_view, base_id_val


@pytest.fixture
def rewrite(monkeypatch):
    monkeypatch.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)


def _lookup(uri, keys):
    """Rows of ``keys`` through the primary-key BTREE (checked to be used)."""
    ds = lance.dataset(uri)
    where = f"id IN ({', '.join(map(str, keys))})"
    assert "ScalarIndexQuery" in ds.scanner(filter=where).explain_plan()
    rows = ds.to_table(columns=["id", "val"], filter=where).to_pylist()
    return {r["id"]: r["val"] for r in rows}


def test_rewrite_commits_equal_the_model(base_uri, rewrite):
    """Two regions, upserts and deletes: one Update with both regions' rows, then one
    commit with both regions' progress; the base is the model, and the primary-key
    BTREE answers lookups of replaced, new and deleted keys, before and after it is
    extended."""
    lance.dataset(base_uri).create_scalar_index("id", "BTREE")
    t = expr_table(base_uri)
    model = {k: float(k) for k in range(100)}
    regions = [
        write_region(t, model, 0, [0, 2, 200], [4, 6], 1.0),
        write_region(t, model, 1, [1, 3, 201], [5, 7], 1.0),
    ]
    write_region(t, model, 0, [4, 8], [0, 10], 2.0)  # deleted key written again, and the reverse
    before = lance.dataset(t.uri).version
    merged = t.maintenance.merge()
    assert merged.by_region() == {regions[0]: [1, 2], regions[1]: [1]}
    assert merged.upserted == 7 and merged.deleted == 5
    assert lance.dataset(t.uri).version == before + 2
    assert t.catalog.index().merged_generations() == {regions[0]: 2, regions[1]: 1}
    assert base_view(t.uri) == model
    # the version between the two commits: every row applied, progress not recorded
    middle = before + 1
    assert t.catalog.index(lance.dataset(t.uri, version=middle)).merged_generations() == {}
    assert base_view(t.uri, middle) == model
    assert view(t, as_of=middle) == model
    assert view(t) == model
    probe = [0, 1, 2, 4, 5, 8, 10, 11, 200, 201, 999]
    want = {k: model[k] for k in probe if k in model}
    assert _lookup(t.uri, probe) == want
    lance.dataset(t.uri).optimize.optimize_indices(num_indices_to_merge=0)
    assert _lookup(t.uri, probe) == want


def test_rewrite_removes_an_emptied_fragment(base_uri, rewrite):
    """Every row of a base fragment replaced: the fragment goes, its rows are new."""
    t = expr_table(base_uri)
    model = {k: float(k) for k in range(100)}
    write_region(t, model, 0, list(range(0, 100, 2)), [], 3.0)
    write_region(t, model, 1, list(range(1, 100, 2)), [], 3.0)
    old = {f.fragment_id for f in lance.dataset(t.uri).get_fragments()}
    t.maintenance.merge()
    assert not old & {f.fragment_id for f in lance.dataset(t.uri).get_fragments()}
    assert base_view(t.uri) == model and view(t) == model


def test_rewrite_falls_back_on_a_wide_key_span(base_uri, rewrite, monkeypatch):
    """Keys spanning more than the join's bitmap may cover: one merge_insert commit."""
    monkeypatch.setattr(merger, "REWRITE_MAX_KEY_SPAN", 10)
    t = expr_table(base_uri)
    model = {k: float(k) for k in range(100)}
    write_region(t, model, 0, [0, 50, 300], [], 1.0)
    before = lance.dataset(t.uri).version
    t.maintenance.merge()
    assert lance.dataset(t.uri).version == before + 1
    assert base_view(t.uri) == model and view(t) == model


def test_merger_killed_between_the_rewrite_commits(base_uri):
    t = expr_table(base_uri)
    model = {k: float(k) for k in range(100)}
    region = write_region(t, model, 0, [0, 2, 300], [4, 6, 8], 1.0)
    write_region(t, model, 1, [1, 301], [3, 5], 1.0)
    before = lance.dataset(t.uri).version
    p = kill_merger_at(t.uri, "merge.between_commits", REWRITE_MIN_BASE_ROWS=0)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stdout, p.stderr)
    # The rows are committed, the progress is not.
    assert lance.dataset(t.uri).version == before + 1
    assert t.catalog.index().merged_generations() == {}
    assert base_view(t.uri) == model
    # Every reader (fresh or reopened) answers the model from this state.
    assert view(t) == model
    assert view(mq.MemWalTable.open(t.uri)) == model
    got = t.lookup(pa.array([4, 6, 300, 0], pa.int64()), columns=["id", "val"])
    assert {r["id"]: r["val"] for r in got.to_pylist()} == {300: 1.0, 0: 1.0}
    # A later generation writes a deleted key again before the merge is done.
    write_region(t, model, 0, [4, 300], [2], 2.0)
    assert view(t) == model
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(merger, "REWRITE_MIN_BASE_ROWS", 0)
        merged = mq.MemWalTable.open(t.uri).maintenance.merge(batch_rows=0)
    assert {1, 2} <= set(merged.by_region()[region])
    assert base_view(t.uri) == model  # the first commit's rows replaced, every key once
    assert view(t) == model
    assert t.maintenance.merge().merged == []


def test_rewrite_goes_on_a_moved_table_only_while_the_batch_is_unmerged(base_uri, rewrite):
    """The Update commits on the latest version when the table moved without merging
    the batch's regions; when their progress moved, the attempt is a lost race."""
    t = expr_table(base_uri)
    model = {k: float(k) for k in range(100)}
    region = write_region(t, model, 0, [0, 400], [2], 1.0)
    gens = t.catalog.region_manifest(region).flushed_generations
    ds = lance.dataset(t.uri)
    prep = merger.prepare_generation(t.catalog, region, gens, ds.schema)
    marker = [merger.CompactedSsTable(region, gens[-1].generation)]
    lance.dataset(t.uri).create_scalar_index("val", "BTREE")  # a commit of no merge
    assert merger._commit_rewrite(t.catalog, ds, ["id"], prep, marker)
    assert lance.dataset(t.uri).version == ds.version + 3
    assert base_view(t.uri) == model and view(t) == model
    # planned before that merge: the batch is stale
    with pytest.raises(merger._BatchMoved) as lost:
        merger._commit_rewrite(t.catalog, ds, ["id"], prep, marker)
    assert merger._is_conflict(lost.value)
    assert base_view(t.uri) == model and view(t) == model
