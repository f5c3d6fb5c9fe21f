"""Primary-key bloom filters (``bloom_filter.bin`` of a flushed generation).

A split-block bloom filter (SBBF, the Parquet design): ``n`` blocks of eight 32-bit
words, stored as little-endian words with no header (the block count is the file size
divided by 32). A key's 64-bit hash picks a block with its upper 32 bits
(``((h >> 32) * n) >> 32``) and sets one bit in each word of the block with its lower
32 bits (``((lo * SALT[i]) mod 2**32) >> 27``). Everything is vectorised with numpy.

Key hashing: see :func:`hash_keys`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .schema import as_int64

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
_P1 = np.uint64(11400714785074694791)
_P2 = np.uint64(14029467366897019727)
_P3 = np.uint64(1609587929392839161)
_P4 = np.uint64(9650029242287828579)
_P5 = np.uint64(2870177450012600261)
_M32 = np.uint64(0xFFFFFFFF)
BITS_PER_KEY = 16
MIN_BLOCKS = 32


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def xxh64_u64(values: np.ndarray) -> np.ndarray:
    """XXH64 (seed 0) of each value's 8 little-endian bytes, vectorised."""
    k1 = values.astype(np.uint64, copy=False) * _P2
    k1 = _rotl(k1, 31) * _P1
    h = (_P5 + np.uint64(8)) ^ k1
    h = _rotl(h, 27) * _P1 + _P4
    h ^= h >> np.uint64(33)
    h *= _P2
    h ^= h >> np.uint64(29)
    h *= _P3
    h ^= h >> np.uint64(32)
    return h


def _column_u64(col: pa.ChunkedArray | pa.Array) -> np.ndarray | None:
    """Integer-like columns as uint64 bit patterns of their int64 value, else None."""
    t = col.type
    if pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_temporal(t):
        return as_int64(col).to_numpy().view(np.uint64)
    if pa.types.is_floating(t):
        f = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
        f = np.where(f == 0.0, 0.0, f)  # -0.0 and 0.0 are one key
        return f.view(np.uint64)
    return None


def _bytes_hash(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    import xxhash

    t = col.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        values = [v.encode() for v in col.to_pylist()]
    else:
        values = [bytes(v) for v in col.to_pylist()]
    return np.fromiter((xxhash.xxh64_intdigest(v) for v in values), np.uint64, len(values))


def hash_keys(keys: pa.Table) -> np.ndarray:
    """64-bit hashes of primary-key rows.

    Integer, temporal and boolean keys hash their int64 value (type-promotion safe),
    floats their float64 bits (``-0.0`` as ``0.0``), strings their UTF-8 bytes, binary
    as is. Composite keys combine the column hashes with ``h = xxh64(h * P1 ^ c)``.
    """
    out: np.ndarray | None = None
    for col in keys.columns:
        ints = _column_u64(col)
        h = xxh64_u64(ints) if ints is not None else _bytes_hash(col)
        out = h if out is None else xxh64_u64((out * _P1) ^ h)
    if out is None:
        return np.zeros(0, np.uint64)
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
