"""memwal_query: LSM (MemWAL) tables on Lance, queried through Apache DataFusion.

Write streaming upserts into regions (WAL + MemTable + flushed generations), merge them
into the Lance base table in the background, and read it all with SQL as if every write
had already been merged.
"""

from __future__ import annotations

from .exceptions import (
    AlreadyExistsError,
    AlreadyInitializedError,
    BackpressureError,
    BaseVersionGoneError,
    CommitConflictError,
    CorruptFileError,
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
    RegionSpecError,
    RegionSpecWarning,
    SchemaError,
    StorageError,
    TableNotFoundError,
    WalCorruptError,
    WriteIncompleteError,
    WriterClosedError,
    WrongRegionError,
)

# Heavy modules (lance, datafusion) load on first use, so that light users (the WAL and
# manifest layers, CLI start-up, worker processes) do not pay for them.
_LAZY = {
    "FlushedGeneration": ".manifest",
    "RegionManifest": ".manifest",
    "MemTableSnapshot": ".memtable",
    "RegionField": ".regionspec",
    "RegionSpec": ".regionspec",
    "MemWalTable": ".table",
    "region_id_for": ".table",
    "RegionWriter": ".writer",
    "MemWalDataset": ".provider",
    "bucket_spec": ".regionspec",
    "identity_spec": ".regionspec",
    "expression_spec": ".regionspec",
    "unsharded_spec": ".regionspec",
    "register": ".session",
    "register_search_functions": ".search",
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
    "CommitConflictError",
    "CorruptFileError",
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
    "SchemaError",
    "StorageError",
    "TableNotFoundError",
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
]
