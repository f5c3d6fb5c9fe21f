"""Flushed generations as search sources: cached handles (key index, bloom filter,
blocklist of superseded rows), and turning a vanished generation into a re-plan."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import (
    BaseVersionGoneError,
    CorruptFileError,
    GenerationGoneError,
)
from memwal_query.format import keyfile
from memwal_query.format.bloom import BloomFilter, hash_keys, load_checksummed
from memwal_query.format.bloom import load as load_bloom
from memwal_query.format.schema import (
    ROWADDR_COLUMN,
    TOMBSTONE,
    as_int64,
)
from memwal_query.read import sources, view
from memwal_query.search.caches import OPEN_GENERATIONS
from memwal_query.search.keys import _KeyIndex, _SortedKeyIndex
from memwal_query.storage.io import join

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog


_CHECKOUT_LOCK = threading.Lock()


def _own(ds: lance.LanceDataset) -> lance.LanceDataset:
    """A private handle on the same version (a LanceDataset object must not be used by
    two threads at once; checking out is cheap and shares Lance's caches)."""
    with _CHECKOUT_LOCK:
        return ds.checkout_version(ds.version)


class _GenInfo:
    """What searches need from one flushed generation (cached: generations are immutable).

    Opened lazily: a generation whose bloom filter comes with its checksum
    (``bloom_filter.json``, :func:`memwal_query.format.bloom.load_checksummed`) costs
    a lookup two small reads until the filter says the key may be there; its keys and
    rows then come from its rows sidecar (:func:`memwal_query.read.sources.
    read_generation`, Lance when it has none), and its Lance table is opened only by
    searches that use its indexes (:meth:`dataset`). Without a checksummed filter, the
    Lance table is opened at once (a generation that is gone raises
    :class:`GenerationGoneError`) and the filter is checked against the keys first.
    """

    def __init__(self, table: Catalog, ref: view.GenerationRef) -> None:
        self.ref = ref
        self.uri = ref.uri
        self.io = table.io
        self.pk = list(table.primary_key)
        self.schema = table.schema
        self.storage_options = table.storage_options
        self._ds: lance.LanceDataset | None = None
        self._num_rows: int | None = None
        self._lock = threading.Lock()
        self._keys: _KeyIndex | _SortedKeyIndex | None = None
        self._blocklist: bytes | None = None
        self._blocklist_done = False
        self.keys_file: str | None = None  # the key index file the keys came from
        checked = load_checksummed(table.io, ref.uri)
        # a checksummed filter's negatives are trusted without reading the keys
        self.bloom_checked = checked is not None
        if checked is not None:
            self.bloom: BloomFilter | None = checked
            self.bloom_trusted = True
            self.bloom_corrupt = False
            return
        self._open()
        # A missing or corrupt filter (size, checksum) is not used: a warning, and
        # every key is checked exactly (bloom_trusted False), so answers stay the same.
        loaded = load_bloom(table.io, ref.uri, self.num_rows)
        self.bloom = loaded.filter
        self.bloom_trusted = loaded.trusted
        self.bloom_corrupt = not loaded.trusted

    def _open(self) -> lance.LanceDataset:
        if self._ds is None:
            ref = self.ref
            try:
                ds = lance.dataset(ref.uri, storage_options=self.storage_options or None)
                self._num_rows = ds.count_rows()
            except (ValueError, OSError, FileNotFoundError) as e:
                raise GenerationGoneError(
                    f"generation {ref.generation} of region {ref.region_id} at {ref.uri} is "
                    f"gone or unreadable: {e}"
                ) from e
            self._ds = ds
        return self._ds

    @property
    def ds(self) -> lance.LanceDataset:
        """The generation's Lance table (opened on first use)."""
        return self._open()

    @property
    def num_rows(self) -> int:
        """Rows of the generation."""
        if self._num_rows is None:
            self._open()
        assert self._num_rows is not None
        return self._num_rows

    def rows(self, positions: np.ndarray, columns: list[str]) -> pa.Table:
        """Rows at ``positions`` (in the generation's write order) with ``columns`` of
        the table schema (columns added after the generation was written as NULL),
        from the rows sidecar (cached), or the Lance table when it has none."""
        with _reading(self):
            rows = sources.read_generation(self.ref, self.schema, self.storage_options, columns)
        return rows.take(pa.array(positions))

    def found_rows(self, positions: np.ndarray, columns: list[str], probe: pa.Table) -> pa.Table:
        """:meth:`rows` at the positions the key index gave for the probe keys
        ``probe`` (``columns`` hold the key columns).

        Raises
        ------
        CorruptFileError
            The key index file the index was read from points a key at a row of
            another key (framing, CRC and row count valid, entries not its
            generation's): never another key's row as the answer.
        """
        rows = self.rows(positions, columns)
        if self.keys_file is not None:
            got = as_int64(rows.column(self.pk[0])).to_numpy(zero_copy_only=False)
            want = as_int64(probe.column(self.pk[0])).to_numpy(zero_copy_only=False)
            if not np.array_equal(got, want):
                raise CorruptFileError(
                    self.keys_file, "its entries point keys at rows of other keys"
                )
        return rows

    def _load_keys(self) -> None:
        with self._lock:
            if self._keys is not None:
                return
            stored = self._stored_index()
            if stored is not None:
                self._num_rows = stored.num_rows
                self._keys = _SortedKeyIndex(stored, self.schema.field(self.pk[0]))
                self.keys_file = join(self.uri, keyfile.KEY_INDEX_FILE)
                return
            cols = [*self.pk, TOMBSTONE]
            with _reading(self):
                raw = sources.read_generation(self.ref, self.schema, self.storage_options, cols)
            keys = raw.select(self.pk)
            self._num_rows = raw.num_rows
            if self._by_value and not keys.column(0).null_count:
                # what the flush writes as the key index file: sorted by value, no hashing
                self._keys = _SortedKeyIndex(
                    keyfile.build_index(raw, self.pk), self.schema.field(self.pk[0])
                )
            else:
                tomb = pc.fill_null(raw.column(TOMBSTONE), False).to_numpy(zero_copy_only=False)
                index = np.arange(raw.num_rows, dtype=np.int64)
                self._keys = _KeyIndex(keys, tomb, index)
            if (
                self.bloom is not None
                and not self.bloom_checked
                and not self.bloom.might_contain_hashes(hash_keys(keys)).all()
            ):
                # A bloom filter that denies a key the generation holds (a flipped bit,
                # a truncated file) would hide that key's newer version: ignore it and
                # check every key exactly, as the scan's deduplication does (a
                # checksummed filter needs no such check: its CRC catches those).
                self.bloom = None
                self.bloom_corrupt = True

    @functools.cached_property
    def _by_value(self) -> bool:
        """Whether the key is one integer column (indexed by value, as the flush's key
        index file)."""
        return keyfile.index_key_type(pa.schema([self.schema.field(k) for k in self.pk]))

    def _stored_index(self) -> keyfile.KeyIndex | None:
        """The key index its flush wrote (:func:`memwal_query.format.keyfile.read_index`),
        when the generation has a single integer key and a checksummed bloom filter
        (an unchecked filter is verified against every key, which the index alone
        cannot do); None otherwise, or when the file is missing, damaged or of another
        row count than the region manifest's (then the index is built from the keys)."""
        if not self.bloom_checked or not self._by_value:
            return None
        return keyfile.read_index(self.io, self.uri, self.ref.rows)

    def exists(self) -> bool:
        """Whether the generation's directory is still there (False when unsure)."""
        try:
            return self.io.is_dir(self.uri)
        except Exception:  # noqa: BLE001 - cannot tell: treat as gone
            return False

    def dataset(self) -> lance.LanceDataset:
        """A private handle on the generation's Lance table (see :func:`_own`)."""
        return _own(self.ds)

    @property
    def keys(self) -> _KeyIndex | _SortedKeyIndex:
        """Key index of the generation (loaded on first use)."""
        self._load_keys()
        assert self._keys is not None
        return self._keys

    @property
    def blocklist(self) -> bytes | None:
        """Row addresses of superseded rows and tombstones (Lance prefilter), or None
        (computed on first use: a lookup never needs it)."""
        if not self._blocklist_done:
            dead = np.flatnonzero(~self.live_mask())
            out = None
            if len(dead):
                from lance.dataset import serialize_row_addrs

                with _reading(self):
                    addrs = sources.read_generation(
                        self.ref, self.schema, self.storage_options, [ROWADDR_COLUMN]
                    )
                out = serialize_row_addrs(addrs.column(0).to_numpy()[dead].tolist())
            self._blocklist, self._blocklist_done = out, True
        return self._blocklist

    def live_mask(self) -> np.ndarray:
        """Which dataset rows are the newest version of a live key."""
        keys = self.keys
        live = np.zeros(self.num_rows, bool)
        live[keys.rows[~keys.tombstone]] = True
        return live

    @functools.cached_property
    def indexes(self) -> dict[str, Any]:
        """The generation's Lance indexes by name (listed on first use: a lookup never
        needs them)."""
        return {d.name: d for d in self.ds.describe_indices()}

    def has_index(self, name: str | None) -> bool:
        return name is not None and name in self.indexes

    def might_contain(self, hashes: np.ndarray) -> np.ndarray:
        """Which keys (bloom hashes) may be in the generation. A filter without a
        checksum is first checked against the generation's keys (once; they are loaded
        for the key index anyway), so a negative is trustworthy: a corrupt filter is
        ignored."""
        if not self.bloom_checked:
            self._load_keys()
        if self.bloom is None:
            return np.ones(len(hashes), bool)
        return self.bloom.might_contain_hashes(hashes)


def _gen_info(table: Catalog, ref: view.GenerationRef) -> _GenInfo:
    info = OPEN_GENERATIONS.get(ref.uri)
    if info is None:
        info = _GenInfo(table, ref)
        OPEN_GENERATIONS.put(ref.uri, info)
    return info


@contextlib.contextmanager
def _reading(gen: _GenInfo | None) -> Iterator[None]:
    """Turn an I/O error reading generation ``gen`` into GenerationGoneError.

    A plan (or a cached generation handle) made before the generation was merged and
    garbage collected reads files that are gone; Lance reports that as a plain OSError.
    The handle is dropped from the cache, so a retry reopens (or skips) it.
    """
    if gen is None:
        yield
        return
    try:
        yield
    except GenerationGoneError:
        OPEN_GENERATIONS.pop(gen.uri)
        raise
    except Exception as e:
        # Lance reports a missing file as OSError, or (through an Arrow stream) as
        # ArrowInvalid "LanceError(IO) ... Not found": any error while the generation's
        # directory is gone means the generation is gone, others propagate unchanged.
        if not isinstance(e, OSError) and gen.exists():
            raise
        OPEN_GENERATIONS.pop(gen.uri)
        raise GenerationGoneError(
            f"generation {gen.ref.generation} of region {gen.ref.region_id} at {gen.uri} "
            f"is gone or unreadable: {e}"
        ) from e


_R = TypeVar("_R")


def _retry_when_gone(fn: Callable[..., _R]) -> Callable[..., _R]:
    """Run a search once more, with a fresh read plan, if a generation it read is gone
    or the base version it read was cleaned up.

    A generation disappears only after it was merged (and the index caught up), so a
    fresh plan reads its rows from the base table; a cleaned-up base version has a newer
    one. A second failure propagates as :class:`GenerationGoneError` /
    :class:`BaseVersionGoneError`.
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (GenerationGoneError, BaseVersionGoneError):
            return fn(*args, **kwargs)

    return run
