"""MurmurHash3 of Arrow arrays, vectorised in numpy: the hash of the bucket transforms.

Hashing (bucket, multi_bucket)
------------------------------
``murmur3`` is MurmurHash3 x86 32-bit, seed 0, as a signed int32, of these bytes (the
Iceberg bucket encoding, so every integer width hashes alike - type-promotion resistant):

* all integer types (int8..int64, uint8..uint64), bool (0/1): the value as an 8-byte
  little-endian int64. uint64 values above 2**63-1 wrap to their two's complement int64
  (``2**64 - 1`` hashes like ``-1``).
* date32 / date64: days since the epoch, as int64 (date64 is floored to whole days).
* timestamp (any unit, any time zone): microseconds since the epoch (UTC), as int64
  (nanoseconds are floored). time32/time64: microseconds since midnight, as int64.
* string / large_string / string_view: the UTF-8 bytes; binary (all kinds): the bytes;
  ``arrow.uuid`` (and any extension type): its storage, so a uuid hashes as its 16 bytes
  in RFC 4122 order, as Iceberg's uuid.
* decimal: the unscaled value as minimal big-endian two's-complement bytes (Java's
  ``BigInteger.toByteArray``); the hash depends on the scale, not on the precision.
* float16/32/64: Iceberg's rule: the value cast to float64, ``-0.0`` canonicalized to
  ``0.0`` and every NaN to ``0x7ff8000000000000``, hashed as that bit pattern (8-byte
  little-endian). Float widths hash alike, but ``5.0`` does not hash like integer ``5``.
* other types (lists, structs, durations...) raise :class:`RegionSpecError`.

``abs`` is computed in int64, so ``abs(-2**31) % N == 2**31 % N`` (no int32 overflow);
the bucket is always in ``[0, N)``. A NULL input gives a NULL bucket.

``murmur3_multi`` hashes the concatenation, in ``source_ids`` order, of every
**non-NULL** input's bytes (as above), each preceded by its byte length as a 4-byte
little-endian unsigned int: ``len(b0) || b0 || len(b1) || b1 ...``. NULL inputs are
skipped (so ``(5, NULL)`` and ``(NULL, 5)`` of equal types share a bucket); the result is
NULL only when every input is NULL. A single-column multi_bucket is therefore *not* the
same as bucket (the length prefix).

Vectorised in numpy uint32 arithmetic; byte strings longer than 64 bytes are hashed one
by one with ``mmh3`` (faster there than many numpy block steps). A worked example of the
multi_bucket bytes is in ``docs/compatibility.md``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import mmh3
import numpy as np
import pyarrow as pa

from memwal_query.exceptions import RegionSpecError
from memwal_query.regions.arrowtypes import int_numpy, plain, valid_mask

__all__ = [
    "Encoded",
    "bucket_values",
    "buckets",
    "concat_prefixed",
    "encode",
    "hash_column",
    "murmur3_bytes",
    "murmur3_hash",
    "murmur3_int64",
    "murmur3_multi_hash",
]

INT32_MAX = 2**31 - 1
_LONG_VALUE_BYTES = 64  # longer values are hashed one by one with mmh3

if sys.byteorder != "little":  # pragma: no cover - Arrow buffers are read as little-endian
    raise ImportError("memwal_query.regions requires a little-endian platform")


# -- murmur3 x86_32 in numpy -----------------------------------------------------------
_C1 = np.uint32(0xCC9E2D51)
_C2 = np.uint32(0x1B873593)
_N1 = np.uint32(0xE6546B64)
_F1 = np.uint32(0x85EBCA6B)
_F2 = np.uint32(0xC2B2AE35)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _mix_k(k: np.ndarray) -> np.ndarray:
    return _rotl(k * _C1, 15) * _C2


def _mix_h(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    return _rotl(h ^ k, 13) * np.uint32(5) + _N1


def _fmix(h: np.ndarray, length: np.ndarray | np.uint32) -> np.ndarray:
    h = h ^ length
    h = h ^ (h >> np.uint32(16))
    h = h * _F1
    h = h ^ (h >> np.uint32(13))
    h = h * _F2
    out: np.ndarray = h ^ (h >> np.uint32(16))
    return out


def murmur3_int64_u32(values: np.ndarray) -> np.ndarray:
    """murmur3_x86_32 (seed 0) of each int64 as 8 little-endian bytes -> uint32."""
    words = np.ascontiguousarray(values, dtype=np.int64).view(np.uint32).reshape(-1, 2)
    h = _mix_h(np.zeros(len(words), np.uint32), _mix_k(words[:, 0]))
    h = _mix_h(h, _mix_k(words[:, 1]))
    return _fmix(h, np.uint32(8))


def _words_at(words: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The little-endian uint32 at each (unaligned) byte position, from aligned words."""
    q = pos >> 2
    both = words[q].astype(np.uint64) | (words[q + 1].astype(np.uint64) << np.uint64(32))
    out: np.ndarray = (both >> ((pos & 3) * 8).astype(np.uint64)).astype(np.uint32)
    return out


