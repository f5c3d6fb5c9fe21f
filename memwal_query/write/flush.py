"""MemTable flush: write one generation of a region as a Lance table.

``_mem_wal/{region}/{random 8 hex}_gen_{i}/`` receives:

- the rows, in write order (so ``_rowaddr`` order is write order), with the
  ``_tombstone`` column, as one Lance fragment;
- ``bloom_filter.bin`` over the primary key (see :mod:`memwal_query.format.bloom`);
- ``memwal_rows.bin``, the rows again as one Arrow IPC file with their row addresses
  (see :mod:`memwal_query.format.rowfile`: a first query reads it in one request
  instead of opening the Lance table);
- ``memwal_keys.bin``, the key columns, ``_tombstone`` and row addresses alone (see
  :mod:`memwal_query.format.keyfile`: deduplication and key indexes read only those),
  and ``memwal_region_keys.bin``, the same of every unmerged generation of the region
  up to this one (a first query reads one file per region instead of one per
  generation);
- ``memwal_postings.bin``, the full-text postings of each column with an INVERTED
  index on the base table (see :mod:`memwal_query.format.postings`: a first full-text
  search reads them instead of tokenizing);
- BTREE scalar indexes on the primary key (:func:`pk_index_names`: the key column, or
  each indexable column of a composite key); a single-column key's index files are
  also copied to ``_pk_index/`` where pylance's native MemWAL reader looks for them;
- the maintained indexes (see :mod:`memwal_query.write.genindex`).

The caller then commits the region manifest (fenced by epoch). A flush that dies part
way leaves a directory no manifest references; the retry uses a new random prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import lance
import pyarrow as pa

from memwal_query.format import bloom, keyfile, postings, rowfile
from memwal_query.format.lancetypes import btree_indexable
from memwal_query.format.manifest import FlushedGeneration
from memwal_query.format.schema import normalize_dictionaries
from memwal_query.storage import crashpoints, paths
from memwal_query.storage.io import join
from memwal_query.write.memtable import MemTable

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog

LOG = logging.getLogger(__name__)

BLOOM_FILE = "bloom_filter.bin"
PK_INDEX_NAME = "__memwal_pk"
PK_INDEX_DIR = "_pk_index"
_MAX_ROWS_PER_FILE = 1 << 30
COALESCE_ROWS = 1 << 16  # rows per batch handed to Lance (see ``coalesced_batches``)


def write_generation(
    table: Catalog,
    region_id: str,
    gen_dir: str,
    memtable: MemTable,
    region_keys: list[keyfile.RegionKeysPart] | None = None,
) -> FlushedGeneration:
    """Write ``memtable`` as generation ``memtable.generation`` into ``gen_dir``.

    ``region_keys``: the keys of the region's unmerged generations before this one
    (the writer's, oldest first); this generation's are appended and the list (within
    :data:`memwal_query.format.keyfile.REGION_KEYS_MAX_ROWS` rows) is written as its
    ``memwal_region_keys.bin``, and left as written (the caller keeps it for the next
    flush). Without it, or when the generation gets no keys sidecar, no such file."""
    uri = paths.generation_path(table.uri, region_id, gen_dir)
    data = normalize_dictionaries(memtable.to_table())  # WAL entries of any writer
    ds = lance.write_dataset(
        coalesced_batches(data),
        uri,
        mode="create",
        max_rows_per_file=_MAX_ROWS_PER_FILE,
        max_rows_per_group=max(1024, min(data.num_rows, 1 << 20)),
        storage_options=table.storage_options or None,
    )
    crashpoints.point("flush.mid")
    keys = data.select(table.primary_key)
    bloom.write(table.io, uri, keys)
    try:  # the base's indexes: postings and maintained indexes (one checkout for both)
        base: lance.LanceDataset | None = table.dataset()
    except Exception as e:  # noqa: BLE001 - no postings; the maintained indexes try again
        LOG.warning("generation %s: no full-text postings stored: %s", uri, e)
        base = None
    fragments = [(f.fragment_id, f.metadata.physical_rows) for f in ds.get_fragments()]
    if sum(n for _, n in fragments) == data.num_rows:  # else: readers use Lance only
        addresses = rowfile.row_addresses(fragments)
        rowfile.write(table.io, uri, data, addresses)
        stored = keyfile.write(table.io, uri, data, list(table.primary_key), addresses)
        if keyfile.index_key_type(keys.schema) and not keys.column(0).null_count:
            keyfile.write_index(table.io, uri, stored, list(table.primary_key))
        if region_keys is not None:
            part = keyfile.RegionKeysPart(memtable.generation, gen_dir, stored)
            try:
                region_keys[:] = keyfile.write_region(table.io, uri, [*region_keys, part])
            except Exception as e:  # noqa: BLE001 - an optimisation never fails a flush
                LOG.warning("generation %s: no region keys file: %s", uri, e)
                region_keys.clear()  # the next flush's file starts afresh
        _write_postings(table, uri, data, base)
    if pk_index_names(keys.schema):
        build_pk_indexes(ds, keys.schema)
        if len(table.primary_key) == 1:
            _publish_pk_index(table, ds, uri)
    if table.maintained_indexes:
        from memwal_query.write.genindex import build_maintained_indexes

        build_maintained_indexes(table, ds, base)
    return FlushedGeneration(
        generation=memtable.generation,
        path=gen_dir,
        in_memory_bytes=data.nbytes,
        physical_rows=data.num_rows,
        primary_key_bytes=keys.nbytes,
    )


POSTINGS_MAX_TEXT_BYTES = 512 * 1024
"""Most text (bytes, per indexed column) whose full-text postings a flush stores
(:mod:`memwal_query.format.postings`): tokenizing costs about a microsecond per token in
Lance's tokenizer, so this bounds the flush's extra work to ~0.1 s. A generation with
more text, or whose tokenizer cannot tokenize documents in bulk (n-grams, raw), is
tokenized by the first search that needs it instead."""


def _write_postings(
    table: Catalog, uri: str, data: pa.Table, base: lance.LanceDataset | None
) -> None:
    """Store the postings of every column with an INVERTED index on the base table, as
    its tokenizer splits them (best effort: a generation without them is tokenized at
    query time, so any failure here is logged, never raised)."""
    from memwal_query.format.baseindex import fts_tokenizers

    if base is None:
        return
    try:
        entries = [
            (column, kw, postings.Postings.of(data.column(column), kw))
            for column, kw in fts_tokenizers(base)
            if column in data.column_names
            and postings.text_bytes(data.column(column)) <= POSTINGS_MAX_TEXT_BYTES
            and postings.separator(kw) is not None
        ]
        if entries:
            postings.write(table.io, uri, entries)
    except Exception as e:  # noqa: BLE001 - an optimisation never fails a flush
        LOG.warning("generation %s: no full-text postings stored: %s", uri, e)


def pk_index_names(key_schema: pa.Schema) -> dict[str, str]:
    """``{key column: index name}`` of the primary-key BTREE indexes of a generation.

    Lance builds a BTREE over one column of a type :func:`btree_indexable` accepts
    (integers, floats, booleans, strings, binaries, decimals, temporal types) and over
    one column only (``create_scalar_index`` of several columns raises "Scalar indices
    currently only support a single column", pylance 14). So a single-column key gets
    ``__memwal_pk``; a composite key gets one index per indexable key column,
    ``__memwal_pk_0``, ``__memwal_pk_1``... by key position (Lance answers ``a = x AND
    b = y`` by intersecting them). A column of another type gets none: the bloom filter
    and the key index readers build from the key columns replace it.
    """
    if len(key_schema) == 1:
        return {key_schema[0].name: PK_INDEX_NAME} if btree_indexable(key_schema[0].type) else {}
    return {
        f.name: f"{PK_INDEX_NAME}_{i}" for i, f in enumerate(key_schema) if btree_indexable(f.type)
    }


def build_pk_indexes(ds: lance.LanceDataset, key_schema: pa.Schema) -> None:
    """Build the primary-key BTREE indexes of :func:`pk_index_names` on generation ``ds``."""
    for column, name in pk_index_names(key_schema).items():
        ds.create_scalar_index(column, "BTREE", name=name)


def coalesced_batches(data: pa.Table, min_rows: int = COALESCE_ROWS) -> pa.RecordBatchReader:
    """``data`` as a stream of record batches of at least ``min_rows`` rows (but the last).

    A MemTable holds one batch per put: a million rows put 100 at a time are 10,000
    batches, and Lance writes many small batches ~20x slower than a few large ones
    (measured, pylance 14: 2.6 s against 0.13 s for 1M rows). Consecutive batches are
    concatenated one group at a time, so at most one group is copied at once.
    """
    batches = data.to_batches()
    schema = data.schema

    def groups() -> Iterator[pa.RecordBatch]:
        group: list[pa.RecordBatch] = []
        rows = 0
        for batch in batches:
            if batch.num_rows >= min_rows and not group:
                yield batch
                continue
            group.append(batch)
            rows += batch.num_rows
            if rows >= min_rows:
                yield pa.concat_batches(group)
                group, rows = [], 0
        if group:
            yield pa.concat_batches(group)

    return pa.RecordBatchReader.from_batches(schema, groups())


def _publish_pk_index(table: Catalog, ds: lance.LanceDataset, uri: str) -> None:
    """Copy the BTREE files to ``_pk_index/``, where pylance's native reader expects them."""
    (desc,) = [d for d in ds.describe_indices() if d.name == PK_INDEX_NAME]
    index_dir = join(uri, "_indices", desc.segments[0].uuid)
    for name in table.io.list(index_dir):
        table.io.write(join(uri, PK_INDEX_DIR, name), table.io.read(join(index_dir, name)))
