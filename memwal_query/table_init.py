"""Creating and initializing a table: the base Lance table, its primary key, and the
MemWAL index.

What :meth:`memwal_query.table.MemWalTable.create`,
:meth:`memwal_query.table.MemWalTable.initialize` and ``memwal init`` do before the
table is opened: check the base table (primary key, no MemWAL index yet, region spec,
maintained indexes, leftover regions), mark the primary key when it is given at call
time, optionally reset ``_mem_wal/``, build the primary-key index, then commit the
index. Everything is checked before anything is changed.
"""

from __future__ import annotations

import uuid as uuid_mod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.catalog import LINEAGE_KEY, open_dataset, region_dirs
from memwal_query.exceptions import (
    AlreadyExistsError,
    AlreadyInitializedError,
    LeftoverRegionsError,
    NotInitializedError,
    PrimaryKeyError,
    RegionSpecError,
    SchemaError,
    TableNotFoundError,
)
from memwal_query.format import basekeys
from memwal_query.format import index as mwindex
from memwal_query.format.schema import (
    PK_METADATA_KEY,
    cast_column,
    check_dictionary_types,
    primary_key_columns,
    require_primary_key,
    to_table,
    widen_dictionaries,
)
from memwal_query.storage import paths
from memwal_query.storage.factory import file_io_for
from memwal_query.storage.io import FileIO

if TYPE_CHECKING:
    import lance

    from memwal_query.regions.spec import RegionSpec

CREATE_MODES = ("create", "overwrite")
"""``mode`` of :meth:`memwal_query.table.MemWalTable.create`: refuse an existing table,
or replace it."""


def key_names(primary_key: str | Iterable[str]) -> list[str]:
    """``primary_key`` as a list of column names: one name, a comma-separated list of
    names (the CLI's spelling), or a list; PrimaryKeyError when it names none or a column
    twice."""
    names = primary_key.split(",") if isinstance(primary_key, str) else list(primary_key)
    if not all(isinstance(n, str) for n in names):
        raise PrimaryKeyError(f"primary_key must be column names, got {primary_key!r}")
    keys = [n.strip() for n in names if n.strip()]
    if not keys:
        raise PrimaryKeyError("primary_key names no column")
    if len(set(keys)) != len(keys):
        raise PrimaryKeyError(f"primary_key names a column twice: {keys}")
    return keys


def _key_type_ok(t: pa.DataType) -> bool:
    """Whether Lance and this library accept a column of type ``t`` as (part of) the
    primary key: integers, 32- and 64-bit floats, decimals, booleans, strings, binary,
    dates, times and timestamps; not nested, dictionary or NULL-typed columns, nor
    16-bit floats (Arrow's kernels that match and deduplicate keys have none for them)."""
    return not (
        pa.types.is_nested(t)
        or pa.types.is_dictionary(t)
        or pa.types.is_null(t)
        or pa.types.is_fixed_size_list(t)
        or pa.types.is_float16(t)
    )


def check_key_columns(schema: pa.Schema, keys: list[str], where: str) -> None:
    """PrimaryKeyError naming the column when a key column is absent from ``schema`` or
    of a type a primary key cannot have."""
    missing = [k for k in keys if schema.get_field_index(k) < 0]
    if missing:
        raise PrimaryKeyError(
            f"{where}: primary-key column(s) {missing} are not in the table (columns: "
            f"{schema.names})"
        )
    for k in keys:
        t = schema.field(k).type
        if not _key_type_ok(t):
            raise PrimaryKeyError(
                f"{where}: column {k!r} is {t}: a primary-key column must be an integer, "
                "32- or 64-bit float, decimal, boolean, string, binary, date, time or "
                "timestamp column"
            )


