"""bloom_filter.bin is byte-identical to the one pylance's native MemWAL writes."""

import glob
import os
import uuid

import lance
import numpy as np
import pyarrow as pa
import pytest

from memwal_query.format import bloom

from helpers import PK

CASES = {
    "int64": (pa.int64(), [1, 2, 3, -7, 2**40]),
    "int32": (pa.int32(), [5, -5, 0]),
    "utf8": (pa.string(), ["", "a", "héllo", "x" * 70]),
    "binary": (pa.binary(), [b"", b"\x00\xff", b"abc" * 20]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_same_bytes_as_native(tmp_path, name):
    key_type, keys = CASES[name]
    schema = pa.schema([pa.field("k", key_type, False, PK), pa.field("v", pa.int64())])
    uri = str(tmp_path / "t")
    lance.write_dataset(pa.table({"k": pa.array(keys[:1], key_type), "v": [0]}, schema=schema), uri)
    ds = lance.dataset(uri)
    ds.initialize_mem_wal()
    with ds.mem_wal_writer(str(uuid.uuid4())) as w:
        w.put(pa.table({"k": pa.array(keys, key_type), "v": list(range(len(keys)))}, schema=schema))
    (path,) = glob.glob(os.path.join(uri, "_mem_wal", "*", "*_gen_*", "bloom_filter.bin"))
    native = open(path, "rb").read()
    ours = bloom.build(pa.table({"k": pa.array(keys, key_type)}))
    assert ours == native
    bf = bloom.BloomFilter.from_bytes(native)
    assert bf.might_contain(pa.table({"k": pa.array(keys, key_type)})).all()


def test_composite_key_same_bytes_as_native(tmp_path):
    schema = pa.schema(
        [pa.field("a", pa.int32(), False, PK), pa.field("b", pa.string(), False, PK)]
    )
    data = pa.table({"a": [1, 1, 2], "b": ["x", "y", "x"]}, schema=schema)
    uri = str(tmp_path / "t")
    lance.write_dataset(data.slice(0, 1), uri)
    ds = lance.dataset(uri)
    ds.initialize_mem_wal()
    with ds.mem_wal_writer(str(uuid.uuid4())) as w:
        w.put(data)
    (path,) = glob.glob(os.path.join(uri, "_mem_wal", "*", "*_gen_*", "bloom_filter.bin"))
    assert bloom.build(data) == open(path, "rb").read()


def test_false_positive_rate_and_no_false_negatives():
    present = pa.table({"k": pa.array(np.arange(0, 200_000, 2), pa.int64())})
    absent = pa.table({"k": pa.array(np.arange(1, 200_000, 2), pa.int64())})
    bf = bloom.BloomFilter.from_bytes(bloom.build(present))
    assert bf.might_contain(present).all()
    assert bf.might_contain(absent).mean() < 0.01


def test_siphash_matches_reference():
    import struct

    mask = (1 << 64) - 1

    def rotl(x, b):
        return ((x << b) | (x >> (64 - b))) & mask

    def ref(data: bytes) -> int:  # SipHash-1-3, keys (0, 0), a straight transcription
        v0, v1, v2, v3 = (
            0x736F6D6570736575,
            0x646F72616E646F6D,
            0x6C7967656E657261,
            0x7465646279746573,
        )

        def rnd(v0, v1, v2, v3):
            v0 = (v0 + v1) & mask
            v1 = rotl(v1, 13) ^ v0
            v0 = rotl(v0, 32)
            v2 = (v2 + v3) & mask
            v3 = rotl(v3, 16) ^ v2
            v0 = (v0 + v3) & mask
            v3 = rotl(v3, 21) ^ v0
            v2 = (v2 + v1) & mask
            v1 = rotl(v1, 17) ^ v2
            v2 = rotl(v2, 32)
            return v0, v1, v2, v3

        n = len(data)
        end = n - n % 8
        for i in range(0, end, 8):
            m = struct.unpack_from("<Q", data, i)[0]
            v3 ^= m
            v0, v1, v2, v3 = rnd(v0, v1, v2, v3)
            v0 ^= m
        b = (n & 0xFF) << 56
        for j, c in enumerate(data[end:]):
            b |= c << (8 * j)
        v3 ^= b
        v0, v1, v2, v3 = rnd(v0, v1, v2, v3)
        v0 ^= b
        v2 ^= 0xFF
        for _ in range(3):
            v0, v1, v2, v3 = rnd(v0, v1, v2, v3)
        return v0 ^ v1 ^ v2 ^ v3

    msgs = [b"", b"a", b"abcdefgh", b"abcdefghi", bytes(range(40))]
    width = 48
    mat = np.zeros((len(msgs), width), np.uint8)
    for i, m in enumerate(msgs):
        mat[i, : len(m)] = list(m)
    got = bloom.siphash13(mat, np.array([len(m) for m in msgs]))
    assert [int(x) for x in got] == [ref(m) for m in msgs]


@pytest.mark.parametrize("key_type", [pa.string(), pa.binary()])
def test_one_long_key_costs_its_own_bytes_only(key_type):
    """Keys are not padded to the longest one (a 50 KB key must not cost rows x 50 KB)."""
    import tracemalloc

    n, long_len = 2000, 50_000
    short = [f"k{i}" for i in range(n - 1)]
    values = short + ["x" * long_len]
    if key_type == pa.binary():
        values = [v.encode() for v in values]
    keys = pa.table({"k": pa.array(values, key_type)})
    tracemalloc.start()
    try:
        data = bloom.build(keys)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * 1024 * 1024, peak  # padded: n x 50 KB = 100 MB (several copies)
    # Same hashes as hashing each key on its own (the padded, single-length path).
    each = np.concatenate([bloom.hash_keys(keys.slice(i, 1)) for i in (0, 1, n - 2, n - 1)])
    assert (bloom.hash_keys(keys)[[0, 1, n - 2, n - 1]] == each).all()
    bf = bloom.BloomFilter.from_bytes(data)
    assert bf.might_contain(keys).all()


def test_mixed_length_composite_keys_hash_like_single_rows():
    keys = pa.table(
        {
            "a": pa.array([1, None, 3, 4, 5], pa.int32()),
            "b": pa.array(["", "y" * 9, None, "z" * 300, "w" * 17], pa.string()),
            "c": pa.array([b"\x00", b"", b"q" * 70, None, b"r"], pa.binary()),
        }
    )
    each = np.concatenate([bloom.hash_keys(keys.slice(i, 1)) for i in range(keys.num_rows)])
    assert (bloom.hash_keys(keys) == each).all()
    assert (bloom.hash_keys(keys.slice(1, 3)) == each[1:4]).all()  # sliced arrays


def _random_column(rng: np.random.Generator, kind: str, n: int) -> pa.Array:
    nulls = rng.random(n) < 0.2
    if kind == "int32":
        vals = rng.integers(-(2**31), 2**31, n).tolist()
        typ = pa.int32()
    elif kind == "int64":
        vals = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64).tolist()
        vals[0] = int(rng.choice([0, -1, 2**63 - 1, -(2**63)]))
        typ = pa.int64()
    elif kind == "utf8":
        alphabet = ["a", "é", "\u4e2d", "\U0001f600", "'", "\x00"]
        vals = ["".join(rng.choice(alphabet, int(rng.integers(0, 40)))) for _ in range(n)]
        typ = pa.string()
    elif kind == "binary":
        vals = [rng.bytes(int(rng.integers(0, 80))) for _ in range(n)]
        typ = pa.binary()
    elif kind == "float64":  # hashed by its null flag only, like pylance
        vals = rng.standard_normal(n).tolist()
        typ = pa.float64()
    else:  # timestamp: flag only as well
        vals = rng.integers(0, 2**40, n).tolist()
        typ = pa.timestamp("us")
    return pa.array([None if z else v for v, z in zip(vals, nulls)], typ)


def test_small_batch_hashes_match_vectorised_path():
    """Up to SMALL_BATCH keys are hashed with Python ints: same bits as numpy's path,
    for every key type and length, composite keys, NULLs, slices and chunks."""
    rng = np.random.default_rng(99)
    kinds = ["int32", "int64", "utf8", "binary", "float64", "timestamp"]
    checked = 0
    for trial in range(300):
        ncols = int(rng.integers(1, 5))
        n = int(rng.integers(1, bloom.SMALL_BATCH + 1))
        pad = int(rng.integers(0, 3))
        cols = {}
        for j in range(ncols):
            col = _random_column(rng, str(rng.choice(kinds)), n + 2 * pad)
            cols[f"c{j}"] = col.slice(pad, n)  # arrays with an offset
        keys = pa.table(cols)
        if trial % 3 == 0:  # chunked columns
            keys = pa.concat_tables([keys.slice(0, n // 2), keys.slice(n // 2)])
        fast = bloom.hash_keys(keys)
        assert fast.dtype == np.uint64
        assert fast.tolist() == bloom.hash_keys_vectorised(keys).tolist()
        checked += n
    assert checked > 1000
    # a single long key of each kind, across 8-byte word boundaries
    for length in range(0, 70):
        for typ, val in ((pa.string(), "x" * length), (pa.binary(), b"\xff" * length)):
            keys = pa.table({"k": pa.array([val], typ)})
            assert bloom.hash_keys(keys).tolist() == bloom.hash_keys_vectorised(keys).tolist()


def test_small_batch_might_contain_matches_vectorised_path():
    rng = np.random.default_rng(4)
    bf = bloom.BloomFilter.empty(3000)
    present = rng.integers(0, 2**64, 3000, dtype=np.uint64)
    bf.insert_hashes(present)
    for _ in range(400):
        n = int(rng.integers(1, bloom.SMALL_BATCH + 1))
        h = rng.integers(0, 2**64, n, dtype=np.uint64)
        h[: n // 2] = rng.choice(present, n // 2)
        block, masks = bf._positions(h)
        expected = np.all((bf.words[block] & masks) == masks, axis=1)
        assert bf.might_contain_hashes(h).tolist() == expected.tolist()
    assert bf.might_contain_hashes(present[:5]).all()


def test_chunked_hashing_equals_one_vectorised_pass():
    """Batches above HASH_CHUNK_ROWS are hashed chunk by chunk: same hashes."""
    rng = np.random.default_rng(5)
    n = bloom.HASH_CHUNK_ROWS * 2 + 7
    words = ["x" * int(k) for k in rng.integers(0, 40, n)]
    keys = pa.table({"a": pa.array(rng.integers(-(2**40), 2**40, n)), "s": pa.array(words)})
    assert np.array_equal(bloom.hash_keys(keys), bloom.hash_keys_vectorised(keys))
    assert np.array_equal(bloom.hash_keys(keys.slice(3)), bloom.hash_keys_vectorised(keys)[3:])
