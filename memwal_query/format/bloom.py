"""Primary-key bloom filters (``bloom_filter.bin`` of a flushed generation).

A split-block bloom filter (SBBF, the Parquet design): ``n`` blocks of eight 32-bit
words, stored as little-endian words with no header (the block count is the file size
divided by 32). A key's 64-bit hash picks a block with its upper 32 bits
(``((h >> 32) * n) >> 32``) and sets one bit in each word of the block with its lower
32 bits (``((lo * SALT[i]) mod 2**32) >> 27``). Everything is vectorised with numpy.

Key hashing (:func:`hash_keys`) is pylance's: SipHash-1-3 over a null flag and the
key's little-endian bytes, so both implementations read each other's filters.

The file has no header (it stays byte-identical to pylance's), so its integrity is
kept next to it: ``bloom_filter.json`` records its size and CRC-32 (:func:`write`).
:func:`load` checks the size against the generation's row count *before* reading (a
huge file is never allocated), then the checksum; a filter that fails is not used:
the caller gets an untrusted :class:`LoadedBloom` and a :class:`BloomFilterWarning`
and checks keys exactly. Filters written by pylance (no ``bloom_filter.json``) get the
size checks only (a cleared bit there is found by ``memwal fsck``, which checks that
every key of the generation hits; ``memwal repair`` then rebuilds it, and records the
checksum of every sound pylance filter so later reads check it).
"""

from __future__ import annotations

import functools
import json
import struct
import warnings
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import BloomCorruptError, BloomFilterWarning, ObjectNotFoundError

if TYPE_CHECKING:
    from memwal_query.storage.io import FileIO

_SALT = np.array(
    [
        0x47B6137B,
        0x44974D91,
        0x8824AD5B,
        0xA2B7289D,
        0x705495C7,
        0x2DF1424B,
        0x9EFC4947,
        0x5C6BFB31,
    ],
    dtype=np.uint64,
)
_SALTS = [int(x) for x in _SALT]
_M32 = np.uint64(0xFFFFFFFF)
BITS_PER_KEY = 16
MIN_BLOCKS = 1024  # pylance's fixed size (32 KiB); larger generations get more


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


_K0 = np.uint64(0x736F6D6570736575)
_K1 = np.uint64(0x646F72616E646F6D)
_K2 = np.uint64(0x6C7967656E657261)
_K3 = np.uint64(0x7465646279746573)


