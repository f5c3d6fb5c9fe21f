"""The merger's lookup of the base rows of a batch's integer keys
(:func:`memwal_query.maintain.merger._base_addresses`), against a plain Python one.

Real Lance datasets of every integer key type the merger's own ``Update`` takes, holding
their type's extremes, negative values and NULL keys in several fragments; key sets at
both ends of the type, around zero, outside the base's values, and as wide as the bitmap
allows.
"""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa
import pytest

from memwal_query.maintain import merger

TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32()]


def _reference(ds: lance.LanceDataset, keys: np.ndarray) -> list[int]:
    t = ds.to_table(columns=["id"], with_row_address=True)
    wanted = {int(k) for k in keys}
    pairs = zip(t.column(0).to_pylist(), t.column(1).to_pylist(), strict=True)
    return sorted(a for v, a in pairs if v is not None and v in wanted)


@pytest.mark.parametrize("key_type", TYPES, ids=str)
def test_base_addresses_equal_a_plain_lookup(tmp_path, key_type):
    info = np.iinfo(key_type.to_pandas_dtype())
    lo, hi = int(info.min), int(info.max)
    rng = np.random.default_rng(7)
    values = [lo, lo + 1, lo + 5, hi - 5, hi - 1, hi, 0, 1]
    if lo < 0:
        values += [-1, -2]
    values += [int(v) for v in rng.integers(lo, hi, 120, endpoint=True)]
    column = pa.array([*values, None, None], key_type)
    uri = str(tmp_path / "base")
    ds = lance.write_dataset(pa.table({"id": column}), uri, max_rows_per_file=40)
    assert len(ds.get_fragments()) > 1
    width = merger.REWRITE_MAX_KEY_SPAN
    spans = [
        (lo, lo + 3),
        (hi - 3, hi),
        (-3, 3) if lo < 0 else (0, 3),
        (lo, min(hi, lo + width - 1)),
        (max(lo, hi - width + 1), hi),
        (max(lo, -width // 2), min(hi, width // 2 - 1)),
    ]
    for a, b in spans:
        keys = np.unique(np.concatenate([[a, b], rng.integers(a, b, 30, endpoint=True)]))
        keys = keys.astype(np.int64)
        got = merger._base_addresses(ds, "id", keys)
        assert got is not None
        assert got.tolist() == _reference(ds, keys), (a, b)
    for keys in ([v for v in values[:8]], [12345 % (hi + 1)]):  # values the base has
        keys = np.asarray(keys, np.int64)
        if int(keys.max()) - int(keys.min()) < width:
            assert merger._base_addresses(ds, "id", keys).tolist() == _reference(ds, keys)


def test_base_addresses_at_the_int64_ends(tmp_path):
    """Keys at int64's top with base values at its bottom (their difference overflows
    int64) and the reverse: no value is taken for a key it is not."""
    i64 = np.iinfo(np.int64)
    low, high = int(i64.min), int(i64.max)
    values = [low, low + 1, low + 7, -1, 0, high - 7, high - 1, high]
    ds = lance.write_dataset(
        pa.table({"id": pa.array([*values, None], pa.int64())}), str(tmp_path / "base")
    )
    width = merger.REWRITE_MAX_KEY_SPAN
    for keys in (
        [high],
        [high - width + 1, high],
        [high - 7, high - 2],
        [low],
        [low, low + width - 1],
        [low + 2, low + 7],
        [-width // 2, width // 2 - 1],
    ):
        keys = np.asarray(keys, np.int64)
        assert merger._base_addresses(ds, "id", keys).tolist() == _reference(ds, keys), keys
    assert merger._base_addresses(ds, "id", np.asarray([low, high], np.int64)) is None


def test_base_addresses_over_many_batches_decoded_at_once(tmp_path, monkeypatch):
    # batches of 7 rows, four decoded at once: the addresses in order, none twice
    monkeypatch.setattr(merger, "REWRITE_SCAN_BATCH_ROWS", 7)
    monkeypatch.setattr(merger, "batch_readahead", lambda: 4)
    rng = np.random.default_rng(11)
    values = rng.permutation(5_000).astype(np.int64)
    uri = str(tmp_path / "base")
    ds = lance.write_dataset(pa.table({"id": values}), uri, max_rows_per_file=1_000)
    ds.delete("id % 5 = 0")
    keys = rng.choice(6_000, 1_500, replace=False).astype(np.int64)
    got = merger._base_addresses(ds, "id", keys)
    assert got is not None
    assert got.tolist() == _reference(ds, keys)