def check_key_values(keys_table: pa.Table, keys: list[str], where: str) -> None:
    """PrimaryKeyError when the key columns of ``keys_table`` hold a NULL or a key
    twice (naming the column, or the first duplicate key value).

    A table with two rows of one key has no "newest row per key" to answer: the rows
    are refused rather than one of them chosen.
    """
    for k in keys:
        nulls = keys_table.column(k).null_count
        if nulls:
            raise PrimaryKeyError(
                f"{where}: primary-key column {k!r} holds {nulls} NULL value(s); every "
                "row needs a key"
            )
    if keys_table.num_rows < 2:
        return
    grouped = keys_table.select(keys).group_by(keys, use_threads=False)
    counts = grouped.aggregate([([], "count_all")])
    dup = pc.greater(counts.column("count_all"), 1)
    if pc.any(dup).as_py():
        first = counts.filter(dup).slice(0, 1).to_pylist()[0]
        n = first.pop("count_all")
        value = first[keys[0]] if len(keys) == 1 else first
        raise PrimaryKeyError(
            f"{where}: primary key {keys} value {value!r} occurs in {n} rows; keys must "
            "be unique (drop the duplicates first, e.g. keep the newest row of each key)"
        )


def with_primary_key(schema: pa.Schema, keys: list[str]) -> pa.Schema:
    """``schema`` with ``keys`` marked as the primary key (non-nullable, with the field
    metadata ``lance-schema:unenforced-primary-key``)."""
    fields = []
    for f in schema:
        if f.name in keys:
            meta = dict(f.metadata or {})
            meta[PK_METADATA_KEY] = b"true"
            f = f.with_nullable(False).with_metadata(meta)
        fields.append(f)
    return pa.schema(fields, metadata=schema.metadata)


def vector_column(column: pa.ChunkedArray, name: str, dim: int | None) -> pa.ChunkedArray:
    """``column`` (a list of floats per row, as a pandas column of arrays arrives) as a
    vector column: a fixed-size list of ``dim`` values (None: the length every row
    has). SchemaError naming the column when it is not a list of numbers or a row has
    another length."""
    t = column.type
    if pa.types.is_fixed_size_list(t):
        if dim is not None and t.list_size != dim:
            raise SchemaError(f"column {name!r} holds vectors of {t.list_size}, not {dim}")
        return column
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not (
        pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type)
    ):
        raise SchemaError(f"column {name!r} is {t}: a vector column must hold lists of numbers")
    value = t.value_type if pa.types.is_floating(t.value_type) else pa.float32()
    lengths = pc.list_value_length(column)
    if dim is None:
        stats = pc.min_max(lengths)
        lo, hi = stats["min"].as_py(), stats["max"].as_py()
        if lo is None:
            raise SchemaError(
                f"column {name!r}: no row has a vector to take the length from; give it "
                f"as vector_columns={{{name!r}: N}}"
            )
        if lo != hi:
            raise SchemaError(
                f"column {name!r}: rows hold vectors of {lo} to {hi} values; a vector "
                "column needs one length"
            )
        dim = int(lo)
    return cast_column(column, pa.field(name, pa.list_(value, dim)))


def creation_data(
    data: Any,
    keys: list[str],
    vector_columns: dict[str, int | None],
    where: str,
) -> pa.Table:
    """The rows (or the empty table of a ``pyarrow.Schema``) a new table starts with:
    vector columns cast to fixed-size lists, dictionary columns given 32-bit indices
    (:func:`memwal_query.format.schema.widen_dictionaries`), the key marked, its values
    checked."""
    if isinstance(data, pa.Schema):
        table = data.empty_table()
    elif data is None:
        raise SchemaError(f"{where}: give the rows to start with, or a pyarrow.Schema")
    else:
        table = to_table(data, where, columns=keys)
    if len(set(table.column_names)) != len(table.column_names):
        raise SchemaError(f"{where}: duplicate column names {table.column_names}")
    check_key_columns(table.schema, keys, where)
    for name, dim in vector_columns.items():
        i = table.schema.get_field_index(name)
        if i < 0:
            raise SchemaError(f"{where}: vector column {name!r} is not in {table.column_names}")
        field = table.schema.field(i)
        col = vector_column(table.column(i), name, dim)
        table = table.set_column(i, field.with_type(col.type), col)
    check_key_values(table.select(keys), keys, where)
    table = widen_dictionaries(table)
    meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != b"pandas"}
    schema = with_primary_key(table.schema.with_metadata(meta), keys)
    return pa.Table.from_arrays(table.columns, schema=schema)


