"""memwal_query: LSM (MemWAL) tables on Lance, queried through Apache DataFusion.

Write streaming upserts into regions (WAL + MemTable + flushed generations), merge them
into the Lance base table in the background, and read it all with SQL as if every write
had already been merged.
"""

from __future__ import annotations

import os as _os

QUIET_LANCE_LOG = (
    "warn,lance::index=off,lance::index::vector=warn,lance::index::scalar=warn,"
    "lance::index::vector::builder=error,lance::index::vector::ivf=error"
)
"""The ``LANCE_LOG`` filter set when the variable is unset (before Lance is loaded):
Lance's warnings and errors, except three kinds it logs on successful operations of a
MemWAL table (``lance::index``: the MemWAL system index "has no fields", at every
full-text query; ``lance::index::vector::builder``: "partition N is empty" when a small
generation is indexed with the base's partitions; ``lance::index::vector::ivf``: a note
on index statistics). Set ``LANCE_LOG`` (e.g. ``warn`` or ``debug``) to see everything
Lance logs; see docs/operations.md."""
_os.environ.setdefault("LANCE_LOG", QUIET_LANCE_LOG)

from memwal_query.exceptions import (  # noqa: E402
    AlreadyExistsError,
    AlreadyInitializedError,
    BackpressureError,
    BaseVersionGoneError,
    ChangesGoneError,
    CommitConflictError,
    CorruptFileError,
    CursorError,
    FencedError,
    GenerationGoneError,
    InvalidPathError,
    JobEndedError,
    LeftoverRegionsError,
    ManifestCorruptError,
    MemWalError,
    MergeFailedError,
    NotInitializedError,
    ObjectNotFoundError,
    PrimaryKeyError,
    RegionNotFoundError,
    RegionSpecError,
    RegionSpecWarning,
    SchemaChangedError,
    SchemaError,
    SpecChangedError,
    StorageError,
    TableNotFoundError,
    VersionGoneError,
    WalCorruptError,
    WriteIncompleteError,
    WriterClosedError,
    WrongRegionError,
)

# Heavy modules (lance, datafusion) load on first use, so that light users (the WAL and
# manifest layers, CLI start-up, worker processes) do not pay for them.
_LAZY = {
    "FlushedGeneration": "memwal_query.format.manifest",
    "RegionManifest": "memwal_query.format.manifest",
    "MemTableSnapshot": "memwal_query.write.memtable",
    "RegionField": "memwal_query.regions.spec",
    "RegionSpec": "memwal_query.regions.spec",
    "MemWalTable": "memwal_query.table",
    "region_id_for": "memwal_query.catalog",
    "RegionWriter": "memwal_query.write.writer",
    "MemWalDataset": "memwal_query.read.provider",
    "bucket_spec": "memwal_query.regions.spec",
    "identity_spec": "memwal_query.regions.spec",
    "expression_spec": "memwal_query.regions.spec",
    "unsharded_spec": "memwal_query.regions.spec",
    "register": "memwal_query.session",
    "register_search_functions": "memwal_query.search",
    "memory_usage": "memwal_query.search.memory",
    "set_cache_size_bytes": "memwal_query.storage.cache",
    "cache_size_bytes": "memwal_query.storage.cache",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memwal_query' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "AlreadyExistsError",
    "AlreadyInitializedError",
    "BackpressureError",
    "BaseVersionGoneError",
    "ChangesGoneError",
    "CommitConflictError",
    "CorruptFileError",
    "CursorError",
    "FencedError",
    "FlushedGeneration",
    "GenerationGoneError",
    "InvalidPathError",
    "JobEndedError",
    "LeftoverRegionsError",
    "ManifestCorruptError",
    "MemTableSnapshot",
    "MemWalError",
    "MergeFailedError",
    "MemWalTable",
    "NotInitializedError",
    "ObjectNotFoundError",
    "PrimaryKeyError",
    "RegionField",
    "RegionManifest",
    "RegionSpec",
    "RegionWriter",
    "RegionSpecError",
    "RegionSpecWarning",
    "RegionNotFoundError",
    "SchemaChangedError",
    "SchemaError",
    "SpecChangedError",
    "StorageError",
    "TableNotFoundError",
    "VersionGoneError",
    "WalCorruptError",
    "WriteIncompleteError",
    "WriterClosedError",
    "WrongRegionError",
    "region_id_for",
    "MemWalDataset",
    "register",
    "register_search_functions",
    "bucket_spec",
    "identity_spec",
    "expression_spec",
    "unsharded_spec",
    "memory_usage",
    "cache_size_bytes",
    "set_cache_size_bytes",
]
