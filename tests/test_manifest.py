import json
import multiprocessing as mp
import uuid

import pytest

from memwal_query.exceptions import FencedError, ManifestCorruptError
from memwal_query.format.manifest import FlushedGeneration, RegionManifestStore
from memwal_query.storage import paths
from memwal_query.storage.io import LocalFileIO, join


@pytest.fixture
def store(tmp_path):
    return RegionManifestStore(LocalFileIO(), str(tmp_path), str(uuid.uuid4()))


def test_claim_creates_then_increments(store):
    assert store.load_latest() is None
    m1 = store.claim()
    assert (m1.version, m1.writer_epoch, m1.current_generation) == (1, 1, 1)
    m2 = store.claim()
    assert (m2.version, m2.writer_epoch) == (2, 2)
    assert store.load_latest() == m2
    hint = json.loads(LocalFileIO().read(join(store.dir, "version_hint.json")))
    assert hint == {"version": 2}


def _bump(store, n):
    for _ in range(n):
        store.claim()


def test_stale_hint_probes_forward(store):
    _bump(store, 3)
    LocalFileIO().write(join(store.dir, "version_hint.json"), b'{"version": 1}')
    assert store.latest_version() == 3


def test_missing_hint_starts_at_one(store):
    _bump(store, 4)
    LocalFileIO().delete(join(store.dir, "version_hint.json"))
    assert store.latest_version() == 4


@pytest.mark.parametrize("garbage", [b"", b"{not json", b'{"version": "x"}', b"[1]"])
def test_corrupt_hint_is_ignored(store, garbage):
    _bump(store, 3)
    LocalFileIO().write(join(store.dir, "version_hint.json"), garbage)
    assert store.latest_version() == 3


def test_hint_past_the_end_falls_back_to_listing(store):
    _bump(store, 3)
    LocalFileIO().write(join(store.dir, "version_hint.json"), b'{"version": 99}')
    assert store.latest_version() == 3
    assert store.load_latest().version == 3


def test_garbage_manifest_is_a_typed_error(store):
    _bump(store, 2)
    LocalFileIO().write(store.path(2), b"\xff\x00garbage\x12\x99")
    with pytest.raises(ManifestCorruptError) as e:
        store.load_latest()
    assert store.path(2) in str(e.value)


def test_manifest_of_other_region_rejected(tmp_path):
    io = LocalFileIO()
    a = RegionManifestStore(io, str(tmp_path), str(uuid.uuid4()))
    b = RegionManifestStore(io, str(tmp_path), str(uuid.uuid4()))
    a.claim()
    b.claim()
    io.write(b.path(1), io.read(a.path(1)))
    with pytest.raises(ManifestCorruptError):
        b.load(1)


def test_traversal_in_generation_path_rejected(store):
    m = store.claim()
    bad = m.replace(
        version=2, flushed_generations=(FlushedGeneration(1, "../../../etc"),)
    ).to_proto()
    LocalFileIO().put_if_not_exists(store.path(2), bad.SerializeToString())
    with pytest.raises(ManifestCorruptError, match="generation path"):
        store.load_latest()


def test_commit_update_is_fenced(store):
    a = store.claim()
    b = store.claim()
    with pytest.raises(FencedError) as e:
        store.commit_update(a.writer_epoch, lambda m: m.replace(current_generation=9))
    assert (e.value.local_epoch, e.value.stored_epoch) == (1, 2)
    new = store.commit_update(b.writer_epoch, lambda m: m.replace(current_generation=9))
    assert (new.version, new.current_generation, new.writer_epoch) == (3, 9, 2)


def test_region_id_validation(tmp_path):
    with pytest.raises(Exception, match="not a UUID"):
        RegionManifestStore(LocalFileIO(), str(tmp_path), "../../evil")
    with pytest.raises(Exception, match="not a UUID"):
        paths.region_dir(str(tmp_path), "not-a-uuid")


def _claim(table_uri: str, region_id: str, barrier, results) -> None:
    store = RegionManifestStore(LocalFileIO(), table_uri, region_id)
    barrier.wait()
    m = store.claim(max_retries=100)
    results.put((m.version, m.writer_epoch))


def test_concurrent_claims_from_processes_reload_and_retry(tmp_path):
    """Racing claimers lose put-if-not-exists races, reload and retry: every claim ends
    with its own version and a distinct epoch, and versions have no gaps."""
    ctx = mp.get_context("forkserver")
    region = str(uuid.uuid4())
    RegionManifestStore(LocalFileIO(), str(tmp_path), region).claim()  # version 1, epoch 1
    n = 6
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_claim, args=(str(tmp_path), region, barrier, results)) for _ in range(n)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    claims = sorted(results.get(timeout=5) for _ in range(n))
    assert [v for v, _ in claims] == list(range(2, n + 2))
    assert [e for _, e in claims] == list(range(2, n + 2))  # epoch = previous + 1, no reuse
    store = RegionManifestStore(LocalFileIO(), str(tmp_path), region)
    assert store.load_latest().writer_epoch == n + 1
    for version in range(1, n + 2):
        assert store.load(version).writer_epoch == version