def create_table(
    norm: str,
    options: dict[str, str],
    data: Any,
    *,
    primary_key: str | Iterable[str],
    vector_columns: dict[str, int | None] | Iterable[str] | None = None,
    region_spec: RegionSpec | None = None,
    primary_key_index: bool = True,
    mode: str = "create",
) -> None:
    """Write a new Lance table at ``norm`` from ``data`` with ``primary_key`` marked, and
    its MemWAL index (see :meth:`memwal_query.table.MemWalTable.create`).

    Everything about the input is checked before anything is written; a failure after
    the table is written (the region spec does not fit it) removes the new table
    (``mode="create"``) or restores the replaced version (``mode="overwrite"``).

    Raises
    ------
    AlreadyExistsError, PrimaryKeyError, SchemaError, RegionSpecError, ValueError
    """
    import lance

    if mode not in CREATE_MODES:
        raise ValueError(f"mode must be one of {CREATE_MODES}, got {mode!r}")
    keys = key_names(primary_key)
    if vector_columns is None:
        vectors: dict[str, int | None] = {}
    elif isinstance(vector_columns, dict):
        vectors = dict(vector_columns)
    else:
        vectors = dict.fromkeys(vector_columns)
    table = creation_data(data, keys, vectors, norm)
    previous: lance.LanceDataset | None
    try:
        previous = open_dataset(norm, options)
    except TableNotFoundError:
        previous = None
    if previous is not None and mode == "create":
        raise AlreadyExistsError(
            f"{norm}: a table exists there; open it with MemWalTable.open (or initialize "
            "it), or pass mode='overwrite' to replace it"
        )
    lance.write_dataset(
        table,
        norm,
        mode="create" if previous is None else "overwrite",
        storage_options=options or None,
    )
    try:
        write_index(
            norm,
            options,
            region_spec=region_spec,
            primary_key_index=primary_key_index,
            reset=previous is not None,
        )
    except BaseException:
        if previous is None:
            file_io_for(norm, options).delete_tree(norm)
        else:
            previous.restore()
        raise


def mark_primary_key(
    ds: lance.LanceDataset, keys: list[str], where: str
) -> lance.LanceDataset | None:
    """Check that ``keys`` can be the primary key of the existing table ``ds``.

    Returns None when ``ds`` already declares exactly that key, else ``ds``: the caller
    marks the key with :func:`apply_primary_key` once its other checks passed. Reads
    the key columns of every row (to find NULLs and duplicates).

    Raises
    ------
    PrimaryKeyError
        A key column is absent or of a type a key cannot have, holds NULLs or a key
        twice, or the table declares another primary key.
    """
    declared = primary_key_columns(ds.schema)
    if declared:
        if declared != keys:
            raise PrimaryKeyError(
                f"{where}: the table's primary key is {declared}, not {keys}; a table's "
                "key cannot be changed"
            )
        return None
    check_key_columns(ds.schema, keys, where)
    check_key_values(ds.to_table(columns=keys), keys, where)
    return ds


def apply_primary_key(
    ds: lance.LanceDataset, keys: list[str], norm: str, options: dict[str, str]
) -> lance.LanceDataset:
    """Mark ``keys`` as the primary key of ``ds`` (non-nullable first, as Lance requires);
    returns the dataset's new version."""
    nullable = [k for k in keys if ds.schema.field(k).nullable]
    if nullable:
        ds.alter_columns(*({"path": k, "nullable": False} for k in nullable))  # type: ignore[arg-type]
        ds = open_dataset(norm, options)
    ds.update_field_metadata({k: {PK_METADATA_KEY.decode(): "true"} for k in keys})
    return open_dataset(norm, options)