def _round(
    v0: np.ndarray, v1: np.ndarray, v2: np.ndarray, v3: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    v0 = v0 + v1
    v1 = _rotl(v1, 13) ^ v0
    v0 = _rotl(v0, 32)
    v2 = v2 + v3
    v3 = _rotl(v3, 16) ^ v2
    v0 = v0 + v3
    v3 = _rotl(v3, 21) ^ v0
    v2 = v2 + v1
    v1 = _rotl(v1, 17) ^ v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


def siphash13(messages: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """SipHash-1-3 with keys (0, 0) (Rust's ``DefaultHasher``) of many byte strings.

    ``messages`` is a zero-padded ``uint8`` matrix (one row per message, width a
    multiple of 8 and larger than every length); ``lengths`` the byte lengths.
    Vectorised over messages with numpy. Messages of very different lengths are best
    hashed in groups of similar length (:func:`hash_keys` does), as the padding costs
    memory and every message pays for the longest one's rounds.
    """
    n = len(lengths)
    words = np.ascontiguousarray(messages).view("<u8").astype(np.uint64)
    full = (lengths // 8).astype(np.int64)
    v0 = np.full(n, _K0, np.uint64)
    v1 = np.full(n, _K1, np.uint64)
    v2 = np.full(n, _K2, np.uint64)
    v3 = np.full(n, _K3, np.uint64)
    with np.errstate(over="ignore"):
        shortest = int(full.min()) if n else 0
        for j in range(shortest):  # every message has word j: no masking
            m = words[:, j]
            v0, v1, v2, v3 = _round(v0, v1, v2, v3 ^ m)
            v0 = v0 ^ m
        for j in range(shortest, int(full.max()) if n else 0):
            active = full > j
            m = words[:, j]
            a0, a1, a2, a3 = _round(v0, v1, v2, v3 ^ m)
            a0 = a0 ^ m
            v0 = np.where(active, a0, v0)
            v1 = np.where(active, a1, v1)
            v2 = np.where(active, a2, v2)
            v3 = np.where(active, a3, v3)
        tail = words[np.arange(n), full]
        rem = (lengths % 8).astype(np.uint64)
        mask = np.where(
            rem == 0, np.uint64(0), (np.uint64(1) << (rem * np.uint64(8))) - np.uint64(1)
        )
        b = (tail & mask) | ((lengths.astype(np.uint64) & np.uint64(0xFF)) << np.uint64(56))
        v0, v1, v2, v3 = _round(v0, v1, v2, v3 ^ b)
        v0 = v0 ^ b
        v2 = v2 ^ np.uint64(0xFF)
        for _ in range(3):
            v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Start offsets of consecutive pieces of the given lengths."""
    return np.cumsum(lengths) - lengths


def _within(lengths: np.ndarray) -> np.ndarray:
    """For every byte of consecutive pieces, its offset inside its piece."""
    return np.arange(int(lengths.sum())) - np.repeat(_starts(lengths), lengths)


def _column_segments(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Per-row byte strings of one key column in pylance's encoding: (bytes, lengths).

    1 byte null flag, then int32 as 4 bytes LE, int64 as 8 bytes LE, utf8 as its bytes +
    0xFF, binary as a u64 LE length + bytes. Other types contribute the flag only (as
    pylance 14 does: its writer hashes only the flag for them, so such a filter never
    excludes a key). The strings are returned concatenated (``uint8`` array) with
    their lengths, so memory is proportional to the total key bytes, not to
    rows x longest key.
    """
    n = len(col)
    valid = ~np.asarray(pc.is_null(col).to_numpy(zero_copy_only=False), dtype=bool)
    t = col.type
    if t == pa.int32() or t == pa.int64():
        width = 4 if t == pa.int32() else 8
        vals = pc.fill_null(col, 0).to_numpy(zero_copy_only=False).astype(f"<i{width}")
        mat = np.zeros((n, 1 + width), np.uint8)
        mat[:, 0] = ~valid
        mat[:, 1:] = vals.view(np.uint8).reshape(n, width)
        lengths = np.where(valid, 1 + width, 1).astype(np.int64)
        return mat[np.arange(1 + width)[None, :] < lengths[:, None]], lengths
    if pa.types.is_string(t) or pa.types.is_binary(t):
        offsets = np.frombuffer(col.buffers()[1], dtype=np.int32)[col.offset : col.offset + n + 1]
        data = col.buffers()[2]
        data = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
        sizes = np.where(valid, offsets[1:] - offsets[:-1], 0).astype(np.int64)
        binary = pa.types.is_binary(t)
        prefix = 8 if binary else 0  # u64 length prefix
        suffix = 0 if binary else 1  # 0xFF terminator
        lengths = np.where(valid, 1 + prefix + sizes + suffix, 1).astype(np.int64)
        starts = _starts(lengths)
        out = np.zeros(int(lengths.sum()), np.uint8)
        out[starts] = ~valid
        if binary:
            out[starts[valid][:, None] + 1 + np.arange(8)] = (
                sizes[valid].astype("<u8").view(np.uint8).reshape(-1, 8)
            )
        within = _within(sizes)
        src = np.repeat(offsets[:-1].astype(np.int64), sizes) + within
        out[np.repeat(starts + 1 + prefix, sizes) + within] = data[src]
        if not binary:
            out[starts[valid] + 1 + sizes[valid]] = 0xFF
        return out, lengths
    return (~valid).astype(np.uint8), np.ones(n, np.int64)


_MASK64 = (1 << 64) - 1
SMALL_BATCH = 8  # at most this many keys are hashed with Python ints (no numpy overhead)


def _siphash13_int(data: bytes) -> int:
    """SipHash-1-3 (keys 0, 0) of one byte string with Python ints (see :func:`siphash13`)."""
    m64 = _MASK64
    v0, v1, v2, v3 = int(_K0), int(_K1), int(_K2), int(_K3)
    n = len(data)
    end = n - n % 8
    words = list(struct.unpack_from(f"<{end // 8}Q", data)) if end else []
    words.append(((n & 0xFF) << 56) | int.from_bytes(data[end:], "little"))
    for m in words:  # the full words, then the tail word with the length byte
        v3 ^= m
        v0 = (v0 + v1) & m64
        v1 = ((v1 << 13) | (v1 >> 51)) & m64 ^ v0
        v0 = ((v0 << 32) | (v0 >> 32)) & m64
        v2 = (v2 + v3) & m64
        v3 = ((v3 << 16) | (v3 >> 48)) & m64 ^ v2
        v0 = (v0 + v3) & m64
        v3 = ((v3 << 21) | (v3 >> 43)) & m64 ^ v0
        v2 = (v2 + v1) & m64
        v1 = ((v1 << 17) | (v1 >> 47)) & m64 ^ v2
        v2 = ((v2 << 32) | (v2 >> 32)) & m64
        v0 ^= m
    v2 ^= 0xFF
    for _ in range(3):
        v0 = (v0 + v1) & m64
        v1 = ((v1 << 13) | (v1 >> 51)) & m64 ^ v0
        v0 = ((v0 << 32) | (v0 >> 32)) & m64
        v2 = (v2 + v3) & m64
        v3 = ((v3 << 16) | (v3 >> 48)) & m64 ^ v2
        v0 = (v0 + v3) & m64
        v3 = ((v3 << 21) | (v3 >> 43)) & m64 ^ v0
        v2 = (v2 + v1) & m64
        v1 = ((v1 << 17) | (v1 >> 47)) & m64 ^ v2
        v2 = ((v2 << 32) | (v2 >> 32)) & m64
    return v0 ^ v1 ^ v2 ^ v3


def _key_messages(keys: pa.Table) -> list[bytes]:
    """Per-row byte strings of :func:`_column_segments`, built with Python objects.

    For a handful of keys, where numpy's per-call overhead dominates; same bytes.
    """
    n = keys.num_rows
    out = [b""] * n
    for c in keys.columns:
        t = c.type
        if t == pa.int32() or t == pa.int64():
            width = 4 if t == pa.int32() else 8
            segs = [
                b"\x01" if v is None else b"\x00" + v.to_bytes(width, "little", signed=True)
                for v in c.to_pylist()
            ]
        elif pa.types.is_string(t):
            values = [x for chunk in c.chunks for x in chunk.view(pa.binary()).to_pylist()]
            segs = [b"\x01" if v is None else b"\x00" + v + b"\xff" for v in values]
        elif pa.types.is_binary(t):
            segs = [
                b"\x01" if v is None else b"\x00" + len(v).to_bytes(8, "little") + v
                for v in c.to_pylist()
            ]
        else:  # the null flag only (see _column_segments)
            nulls = pc.is_null(c).to_pylist() if c.null_count else [False] * n
            segs = [b"\x01" if v else b"\x00" for v in nulls]
        out = [a + b for a, b in zip(out, segs)]
    return out


HASH_CHUNK_ROWS = 32768


def hash_keys(keys: pa.Table) -> np.ndarray:
    """64-bit hashes of primary-key rows, exactly as pylance's native MemWAL computes them.

    The per-column byte strings of :func:`_column_segments`, concatenated in key order,
    hashed with SipHash-1-3 (keys 0, 0). Verified byte-for-byte against filters pylance
    14 wrote (``tests/test_bloom.py``), so both implementations read each other's
    ``bloom_filter.bin``.

    Up to :data:`SMALL_BATCH` keys (a point lookup) are hashed one by one with Python
    ints, which costs a few microseconds instead of numpy's fixed overhead of a few
    hundred (same hashes). Larger batches are hashed in groups whose lengths are within
    a factor of two (a handful of groups, each vectorised), so one very long key costs
    its own bytes only instead of padding every key to its length.
    """
    n = keys.num_rows
    if n == 0:
        return np.zeros(0, np.uint64)
    if n <= SMALL_BATCH:
        return np.array([_siphash13_int(m) for m in _key_messages(keys)], np.uint64)
    if n <= HASH_CHUNK_ROWS:
        return hash_keys_vectorised(keys)
    # Chunks keep numpy's temporaries in the CPU caches: ~4x faster for 1M keys.
    return np.concatenate(
        [hash_keys_vectorised(keys.slice(i, HASH_CHUNK_ROWS)) for i in range(0, n, HASH_CHUNK_ROWS)]
    )


def hash_keys_vectorised(keys: pa.Table) -> np.ndarray:
    """:func:`hash_keys` with numpy whatever the number of keys."""
    n = keys.num_rows
    if n == 0:
        return np.zeros(0, np.uint64)
    parts = [_column_segments(c.combine_chunks()) for c in keys.columns]
    if len(parts) == 1:
        flat, lengths = parts[0]
    else:
        lengths = np.sum([ln for _, ln in parts], axis=0)
        flat = np.zeros(int(lengths.sum()), np.uint8)
        offset = _starts(lengths)  # where each row's next column segment goes
        for seg, ln in parts:
            flat[np.repeat(offset, ln) + _within(ln)] = seg
            offset = offset + ln
    starts = _starts(lengths)
    words = lengths // 8
    group = np.zeros(n, np.int64)  # 0 for < 8 bytes, else 1 + floor(log2(words))
    nz = words > 0
    group[nz] = np.frexp(words[nz].astype(np.float64))[1]
    out = np.empty(n, np.uint64)
    for g in np.unique(group):
        rows = np.flatnonzero(group == g)
        ln = lengths[rows]
        width = (int(ln.max()) // 8 + 1) * 8
        msg = np.zeros((len(rows), width), np.uint8)
        within = _within(ln)
        src = np.repeat(starts[rows], ln) + within
        msg[np.repeat(np.arange(len(rows)), ln), within] = flat[src]
        out[rows] = siphash13(msg, ln)
    return out


class BloomFilter:
    """A split-block bloom filter over primary keys.

    Parameters
    ----------
    words : np.ndarray
        ``uint32`` array of shape ``(num_blocks, 8)``.
    """

    def __init__(self, words: np.ndarray) -> None:
        self.words = words

    @property
    def num_blocks(self) -> int:
        """Number of 256-bit blocks."""
        return int(self.words.shape[0])

    @classmethod
    def empty(cls, num_keys: int, bits_per_key: int = BITS_PER_KEY) -> BloomFilter:
        """An empty filter sized for ``num_keys`` (a power-of-two number of blocks)."""
        blocks = max(MIN_BLOCKS, (num_keys * bits_per_key + 255) // 256)
        blocks = 1 << (blocks - 1).bit_length()
        return cls(np.zeros((blocks, 8), np.uint32))

    def _positions(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = np.uint64(self.num_blocks)
        block = ((hashes >> np.uint64(32)) * n) >> np.uint64(32)
        lo = hashes & _M32
        bits = ((lo[:, None] * _SALT[None, :]) & _M32) >> np.uint64(27)
        masks = (np.uint64(1) << bits).astype(np.uint32)
        return block.astype(np.int64), masks

    def insert_hashes(self, hashes: np.ndarray) -> None:
        """Add keys given by their 64-bit hashes."""
        if len(hashes) == 0:
            return
        block, masks = self._positions(hashes)
        for i in range(8):  # 8 word lanes, each vectorised over all keys
            np.bitwise_or.at(self.words[:, i], block, masks[:, i])

    def might_contain_hashes(self, hashes: np.ndarray) -> np.ndarray:
        """Boolean array: False means the key is certainly absent."""
        if len(hashes) == 0:
            return np.zeros(0, bool)
        if len(hashes) <= SMALL_BATCH:  # a point lookup: Python ints, same bits
            n, words, out = self.num_blocks, self.words, []
            for h in hashes.tolist():
                row = words[((h >> 32) * n) >> 32].tolist()
                lo = h & 0xFFFFFFFF
                out.append(
                    all(w >> (((lo * s) & 0xFFFFFFFF) >> 27) & 1 for w, s in zip(row, _SALTS))
                )
            return np.array(out, bool)
        block, masks = self._positions(hashes)
        return np.all((self.words[block] & masks) == masks, axis=1)

    def might_contain(self, keys: pa.Table) -> np.ndarray:
        """Boolean array over the rows of a primary-key table."""
        return self.might_contain_hashes(hash_keys(keys))

    def to_bytes(self) -> bytes:
        """File bytes (little-endian words, no header)."""
        return self.words.astype("<u4").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> BloomFilter:
        """Parse file bytes; ValueError when the size is not a multiple of 32."""
        if len(data) == 0 or len(data) % 32:
            raise ValueError(f"bloom filter size {len(data)} is not a positive multiple of 32")
        return cls(np.frombuffer(data, dtype="<u4").reshape(-1, 8).astype(np.uint32))


def build(keys: pa.Table) -> bytes:
    """Bloom filter file bytes for the primary-key rows in ``keys``."""
    bf = BloomFilter.empty(keys.num_rows)
    bf.insert_hashes(hash_keys(keys))
    return bf.to_bytes()


BLOOM_FILE = "bloom_filter.bin"
BLOOM_META_FILE = "bloom_filter.json"


def max_blocks(num_rows: int) -> int:
    """The most blocks a filter over ``num_rows`` keys can have (ours or pylance's)."""
    return BloomFilter.empty(max(0, int(num_rows))).num_blocks


def write(io: FileIO, gen_uri: str, keys: pa.Table) -> None:
    """Write ``bloom_filter.bin`` over ``keys`` and its ``bloom_filter.json`` (size, CRC)."""
    data = build(keys)
    io.write(f"{gen_uri}/{BLOOM_FILE}", data)
    write_meta(io, gen_uri, data, keys.num_rows)


def write_meta(io: FileIO, gen_uri: str, data: bytes, num_keys: int) -> None:
    """Write ``bloom_filter.json`` (size, CRC-32) for the filter bytes ``data``."""
    meta = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}", "keys": num_keys}
    io.write(f"{gen_uri}/{BLOOM_META_FILE}", json.dumps(meta).encode())


@dataclass(frozen=True)
class LoadedBloom:
    """The result of :func:`load`.

    Attributes
    ----------
    filter : BloomFilter or None
        The filter, or None when it must not be used.
    problem : str or None
        Why it is not used (missing, corrupt), None when it is fine.
    """

    filter: BloomFilter | None
    problem: str | None = None

    @property
    def trusted(self) -> bool:
        """Whether the filter may exclude keys; otherwise check every key exactly."""
        return self.filter is not None

    def might_contain_hashes(self, hashes: np.ndarray) -> np.ndarray:
        """The filter's answer, or all True when untrusted (exact checks decide)."""
        if self.filter is None:
            return np.ones(len(hashes), bool)
        return self.filter.might_contain_hashes(hashes)


def validate(io: FileIO, gen_uri: str, num_rows: int) -> BloomFilter:
    """Read and check a generation's filter; BloomCorruptError (or ObjectNotFoundError).

    The size must be 32 bytes times a power of two of at least :data:`MIN_BLOCKS`
    blocks (ours and pylance's filters all are) and at most what a filter over
    ``num_rows`` keys can need (checked before reading), and match
    ``bloom_filter.json`` (size and CRC-32) when that exists.
    """
    path = f"{gen_uri}/{BLOOM_FILE}"
    size = io.size(path)
    limit = 32 * max_blocks(num_rows)
    blocks = size // 32
    if size % 32 or size > limit or blocks < MIN_BLOCKS or blocks & (blocks - 1):
        raise BloomCorruptError(
            path,
            f"size {size} is not 32 x a power of two of at least {MIN_BLOCKS} blocks and at "
            f"most {limit} bytes (the largest filter over {num_rows} keys)",
        )
    meta = None
    try:
        meta = json.loads(io.read(f"{gen_uri}/{BLOOM_META_FILE}"))
    except ObjectNotFoundError:
        pass  # written by pylance (or before checksums): size checks only
    except ValueError as e:
        raise BloomCorruptError(f"{gen_uri}/{BLOOM_META_FILE}", f"unreadable: {e}") from e
    data = io.read(path)
    if len(data) != size:
        raise BloomCorruptError(path, f"size changed while reading ({size} -> {len(data)})")
    if meta is not None:
        if not isinstance(meta, dict) or meta.get("size") != size:
            raise BloomCorruptError(path, f"size {size} differs from {BLOOM_META_FILE}'s {meta!r}")
        crc = f"{zlib.crc32(data):08x}"
        if meta.get("crc32") != crc:
            raise BloomCorruptError(
                path, f"checksum mismatch (stored {meta.get('crc32')!r}, computed {crc!r})"
            )
    return BloomFilter.from_bytes(data)


MAX_CHECKED_ROWS = 1 << 32
"""Largest generation :func:`load_checksummed` accepts a filter for (its size limit)."""


@functools.cache
def _checked_limit() -> int:
    return 32 * max_blocks(MAX_CHECKED_ROWS)


def load_checksummed(io: FileIO, gen_uri: str) -> BloomFilter | None:
    """A generation's filter when its ``bloom_filter.json`` (size, CRC-32) matches the
    file, read without knowing the generation's row count (no Lance table opened): a
    filter whose negatives readers may trust without checking the generation's keys,
    since the CRC catches a flipped bit or a truncated file.

    None when there is no ``bloom_filter.json`` (pylance's filters) or anything does not
    match: the caller then takes :func:`load`'s path, which checks the size against the
    row count and reports the problem. Never raises.
    """
    try:
        meta = json.loads(io.read(f"{gen_uri}/{BLOOM_META_FILE}"))
        size, crc = meta["size"], meta["crc32"]
        blocks = size // 32 if isinstance(size, int) else 0
        if size % 32 or blocks < MIN_BLOCKS or blocks & (blocks - 1) or size > _checked_limit():
            return None
        path = f"{gen_uri}/{BLOOM_FILE}"
        if io.size(path) != size:  # never read a file larger than its checksummed size
            return None
        data = io.read(path)
        if len(data) != size or f"{zlib.crc32(data):08x}" != crc:
            return None
        return BloomFilter.from_bytes(data)
    except Exception:  # noqa: BLE001 - missing, unreadable, malformed: load() decides
        return None


def load(io: FileIO, gen_uri: str, num_rows: int) -> LoadedBloom:
    """A generation's filter for readers: never raises for a bad filter.

    A missing, unreadable or corrupt filter gives an untrusted :class:`LoadedBloom`
    (the caller checks keys exactly, so answers stay equal to SQL) and a
    :class:`BloomFilterWarning` naming the file.
    """
    try:
        return LoadedBloom(validate(io, gen_uri, num_rows))
    except ObjectNotFoundError:
        problem = f"{gen_uri}/{BLOOM_FILE}: missing"
    except BloomCorruptError as e:
        problem = str(e)
    except Exception as e:  # noqa: BLE001 - unreadable (storage error): exact checks
        problem = f"{gen_uri}/{BLOOM_FILE}: unreadable: {type(e).__name__}: {e}"
    warnings.warn(
        f"{problem}; checking this generation's keys exactly "
        "(`memwal repair URI` writes the filter again)",
        BloomFilterWarning,
        stacklevel=2,
    )
    return LoadedBloom(None, problem)
