"""A batch's deletes in a commit of their own, before the upsert commit with the progress.

On a large base (``SEPARATE_DELETE_MIN_BASE_ROWS``; set to 0 here so a small table takes
that path) a batch with upserts and deletes is two commits under the index lock. A merger
killed between them (``merge.between_commits``, a real process and SIGKILL) leaves a
base version whose answer is the model, and the next merge applies each delete once: a
key that a later generation writes again is present once afterwards.
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
def split(monkeypatch):
    monkeypatch.setattr(merger, "SEPARATE_DELETE_MIN_BASE_ROWS", 0)


def test_split_commits_equal_one_commit(base_uri, split):
    """Two regions, upserts and deletes: the deletes commit, then one commit with the
    upserts and both regions' progress; the same base table as the model."""
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
    assert lance.dataset(t.uri).version == before + 2
    assert t.catalog.index().merged_generations() == {regions[0]: 2, regions[1]: 1}
    assert base_view(t.uri) == model
    # the version between the two commits: progress not recorded, the answer the model
    middle = before + 1
    assert t.catalog.index(lance.dataset(t.uri, version=middle)).merged_generations() == {}
    mid = base_view(t.uri, middle)  # the deletes only: 4 deleted, then written again
    assert not {0, 5, 6, 7, 10} & set(mid) and mid[4] == 4.0 and 200 not in mid
    assert view(t, as_of=middle) == model
    assert view(t) == model


def test_merger_killed_between_the_commits(base_uri):
    t = expr_table(base_uri)
    model = {k: float(k) for k in range(100)}
    region = write_region(t, model, 0, [0, 2, 300], [4, 6, 8], 1.0)
    write_region(t, model, 1, [1, 301], [3, 5], 1.0)
    before = lance.dataset(t.uri).version
    p = kill_merger_at(t.uri, "merge.between_commits", SEPARATE_DELETE_MIN_BASE_ROWS=0)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stdout, p.stderr)
    # The deletes are committed, the upserts and the progress are not.
    assert lance.dataset(t.uri).version == before + 1
    assert t.catalog.index().merged_generations() == {}
    base = base_view(t.uri)
    assert not {3, 4, 5, 6, 8} & set(base) and 300 not in base and base[0] == 0.0
    # Every reader (fresh or reopened) answers the model from this state.
    assert view(t) == model
    assert view(mq.MemWalTable.open(t.uri)) == model
    got = t.lookup(pa.array([4, 6, 300, 0], pa.int64()), columns=["id", "val"])
    assert {r["id"]: r["val"] for r in got.to_pylist()} == {300: 1.0, 0: 1.0}
    # A later generation writes a deleted key again before the merge is done.
    write_region(t, model, 0, [4], [], 2.0)
    assert view(t) == model
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(merger, "SEPARATE_DELETE_MIN_BASE_ROWS", 0)
        merged = mq.MemWalTable.open(t.uri).maintenance.merge(
            batch_rows=0
        )  # generation by generation
    assert {1, 2} <= set(merged.by_region()[region])
    assert base_view(t.uri) == model  # each delete once: key 4 is back, once
    assert view(t) == model
    assert t.maintenance.merge().merged == []


def test_split_goes_on_a_moved_table_only_while_the_batch_is_unmerged(base_uri, split):
    """The deletes commit on the latest version when the table moved without merging the
    batch's regions; when their progress moved, the attempt is a lost race."""
    t = expr_table(base_uri)
    model = {k: float(k) for k in range(100)}
    region = write_region(t, model, 0, [0, 400], [2], 1.0)
    gens = t.catalog.region_manifest(region).flushed_generations
    ds = lance.dataset(t.uri)
    prep = merger.prepare_generation(t.catalog, region, gens, ds.schema)
    marker = [merger.CompactedSsTable(region, gens[-1].generation)]
    lance.dataset(t.uri).create_scalar_index("val", "BTREE")  # a commit of no merge
    moved = merger._commit_split(t.catalog, ds, ["id"], prep, marker)
    assert moved.version == ds.version + 2 and 2 not in base_view(t.uri)
    # another merger merges the region meanwhile: the planned batch is stale
    t.maintenance.merge()
    assert base_view(t.uri) == model
    with pytest.raises(merger._BatchMoved) as lost:
        merger._commit_split(t.catalog, ds, ["id"], prep, marker)
    assert merger._is_conflict(lost.value)
    assert base_view(t.uri) == model and view(t) == model
