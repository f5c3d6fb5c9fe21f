"""Sets of Lance row addresses (uint64: fragment id in the high 32 bits, row offset in
the low 32): Lance's serialized ``RowAddrTreeMap`` (:func:`row_address_treemap`, 32-bit
Roaring bitmaps per fragment), and in-memory membership (:class:`RowIdMask`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np

_ROARING_NO_RUN_COOKIE = 12346  # Roaring portable format, no run containers
_ROARING_ARRAY_MAX = 4096  # larger containers are 65536-bit bitmaps


def run_starts(sorted_values: np.ndarray) -> np.ndarray:
    """Index of the first element of every run of equal adjacent values (of every
    distinct value when the input is sorted). Not ``np.unique``: numpy 2.4 picks a
    hash-based unique for it, 50x slower here."""
    if not len(sorted_values):
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.append(True, sorted_values[1:] != sorted_values[:-1]))


def _roaring32(values: np.ndarray) -> bytes:
    """A 32-bit Roaring bitmap of ``values`` (sorted, unique, uint32) in the portable
    serialization format (the one CRoaring, Java, Go and Rust ``roaring`` read): one
    container per 65536-value chunk, an array of 16-bit values up to 4096 entries, a
    bitmap of 8192 bytes above. Built with numpy: per-value work is vectorised, only
    bitmap containers (over 4096 values each) are visited one by one."""
    high = (values >> 16).astype(np.uint16)
    low = (values & 0xFFFF).astype(np.uint16)
    starts = run_starts(high)
    keys = high[starts]
    counts = np.diff(np.append(starts, len(high)))
    n = len(keys)
    header = np.empty(2 * n, dtype="<u2")
    header[0::2] = keys
    header[1::2] = counts - 1
    sizes = np.where(counts > _ROARING_ARRAY_MAX, 8192, 2 * counts)
    offsets = 8 + 8 * n + np.cumsum(sizes, dtype=np.int64) - sizes  # where each container starts
    out = [
        struct.pack("<II", _ROARING_NO_RUN_COOKIE, n),
        header.tobytes(),
        offsets.astype("<u4").tobytes(),
    ]
    # Array containers are the low halves in order; only bitmap containers (more than
    # 4096 values each, so few) are built one by one.
    done = 0
    for start, count in zip(starts.tolist(), counts.tolist()):
        if count > _ROARING_ARRAY_MAX:
            out.append(low[done:start].astype("<u2").tobytes())
            bits = np.zeros(65536, dtype=bool)
            bits[low[start : start + count]] = True
            out.append(np.packbits(bits, bitorder="little").tobytes())
            done = start + count
    out.append(low[done:].astype("<u2").tobytes())
    return b"".join(out)


def row_address_treemap(addresses: np.ndarray) -> bytes:
    """Lance's serialized ``RowAddrTreeMap`` of row ``addresses`` (uint64, fragment id in
    the high 32 bits, row offset in the low 32 bits): what ``LanceDataset.scanner``
    takes as ``row_addr_blocklist``/``row_addr_allowlist``. Lance matches those lists
    against *row ids* (``_rowid``): the same values as the addresses, except in a
    dataset with stable row ids (pass its ``_rowid`` values then). Format: entry count (u32),
    then per fragment its id (u32), the byte length of its bitmap (u32; never 0, which
    would mean "the whole fragment") and a 32-bit Roaring bitmap of its row offsets.
    """
    addresses = np.sort(np.asarray(addresses, dtype=np.uint64))
    if len(addresses):
        addresses = addresses[np.append(True, addresses[1:] != addresses[:-1])]  # unique
    fragments = (addresses >> np.uint64(32)).astype(np.uint32)
    offsets = (addresses & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    starts = run_starts(fragments)
    ids = fragments[starts]
    ends = np.append(starts[1:], len(addresses))
    out = [struct.pack("<I", len(ids))]
    for frag, start, end in zip(ids.tolist(), starts.tolist(), ends.tolist()):
        bitmap = _roaring32(offsets[start:end])
        out.append(struct.pack("<II", frag, len(bitmap)))
        out.append(bitmap)
    return b"".join(out)


class RowIdMask:
    """Membership of row ids (or addresses: uint64, fragment in the high 32 bits, offset
    in the low 32) as one boolean array per high word: a gather per run of equal high
    words instead of a binary search per row.

    Parameters
    ----------
    values : np.ndarray
        Sorted uint64 row ids.
    """

    def __init__(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.uint64)
        high = values >> np.uint64(32)
        low = (values & np.uint64(0xFFFFFFFF)).astype(np.int64)
        starts = run_starts(high)
        ends = np.append(starts[1:], len(values))
        self._maps: dict[int, np.ndarray] = {}
        for h, start, end in zip(high[starts].tolist(), starts.tolist(), ends.tolist()):
            offsets = low[start:end]
            m = np.zeros(int(offsets.max()) + 1, dtype=bool)
            m[offsets] = True
            self._maps[h] = m
        self.size = len(values)
        self.nbytes = sum(m.nbytes for m in self._maps.values())

    @classmethod
    def from_flags(cls, flags: dict[int, np.ndarray]) -> RowIdMask:
        """The set of the values ``high << 32 | low`` for which ``flags[high][low]`` is
        true (``flags``: a boolean array per high word, shared, not copied: they must
        not be changed afterwards)."""
        mask = cls(np.zeros(0, dtype=np.uint64))
        mask._maps = dict(flags)
        mask.size = sum(int(np.count_nonzero(f)) for f in flags.values())
        mask.nbytes = sum(f.nbytes for f in flags.values())
        return mask

    def contains(self, values: np.ndarray) -> np.ndarray:
        """Boolean mask: which ``values`` (uint64, any order) are in the set."""
        values = np.asarray(values, dtype=np.uint64)
        n = len(values)
        if n > 1 and self._maps:  # consecutive values of one high word (a scan's batch)
            first, last = int(values[0]), int(values[-1])
            if first >> 32 == last >> 32 and last - first == n - 1 and (np.diff(values) == 1).all():
                m = self._maps.get(first >> 32)
                low = first & 0xFFFFFFFF
                if m is not None and low + n <= len(m):
                    return m[low : low + n].copy()
        out = np.zeros(n, dtype=bool)
        if not n or not self._maps:
            return out
        high = values >> np.uint64(32)
        low = (values & np.uint64(0xFFFFFFFF)).astype(np.int64)
        # runs of equal high words (a scan reads a fragment's rows together)
        starts = run_starts(high)
        ends = np.append(starts[1:], len(values))
        for h, start, end in zip(high[starts].tolist(), starts.tolist(), ends.tolist()):
            m = self._maps.get(h)
            if m is None:
                continue
            part = low[start:end]
            inside = part < len(m)
            if inside.all():
                out[start:end] = m[part]
            else:
                out[start:end][inside] = m[part[inside]]
        return out


_ROARING_RUN_COOKIE = 12347  # Roaring portable format with run containers
_ROARING_NO_OFFSET_THRESHOLD = 4  # run-cookie bitmaps with fewer containers omit offsets


def _roaring32_containers(data: bytes) -> Iterator[tuple[int, str, np.ndarray]]:
    """The containers of a 32-bit Roaring bitmap in the portable serialization format,
    in order: ``(high, kind, values)`` with ``high`` the container's upper 16 bits and
    ``values`` its ``"run"`` (start, length - 1) pairs, ``"bitmap"`` 65536 booleans, or
    ``"array"`` sorted low 16-bit values.

    Raises
    ------
    ValueError
        ``data`` is not such a bitmap (unknown cookie, truncated, inconsistent sizes).
    """
    view = memoryview(data)
    if len(view) < 8:
        raise ValueError("roaring bitmap: shorter than its header")
    cookie = struct.unpack_from("<I", view, 0)[0]
    runs_bitmap = b""
    if cookie == _ROARING_NO_RUN_COOKIE:
        n = struct.unpack_from("<I", view, 4)[0]
        pos = 8
    elif cookie & 0xFFFF == _ROARING_RUN_COOKIE:
        n = (cookie >> 16) + 1
        pos = 4
        runs_bitmap = bytes(view[pos : pos + (n + 7) // 8])
        pos += (n + 7) // 8
    else:
        raise ValueError(f"roaring bitmap: unknown cookie {cookie}")
    if len(view) < pos + 4 * n:
        raise ValueError("roaring bitmap: truncated container headers")
    header = np.frombuffer(view[pos : pos + 4 * n], dtype="<u2").reshape(n, 2)
    keys = header[:, 0].tolist()
    counts = header[:, 1].astype(np.int64) + 1
    pos += 4 * n
    if cookie == _ROARING_NO_RUN_COOKIE or n >= _ROARING_NO_OFFSET_THRESHOLD:
        pos += 4 * n  # container offsets: the containers follow in order anyway
    for i in range(n):
        is_run = bool(runs_bitmap) and bool(runs_bitmap[i // 8] >> (i % 8) & 1)
        if is_run:
            if len(view) < pos + 2:
                raise ValueError("roaring bitmap: truncated run container")
            k = struct.unpack_from("<H", view, pos)[0]
            pairs = np.frombuffer(view[pos + 2 : pos + 2 + 4 * k], dtype="<u2")
            if len(pairs) != 2 * k:
                raise ValueError("roaring bitmap: truncated run container")
            yield keys[i], "run", pairs
            pos += 2 + 4 * k
        elif counts[i] > _ROARING_ARRAY_MAX:
            raw = np.frombuffer(view[pos : pos + 8192], dtype=np.uint8)
            if len(raw) != 8192:
                raise ValueError("roaring bitmap: truncated bitmap container")
            yield keys[i], "bitmap", np.unpackbits(raw, bitorder="little").astype(bool)
            pos += 8192
        else:
            low = np.frombuffer(view[pos : pos + 2 * counts[i]], dtype="<u2")
            if len(low) != counts[i]:
                raise ValueError("roaring bitmap: truncated array container")
            yield keys[i], "array", low
            pos += 2 * int(counts[i])


def roaring32_runs(data: bytes) -> tuple[int, int]:
    """(values, runs) of a 32-bit Roaring bitmap in the portable serialization format
    (the one :func:`_roaring32` writes, and Lance's bitmap deletion files): how many
    values it holds and in how many runs of consecutive values (a run crossing a
    65536-value chunk counts once per chunk). Vectorised per container.

    Raises
    ------
    ValueError
        ``data`` is not such a bitmap (unknown cookie, truncated, inconsistent sizes).
    """
    values = runs = 0
    for _, kind, part in _roaring32_containers(data):
        if kind == "run":
            values += int(part[1::2].astype(np.int64).sum()) + len(part) // 2
            runs += len(part) // 2
        elif kind == "bitmap":
            values += int(part.sum())
            runs += int(part[0]) + int(np.count_nonzero(part[1:] & ~part[:-1]))
        else:
            values += len(part)
            runs += 1 + int(np.count_nonzero(np.diff(part.astype(np.int64)) != 1))
    return values, runs


def roaring32_values(data: bytes) -> np.ndarray:
    """The values of a 32-bit Roaring bitmap in the portable serialization format (Lance's
    bitmap deletion files), sorted, as uint32. Vectorised per container.

    Raises
    ------
    ValueError
        ``data`` is not such a bitmap (unknown cookie, truncated, inconsistent sizes).
    """
    parts: list[np.ndarray] = []
    for high, kind, part in _roaring32_containers(data):
        if kind == "run":
            starts = part[0::2].astype(np.int64)
            lengths = part[1::2].astype(np.int64) + 1
            # start of each value's run, plus its place within the run
            within = np.arange(int(lengths.sum())) - np.repeat(
                np.cumsum(lengths) - lengths, lengths
            )
            low = np.repeat(starts, lengths) + within
        elif kind == "bitmap":
            low = np.flatnonzero(part)
        else:
            low = part.astype(np.int64)
        parts.append((np.int64(high) << 16) + low)
    if not parts:
        return np.zeros(0, dtype=np.uint32)
    return np.concatenate(parts).astype(np.uint32)
