import multiprocessing as mp
import os

import pytest

from memwal_query.exceptions import AlreadyExistsError, ObjectNotFoundError
from memwal_query.storage.io import LocalFileIO, join


def _race(path: str, payload: bytes, barrier, results) -> None:
    io = LocalFileIO()
    barrier.wait()
    try:
        io.put_if_not_exists(path, payload)
        results.put(("won", payload[:8]))
    except AlreadyExistsError:
        results.put(("lost", payload[:8]))


@pytest.mark.slow  # forkserver processes that each import lance: ~13-30 s of wall time
def test_put_if_not_exists_one_winner_across_processes(tmp_path):
    ctx = mp.get_context("forkserver")
    n = 8
    for round_ in range(3):
        path = str(tmp_path / f"race-{round_}.bin")
        barrier = ctx.Barrier(n)
        results = ctx.Queue()
        # Large payloads make a partial write observable if the put were not atomic.
        payloads = [bytes([i]) * 8 + os.urandom(2_000_000) for i in range(n)]
        procs = [ctx.Process(target=_race, args=(path, p, barrier, results)) for p in payloads]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        outcomes = [results.get(timeout=5) for _ in range(n)]
        winners = [o for o in outcomes if o[0] == "won"]
        assert len(winners) == 1
        data = LocalFileIO().read(path)
        assert data in payloads  # whole, never partial or mixed
        assert data[:8] == winners[0][1]
        assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_basic_operations(tmp_path):
    io = LocalFileIO()
    path = join(str(tmp_path), "a/b/c.bin")
    assert not io.exists(path)
    with pytest.raises(ObjectNotFoundError):
        io.read(path)
    io.put_if_not_exists(path, b"one")
    assert io.read(path) == b"one"
    assert io.size(path) == 3
    with pytest.raises(AlreadyExistsError):
        io.put_if_not_exists(path, b"two")
    assert io.read(path) == b"one"
    io.write(path, b"three")  # overwrite is allowed with write()
    assert io.read(path) == b"three"
    assert io.list(join(str(tmp_path), "a/b")) == ["c.bin"]
    assert io.list(join(str(tmp_path), "missing")) == []
    assert io.tree_size(join(str(tmp_path), "a")) == 5
    io.delete(path)
    io.delete(path)  # idempotent
    assert not io.exists(path)
    io.delete_tree(join(str(tmp_path), "a"))
    assert not io.exists(join(str(tmp_path), "a"))


def test_file_uri(tmp_path):
    io = LocalFileIO(fsync=False)
    path = "file://" + str(tmp_path / "x.bin")
    io.put_if_not_exists(path, b"x")
    assert io.read(path) == b"x"
    assert (tmp_path / "x.bin").read_bytes() == b"x"


def test_local_read_of_empty_large_missing_and_directory_paths(tmp_path):
    from memwal_query.exceptions import StorageError

    io = LocalFileIO(fsync=False)
    big = os.urandom(3 << 20)  # more than one read call's worth on some systems
    for name, data in (("empty", b""), ("small", b"x" * 7), ("big", big)):
        path = join(str(tmp_path), name)
        io.write(path, data)
        assert io.read(path) == data
    with pytest.raises(ObjectNotFoundError):
        io.read(join(str(tmp_path), "missing"))
    with pytest.raises(StorageError, match="directory"):
        io.read(str(tmp_path))