def murmur3_bytes(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """murmur3_x86_32 (seed 0) of ``data[starts[i] : starts[i] + lengths[i]]`` -> uint32.

    All rows advance together, one 4-byte block per step (rows in their order, so reads
    stay sequential); values longer than ``_LONG_VALUE_BYTES`` are hashed one by one with
    ``mmh3`` instead (C beats many numpy steps for them).
    """
    n = len(starts)
    out = np.zeros(n, np.uint32)
    if n == 0:
        return out
    starts = starts.astype(np.int64, copy=False)
    lengths = lengths.astype(np.int64, copy=False)
    long_rows = np.flatnonzero(lengths > _LONG_VALUE_BYTES)
    for i in long_rows.tolist():
        s = int(starts[i])
        out[i] = mmh3.hash(data[s : s + int(lengths[i])].tobytes(), 0, signed=False)
    if len(long_rows) == n:
        return out
    rows = np.flatnonzero(lengths <= _LONG_VALUE_BYTES) if len(long_rows) else None
    if rows is not None:
        starts, lengths = starts[rows], lengths[rows]
    padded = np.zeros((len(data) // 4 + 3) * 4, np.uint8)  # aligned, + 2 spare words
    padded[: len(data)] = data
    words = padded.view("<u4")
    nblocks = lengths >> 2
    h = np.zeros(len(starts), np.uint32)
    active = np.flatnonzero(nblocks)
    j = 0
    while len(active):
        k = _words_at(words, starts[active] + 4 * j)
        h[active] = _mix_h(h[active], _mix_k(k))
        j += 1
        active = active[nblocks[active] > j]
    tail = lengths & 3
    has_tail = np.flatnonzero(tail)
    if len(has_tail):
        k = _words_at(words, starts[has_tail] + nblocks[has_tail] * 4)
        keep = (np.uint64(1) << (tail[has_tail] * 8).astype(np.uint64)) - np.uint64(1)
        h[has_tail] ^= _mix_k(k & keep.astype(np.uint32))
    h = _fmix(h, lengths.astype(np.uint32))
    if rows is None:
        return h
    out[rows] = h
    return out


# -- canonical bytes of values (the hash input) -------------------------------------------
def _empty() -> np.ndarray:
    return np.zeros(0, np.int64)


@dataclass
class Encoded:
    """Hash input of an array: 8-byte int64 values (``ints``), or variable-length bytes
    (``data[starts[i] : starts[i] + lengths[i]]``, when ``ints`` is None)."""

    valid: np.ndarray
    ints: np.ndarray | None = None
    data: np.ndarray = field(default_factory=_empty)
    starts: np.ndarray = field(default_factory=_empty)
    lengths: np.ndarray = field(default_factory=_empty)

    def hash(self) -> np.ndarray:
        """murmur3_x86_32 (seed 0) of every value, as uint32."""
        if self.ints is not None:
            return murmur3_int64_u32(self.ints)
        return murmur3_bytes(self.data, self.starts, self.lengths)


_MICROS_PER = {"s": 1_000_000, "ms": 1_000, "us": 1, "ns": 1}


def _to_micros(values: np.ndarray, unit: str) -> np.ndarray:
    if unit == "ns":
        return np.asarray(np.floor_divide(values, 1000))
    return np.asarray(values * np.int64(_MICROS_PER[unit]))


def _var_bytes(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data, starts, lengths) of a large_string / large_binary array (slices honoured)."""
    buffers = arr.buffers()
    offsets = np.frombuffer(buffers[1], dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
    data = (
        np.frombuffer(buffers[2], dtype=np.uint8)
        if buffers[2] is not None
        else np.zeros(0, np.uint8)
    )
    if len(offsets) == 0:
        offsets = np.zeros(1, np.int64)
    return data, offsets[:-1], np.diff(offsets)


def _decimal_bytes(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Minimal big-endian two's-complement bytes of the unscaled decimal values."""
    width = arr.type.byte_width
    n = len(arr)
    raw = np.frombuffer(arr.buffers()[1], dtype=np.uint8)[
        arr.offset * width : (arr.offset + n) * width
    ].reshape(n, width)
    negative = raw[:, width - 1] >= 0x80
    sign = np.where(negative, 0xFF, 0x00).astype(np.uint8)
    same = raw == sign[:, None]
    # rest_is_sign[:, k] = all bytes k.. (little-endian positions) equal the sign byte
    rest_is_sign = np.flip(np.logical_and.accumulate(np.flip(same, 1), axis=1), 1)
    rest_is_sign = np.concatenate([rest_is_sign, np.ones((n, 1), bool)], axis=1)
    top_bit = (raw >> 7).astype(bool)
    fits = rest_is_sign[:, 1:] & (top_bit == negative[:, None])  # [:, k-1]: fits k bytes
    nbytes = np.argmax(fits, axis=1).astype(np.int64) + 1
    big_endian = np.ascontiguousarray(raw[:, ::-1]).reshape(-1)
    starts = np.arange(n, dtype=np.int64) * width + (width - nbytes)
    return big_endian, starts, nbytes


def encode(arr: pa.Array | pa.ChunkedArray, field_id: str) -> Encoded:
    """The hash input bytes of every value (see module docs), with validity.

    Extension arrays hash as their storage: ``arrow.uuid`` as its 16 bytes in RFC 4122
    order, which is Iceberg's uuid hash input (two big-endian longs).
    """
    arr = plain(arr)
    if isinstance(arr.type, pa.BaseExtensionType):
        arr = arr.storage
    t = arr.type
    valid = valid_mask(arr)
    if pa.types.is_null(t):
        return Encoded(valid=np.zeros(len(arr), bool), ints=np.zeros(len(arr), np.int64))
    if pa.types.is_boolean(t):
        return Encoded(valid, ints=int_numpy(arr.cast(pa.int64())).astype(np.int64))
    if pa.types.is_integer(t):
        if t == pa.uint64():
            return Encoded(valid, ints=int_numpy(arr).astype(np.uint64).view(np.int64))
        return Encoded(valid, ints=int_numpy(arr).astype(np.int64))
    if pa.types.is_date32(t):
        return Encoded(valid, ints=int_numpy(arr.view(pa.int32())).astype(np.int64))
    if pa.types.is_date64(t):
        ms = int_numpy(arr.view(pa.int64())).astype(np.int64)
        return Encoded(valid, ints=np.floor_divide(ms, 86_400_000))
    if pa.types.is_timestamp(t) or pa.types.is_time64(t):
        raw = int_numpy(arr.view(pa.int64())).astype(np.int64)
        return Encoded(valid, ints=_to_micros(raw, t.unit))
    if pa.types.is_time32(t):
        raw = int_numpy(arr.view(pa.int32())).astype(np.int64)
        return Encoded(valid, ints=_to_micros(raw, t.unit))
    if pa.types.is_floating(t):
        f = arr.cast(pa.float64())
        f = (f.fill_null(0.0) if f.null_count else f).to_numpy(zero_copy_only=False)
        f = np.where(f == 0.0, 0.0, f).astype(np.float64)  # -0.0 -> 0.0
        bits = f.view(np.int64).copy()
        bits[np.isnan(f)] = 0x7FF8000000000000
        return Encoded(valid, ints=bits)
    if pa.types.is_decimal(t):
        data, starts, lengths = _decimal_bytes(arr)
        return Encoded(valid, data=data, starts=starts, lengths=lengths)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        data, starts, lengths = _var_bytes(arr.cast(pa.large_string()))
        return Encoded(valid, data=data, starts=starts, lengths=lengths)
    if (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_binary_view(t)
        or pa.types.is_fixed_size_binary(t)
    ):
        data, starts, lengths = _var_bytes(arr.cast(pa.large_binary()))
        return Encoded(valid, data=data, starts=starts, lengths=lengths)
    raise RegionSpecError(f"region field {field_id!r}: cannot hash a column of type {t}")


def _copy_ranges(
    out: np.ndarray, dst: np.ndarray, data: np.ndarray, src: np.ndarray, lens: np.ndarray
) -> None:
    """``out[dst[i] : dst[i] + lens[i]] = data[src[i] : src[i] + lens[i]]`` for all i."""
    nonzero = lens > 0
    dst, src, lens = dst[nonzero], src[nonzero], lens[nonzero]
    if len(lens) == 0:
        return
    if np.all(src[1:] == src[:-1] + lens[:-1]):  # sources back to back: a boolean mask
        marks = np.zeros(len(out) + 1, np.int8)  # ranges never touch: +1 / -1 suffice
        marks[dst] = 1
        marks[dst + lens] = -1
        out[np.cumsum(marks[:-1], dtype=np.int8).view(bool)] = data[src[0] : src[-1] + lens[-1]]
        return
    total = int(lens.sum())
    shift = np.repeat(dst - src, lens)
    src_pos = np.repeat(src - (np.cumsum(lens) - lens), lens) + np.arange(total, dtype=np.int64)
    out[src_pos + shift] = data[src_pos]


def concat_prefixed(encoded: list[Encoded]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: ``len(b0) || b0 || len(b1) || b1 ...`` over the non-NULL inputs."""
    n = len(encoded[0].valid)
    lengths = [np.full(n, 8, np.int64) if e.ints is not None else e.lengths for e in encoded]
    segments = [np.where(e.valid, 4 + ln, 0) for e, ln in zip(encoded, lengths)]
    row_lengths = np.sum(segments, axis=0).astype(np.int64)
    row_starts = np.zeros(n, np.int64)
    if n:
        np.cumsum(row_lengths[:-1], out=row_starts[1:])
    out = np.zeros(int(row_lengths.sum()), np.uint8)
    position = row_starts.copy()
    for e, all_lens, segment in zip(encoded, lengths, segments):
        rows = np.flatnonzero(e.valid)
        if len(rows):
            pos = position[rows]
            lens = all_lens[rows]
            prefix = lens.astype("<u4").view(np.uint8).reshape(-1, 4)
            for b in range(4):
                out[pos + b] = prefix[:, b]
            if e.ints is not None:
                payload = np.ascontiguousarray(e.ints[rows], dtype=np.int64)
                payload = payload.view(np.uint8).reshape(-1, 8)  # type: ignore[assignment]
                for b in range(8):
                    out[pos + 4 + b] = payload[:, b]
            else:
                _copy_ranges(out, pos + 4, e.data, e.starts[rows], lens)
        position = position + segment
    return out, row_starts, row_lengths


def murmur3_hash(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The spec's ``murmur3(col)``: MurmurHash3 x86_32 (seed 0) of each value.

    Parameters
    ----------
    values : pyarrow.Array or pyarrow.ChunkedArray
        Any hashable type (see the module docs for the bytes hashed per type).

    Returns
    -------
    pyarrow.Int32Array
        Signed hashes; NULL where the value is NULL.

    Raises
    ------
    RegionSpecError
        For a type that cannot be hashed (floats are hashed, lists/structs are not).
    """
    enc = encode(values, "murmur3")
    return pa.array(enc.hash().view(np.int32), pa.int32(), mask=~enc.valid)


def murmur3_multi_hash(columns: Sequence[pa.Array | pa.ChunkedArray]) -> pa.Array:
    """The spec's ``murmur3_multi(col0, col1, ...)`` (see the module docs for the bytes).

    Parameters
    ----------
    columns : sequence of pyarrow.Array
        One or more arrays of equal length.

    Returns
    -------
    pyarrow.Int32Array
        Signed hashes; NULL only where every input is NULL.
    """
    if not columns:
        raise RegionSpecError("murmur3_multi needs at least one column")
    encoded = [encode(c, "murmur3_multi") for c in columns]
    if len({len(e.valid) for e in encoded}) != 1:
        raise RegionSpecError("murmur3_multi columns differ in length")
    valid = np.logical_or.reduce([e.valid for e in encoded])
    hashes = murmur3_bytes(*concat_prefixed(encoded))
    return pa.array(hashes.view(np.int32), pa.int32(), mask=~valid)


def buckets(hashes: np.ndarray, valid: np.ndarray, num_buckets: int) -> pa.Array:
    """``abs(h) % N`` computed in int64 (so ``abs(-2**31)`` does not overflow)."""
    b = np.abs(hashes.view(np.int32).astype(np.int64)) % np.int64(num_buckets)
    return pa.array(b.astype(np.int32), pa.int32(), mask=~valid)


def bucket_values(values: pa.Array | pa.ChunkedArray, num_buckets: int) -> pa.Array:
    """The bucket transform: ``abs(murmur3(values)) % num_buckets`` as int32.

    Parameters
    ----------
    values : pyarrow.Array or pyarrow.ChunkedArray
    num_buckets : int
        Positive number of buckets.

    Returns
    -------
    pyarrow.Int32Array
        Buckets in ``[0, num_buckets)``; NULL for NULL values.
    """
    if not isinstance(num_buckets, int) or not 0 < num_buckets <= INT32_MAX:
        raise RegionSpecError(f"num_buckets must be a positive int32, got {num_buckets!r}")
    enc = encode(values, "bucket")
    return buckets(enc.hash(), enc.valid, num_buckets)


def murmur3_int64(values: np.ndarray) -> np.ndarray:
    """murmur3_x86_32 (seed 0) of each int64's 8 little-endian bytes.

    Parameters
    ----------
    values : numpy.ndarray
        Integers (converted to int64).

    Returns
    -------
    numpy.ndarray
        Signed int32 hashes.
    """
    return murmur3_int64_u32(np.asarray(values, dtype=np.int64)).view(np.int32)


hash_column = murmur3_hash
"""Alias of :func:`murmur3_hash`."""