def check_no_leftover_regions(io: FileIO, uri: str, reset: bool) -> None:
    """LeftoverRegionsError when ``uri``'s ``_mem_wal/`` holds regions (before a new
    MemWAL index is written) and ``reset`` does not allow removing them."""
    leftovers = region_dirs(io, uri)
    if leftovers and not reset:
        more = ", ..." if len(leftovers) > 5 else ""
        raise LeftoverRegionsError(
            f"{uri}: _mem_wal/ holds {len(leftovers)} region(s) of an earlier MemWAL of "
            f"this table ({', '.join(leftovers[:5])}{more}); their rows would be read on "
            "top of the current base table. Pass reset=True (memwal init --reset) to "
            "remove them first.",
            leftovers,
        )


def write_index(
    norm: str,
    options: dict[str, str],
    *,
    region_spec: RegionSpec | None = None,
    maintained_indexes: Iterable[str] | None = None,
    primary_key_index: bool = True,
    reset: bool = False,
    primary_key: str | Iterable[str] | None = None,
) -> None:
    """Write a new MemWAL index into the Lance table at ``norm``.

    Parameters are those of :meth:`memwal_query.table.MemWalTable.initialize` (``norm``:
    the normalized URI, ``options``: its storage options). Everything is checked before
    anything is changed; a ``primary_key`` the table does not declare yet is marked
    last, just before the index is built.

    Raises
    ------
    TableNotFoundError, PrimaryKeyError, AlreadyInitializedError, RegionSpecError,
    NotInitializedError, LeftoverRegionsError, SchemaError
    """
    from memwal_query.regions.checks import check_spec_sources, warn_non_key_sources

    io = file_io_for(norm, options)
    ds = open_dataset(norm, options)
    if mwindex.read_index(io, ds) is not None:
        raise AlreadyInitializedError(f"{norm}: the table already has a MemWAL index")
    check_dictionary_types(ds.schema, norm)
    to_mark = None
    if primary_key is None:
        pk = require_primary_key(ds.schema, norm)
    else:
        pk = key_names(primary_key)
        to_mark = mark_primary_key(ds, pk, norm)
    from memwal_query.regions.spec import unsharded_spec

    if region_spec is None:
        region_spec = unsharded_spec()
    if region_spec.spec_id <= 0:
        raise RegionSpecError(f"region spec id must be positive, got {region_spec.spec_id}")
    check_spec_sources(region_spec, ds.lance_schema, norm, ds.schema)
    warn_non_key_sources(region_spec, ds.lance_schema, pk, norm)
    specs = [region_spec.to_proto()]
    names = list(maintained_indexes or [])
    existing = {i.name for i in ds.describe_indices()}
    missing = [n for n in names if n not in existing]
    if missing:
        raise NotInitializedError(
            f"{norm}: maintained index(es) {missing} do not exist on the base table "
            f"(existing: {sorted(existing)})"
        )
    check_no_leftover_regions(io, norm, reset)
    if to_mark is not None:
        ds = apply_primary_key(to_mark, pk, norm, options)
    if reset:
        io.delete_tree(paths.mem_wal_root(norm))
    key_lance_field = ds.lance_schema.field(pk[0])
    assert key_lance_field is not None  # require_primary_key found it
    key_field = key_lance_field.id()
    if primary_key_index and not any(list(i.fields) == [key_field] for i in ds.describe_indices()):
        ds.create_scalar_index(pk[0], "BTREE")
        ds = open_dataset(norm, options)
    if len(pk) == 1:  # key runs of the base's data files, for count(*) (optional)
        basekeys.summarize(io, norm, ds, pk[0])
    details = mwindex.new_details(specs, names)
    details.writer_config_defaults[LINEAGE_KEY] = uuid_mod.uuid4().hex
    mwindex.commit_details(ds, details, None, storage_options=options)
