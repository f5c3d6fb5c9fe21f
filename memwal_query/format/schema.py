"""Table schema helpers: primary keys, input coercion and validation.

The base table declares its (possibly composite) primary key with the Arrow field
metadata ``lance-schema:unenforced-primary-key: true``. Everything a writer accepts is
coerced here to the table schema, or rejected with a typed error naming the column,
before a single byte is written.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import PrimaryKeyError, SchemaError

PK_METADATA_KEY = b"lance-schema:unenforced-primary-key"
TOMBSTONE = "_tombstone"
GEN_COLUMN = "_gen"
ROWADDR_COLUMN = "_rowaddr"


def primary_key_columns(schema: pa.Schema) -> list[str]:
    """Names of the top-level fields flagged as unenforced primary key, in schema order."""
    keys = []
    for f in schema:
        meta = f.metadata or {}
        if meta.get(PK_METADATA_KEY, b"").lower() == b"true":
            keys.append(f.name)
    return keys


_CACHE_KEYS: dict[int, tuple[pa.Schema, pa.Schema | bytes]] = {}


def cache_key(schema: pa.Schema) -> pa.Schema | bytes:
    """``schema`` as part of a cache key: the schema itself where it hashes, else its
    Arrow IPC serialization (a column of a Python extension type without a hash, such
    as Lance's ``bfloat16``, makes a schema unhashable). Equal schemas give equal keys.
    Remembered per schema object (a table's schema is one object for all its reads:
    no hash of it to try again on every read)."""
    known = _CACHE_KEYS.get(id(schema))
    if known is not None and known[0] is schema:
        return known[1]
    key: pa.Schema | bytes = schema
    try:
        hash(schema)
    except TypeError:
        key = schema.serialize().to_pybytes()
    if len(_CACHE_KEYS) > 64:
        _CACHE_KEYS.clear()
    _CACHE_KEYS[id(schema)] = (schema, key)
    return key


def require_primary_key(schema: pa.Schema, where: str) -> list[str]:
    """Primary-key columns, or PrimaryKeyError naming ``where`` when there are none."""
    keys = primary_key_columns(schema)
    if not keys:
        raise PrimaryKeyError(
            f"{where}: the table has no primary key; name it: "
            "MemWalTable.initialize(uri, primary_key=[...]) or `memwal init URI "
            "--primary-key COLUMNS` (it is the field metadata "
            "'lance-schema:unenforced-primary-key': 'true')"
        )
    return keys


def to_table(data: Any, what: str = "input", columns: Collection[str] = ()) -> pa.Table:
    """Accept a pyarrow Table / RecordBatch / RecordBatchReader / pandas DataFrame / dict.

    Parameters
    ----------
    data : Any
        The input rows (or an object exporting ``__arrow_c_stream__``).
    what : str
        Names the input in error messages.
    columns : collection of str
        Table columns: a pandas index level named like one of them (and not also a
        column) is read as that column (``df.set_index("id")``); other index levels
        are dropped.

    Raises
    ------
    SchemaError
        An unsupported input type, or values pyarrow cannot convert (the message names
        the column).
    """
    if isinstance(data, pa.Table):
        return data
    try:
        if isinstance(data, pa.RecordBatch):
            return pa.Table.from_batches([data])
        if isinstance(data, pa.RecordBatchReader):
            return data.read_all()
        if isinstance(data, dict):
            return pa.table(data)
        try:
            import pandas as pd
        except ImportError:  # pragma: no cover
            pd = None
        if pd is not None and isinstance(data, pd.DataFrame):
            levels = [
                n
                for n in data.index.names
                if isinstance(n, str) and n in columns and n not in data.columns
            ]
            if levels:
                data = data.reset_index(level=levels)
            return pa.Table.from_pandas(data, preserve_index=False)
        if hasattr(data, "__arrow_c_stream__"):
            return pa.table(data)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise SchemaError(f"{what}: cannot convert to Arrow: {e}") from e
    raise SchemaError(
        f"{what}: expected a pyarrow Table, RecordBatch, RecordBatchReader or pandas "
        f"DataFrame, got {type(data).__name__}"
    )


def _type_family(t: pa.DataType) -> str:
    """A coarse kind of type: casts between kinds are refused (see :func:`cast_column`)."""
    if pa.types.is_dictionary(t):
        return _type_family(t.value_type)
    if (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_string_view(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_binary_view(t)
        or pa.types.is_fixed_size_binary(t)
    ):
        return "text"
    if (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_decimal(t)
        or pa.types.is_boolean(t)
    ):
        return "number"
    if pa.types.is_temporal(t):
        return "temporal"
    if pa.types.is_null(t):
        return "null"
    return "nested"


def _check_vector_lengths(column: pa.ChunkedArray, field: pa.Field) -> None:
    """SchemaError naming the first row of a variable-length list (a pandas column of
    arrays arrives as one) whose length is not the vector size of ``field``."""
    size = field.type.list_size
    lengths = pc.list_value_length(column)
    bad = pc.fill_null(pc.not_equal(lengths, size), False)
    if pc.any(bad).as_py():
        row = pc.index(bad, True).as_py()
        raise SchemaError(
            f"column {field.name!r}: row {row} has {lengths[row].as_py()} values, but the "
            f"column holds vectors of {size} ({field.type}); every row needs {size} values "
            "(or NULL)"
        )


WIDE_DICTIONARY_INDEX = pa.int32()
"""The index type of a new table's dictionary columns (see :func:`widen_dictionaries`)."""


def dictionary_capacity(t: pa.DataType) -> int | None:
    """How many distinct values a dictionary column of type ``t`` can hold in one Lance
    data file and one read (127 for int8 indices: the largest index value, which is
    what Arrow unifies dictionaries up to), or None for 32- and 64-bit indices (no limit
    that matters). Lance stores one dictionary per column per data file, and a flush, a
    merge into the base or a compaction writes rows of many writes into one file; a
    read combines the dictionaries of many files and MemTables."""
    if not pa.types.is_dictionary(t) or t.index_type.bit_width >= 32:
        return None
    signed = pa.types.is_signed_integer(t.index_type)
    return int(2 ** (t.index_type.bit_width - (1 if signed else 0))) - 1


def widen_dictionaries(table: pa.Table) -> pa.Table:
    """``table`` with every dictionary column of 8- or 16-bit indices re-typed to
    :data:`WIDE_DICTIONARY_INDEX` indices (a pandas categorical arrives with int8
    indices when it has fewer than 128 categories), and null dictionary values made
    null indices. A new table starts with these types, so later writes may bring any
    number of distinct values."""
    for i, f in enumerate(table.schema):
        if pa.types.is_dictionary(f.type):
            wide = wide_field(f)
            col = pc.cast(normalize_dictionary(table.column(i)), wide.type)
            table = table.set_column(i, wide, col)
    return table


def check_dictionary_types(schema: pa.Schema, where: str) -> None:
    """SchemaError naming the first dictionary column of ``schema`` with 8- or 16-bit
    indices: a table turned into a MemWAL table must not have one (see
    :func:`dictionary_capacity`; reads, merges and compactions combine the rows of many
    writes, so the table as a whole would have to stay within the limit)."""
    for f in schema:
        cap = dictionary_capacity(f.type)
        if cap is not None:
            raise SchemaError(
                f"{where}: column {f.name!r} is {f.type}: at most {cap} distinct values "
                "fit, and a MemWAL table combines the rows of many writes in one data "
                "file (flushes, merges, compactions) and in one read, so it could not "
                "take new values. Rewrite the column with 32-bit indices "
                f"(pa.dictionary(pa.int32(), {f.type.value_type})) or as plain "
                f"{f.type.value_type} values first; MemWalTable.create does so itself"
            )


def normalize_dictionary(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """``column`` (dictionary-encoded) with every chunk whose dictionary holds a null
    value re-encoded, so that a null is a null index: Arrow cannot unify dictionaries
    with null values, which the flush of a MemTable needs. Other chunks unchanged."""
    if not any(c.dictionary.null_count for c in column.chunks):
        return column
    chunks = [
        pc.dictionary_encode(c.dictionary_decode()).cast(column.type)
        if c.dictionary.null_count
        else c
        for c in column.chunks
    ]
    return pa.chunked_array(chunks, column.type)


def normalize_dictionaries(table: pa.Table) -> pa.Table:
    """``table`` with :func:`normalize_dictionary` applied to its dictionary columns."""
    for i, f in enumerate(table.schema):
        if pa.types.is_dictionary(f.type):
            table = table.set_column(i, f, normalize_dictionary(table.column(i)))
    return table


def dictionary_values(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """The distinct dictionary values of a dictionary-encoded ``column`` (its chunks'
    dictionaries unified; O(dictionary size), not O(rows))."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    typ = column.type.value_type
    if not chunks:
        return pa.array([], typ)
    return pc.unique(pa.concat_arrays([c.dictionary.cast(typ) for c in chunks]))


def too_many_values(name: str, t: pa.DataType, found: int, scope: str) -> SchemaError:
    """The SchemaError of a dictionary column of type ``t`` given ``found`` distinct
    values, more than its index type holds in one data file (``scope``: where)."""
    return SchemaError(
        f"column {name!r} is {t}: at most {dictionary_capacity(t)} distinct values fit "
        f"in one data file, and {scope} {found}; nothing was written. Widen the index "
        f"type to int32 (pa.dictionary(pa.int32(), {t.value_type})), or write plain "
        f"{t.value_type} values"
    )


def _dictionary_column(column: pa.ChunkedArray, field: pa.Field) -> pa.ChunkedArray:
    """``column`` as ``field``'s dictionary type: null values as null indices, and for
    an 8- or 16-bit index type one dictionary of the values used (SchemaError naming
    the column when they are more than the index type holds)."""
    t = field.type
    if pa.types.is_dictionary(column.type):
        column = normalize_dictionary(column)
    cap = dictionary_capacity(t)
    if cap is None:
        return column if column.type == t else _plain_cast(column, field)
    values = _plain_cast(column, field.with_type(t.value_type))  # decoded
    encoded = pc.dictionary_encode(values.combine_chunks())
    if len(encoded.dictionary) > cap:
        raise too_many_values(field.name, t, len(encoded.dictionary), "this write has")
    return pa.chunked_array([encoded.cast(t)], t)


def cast_column(column: pa.ChunkedArray, field: pa.Field) -> pa.ChunkedArray:
    """``column`` cast to ``field``'s type, losslessly, within one kind of type.

    Numbers (integers, floats, decimals, 0/1 for bool) convert among themselves, text
    among text and binary, temporal types among themselves, nested among nested, and an
    all-NULL column to anything; a variable-length list (a pandas column of arrays) becomes
    a vector (fixed-size list) when every row has the vector's length. Crossing kinds
    (``"7"`` into an int column, ``12`` into a string column, a datetime into an int64
    column) is a :class:`SchemaError`: pyarrow would parse or print the values, silently
    changing what was written.
    A dictionary column gets its dictionary values checked (see
    :func:`_dictionary_column`).
    """
    if pa.types.is_dictionary(field.type):
        return _dictionary_column(column, field)
    return _plain_cast(column, field)


def _plain_cast(column: pa.ChunkedArray, field: pa.Field) -> pa.ChunkedArray:
    """:func:`cast_column` without the dictionary checks."""
    if column.type == field.type:
        return column
    src_kind, dst_kind = _type_family(column.type), _type_family(field.type)
    if src_kind not in ("null", dst_kind):
        raise SchemaError(
            f"column {field.name!r}: cannot convert {column.type} to {field.type} "
            f"({src_kind} to {dst_kind}); convert the values explicitly first"
        )
    if pa.types.is_fixed_size_list(field.type) and (
        pa.types.is_list(column.type) or pa.types.is_large_list(column.type)
    ):
        _check_vector_lengths(column, field)
    try:
        out = pc.cast(column, field.type, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise SchemaError(
            f"column {field.name!r}: cannot convert {column.type} to {field.type}: {e}"
        ) from e
    src = column.type
    if src_kind == "temporal" and pa.types.is_date(field.type) and not pa.types.is_date(src):
        # pyarrow's "safe" cast of a timestamp to a date drops the time of day
        back = pc.cast(out, src)
        lost = pc.fill_null(pc.not_equal(back, column), False)
        if pc.any(lost).as_py():
            first = column.filter(lost)[0].as_py()
            raise SchemaError(
                f"column {field.name!r}: cannot convert {src} to {field.type} without "
                f"loss: value {first!r} has a time of day"
            )
    numeric = pa.types.is_integer(src) or pa.types.is_floating(src) or pa.types.is_decimal(src)
    if pa.types.is_boolean(field.type) and numeric:
        # a "safe" numeric cast maps every non-zero value to true: only 0/1 are lossless
        ok = pc.is_in(column, value_set=pa.array([0, 1], pa.int8()).cast(src))
        bad = pc.and_(pc.is_valid(column), pc.invert(ok))
        if pc.any(bad).as_py():
            first = column.filter(bad)[0].as_py()
            raise SchemaError(
                f"column {field.name!r}: cannot convert {column.type} to bool without "
                f"loss: value {first!r} is neither 0 nor 1"
            )
    return out


def coerce_rows(data: Any, schema: pa.Schema, pk: list[str]) -> pa.Table:
    """Coerce full upsert rows to ``schema`` (without ``_tombstone``).

    Unknown columns, missing columns, unconvertible types, and missing or NULL
    primary-key values raise. A missing non-key column is an error (not NULL), since an
    upsert replaces the whole row: use :func:`coerce_partial_rows` for partial updates.
    """
    table, missing = coerce_partial_rows(data, schema, pk)
    if missing:
        raise SchemaError(
            f"column(s) {missing} are missing from the input: an upsert replaces whole "
            "rows, so it would set them to NULL. Pass them (NULL explicitly if meant), or "
            "write with partial=True to keep the current values of missing columns"
        )
    return table


def coerce_partial_rows(data: Any, schema: pa.Schema, pk: list[str]) -> tuple[pa.Table, list[str]]:
    """Coerce upsert rows that may lack non-key columns: ``(rows, missing column names)``.

    Missing columns are NULL in ``rows`` (the caller fills them, e.g. with the keys'
    current values); the NULL check of a non-nullable missing column is the caller's.
    """
    table = to_table(data, columns=schema.names)
    extra = [n for n in table.column_names if schema.get_field_index(n) < 0]
    if extra:
        raise SchemaError(
            f"column(s) {extra} are not in the table schema {schema.names}; add them with "
            "t.alter.add_columns(...), or write with schema_mode='merge' (memwal ingest "
            "--schema-mode merge) to add them"
        )
    if len(set(table.column_names)) != len(table.column_names):
        raise SchemaError(f"duplicate column names in input: {table.column_names}")
    columns = []
    missing = []
    for field in schema:
        if field.name in table.column_names:
            col = cast_column(table.column(field.name), field)
            if not field.nullable and field.name not in pk and col.null_count:
                raise SchemaError(f"column {field.name!r} is not nullable but has NULL values")
        elif field.name in pk:
            raise PrimaryKeyError(f"primary-key column {field.name!r} is missing from the input")
        else:
            missing.append(field.name)
            col = pa.chunked_array([pa.nulls(table.num_rows, field.type)], field.type)
        columns.append(col)
    nullable = pa.schema([f.with_nullable(True) if f.name in missing else f for f in schema])
    out = normalize_keys(pa.Table.from_arrays(columns, schema=nullable), pk)
    check_keys(out, pk)
    return out, missing


def coerce_keys(data: Any, schema: pa.Schema, pk: list[str], what: str = "delete keys") -> pa.Table:
    """Coerce a table with the primary-key columns (delete or lookup keys, named ``what``
    in errors) to key columns only."""
    table = to_table(data, what, columns=pk)
    missing = [k for k in pk if k not in table.column_names]
    if missing:
        raise PrimaryKeyError(f"{what} are missing primary-key column(s) {missing}")
    columns = [cast_column(table.column(k), schema.field(k)) for k in pk]
    out = pa.Table.from_arrays(columns, schema=pa.schema([schema.field(k) for k in pk]))
    out = normalize_keys(out, pk)
    check_keys(out, pk)
    return out


def check_keys(table: pa.Table, pk: list[str]) -> None:
    """PrimaryKeyError when any primary-key value is NULL."""
    for k in pk:
        nulls = table.column(k).null_count
        if nulls:
            raise PrimaryKeyError(f"primary-key column {k!r} has {nulls} NULL value(s)")


def with_tombstone(table: pa.Table, tombstone: bool) -> pa.Table:
    """Append the non-null boolean ``_tombstone`` column."""
    col = pa.repeat(pa.scalar(tombstone, pa.bool_()), table.num_rows)
    return table.append_column(pa.field(TOMBSTONE, pa.bool_(), nullable=False), col)


def tombstone_rows(keys: pa.Table, schema: pa.Schema) -> pa.Table:
    """Full-schema rows for deletes: keys set, other columns NULL, ``_tombstone`` true."""
    n = keys.num_rows
    columns = []
    fields = []
    for field in schema:
        if field.name in keys.column_names:
            columns.append(keys.column(field.name))
            fields.append(field)
        else:
            columns.append(pa.nulls(n, field.type))
            # Tombstones need NULL non-key columns: relax nullability, as pylance does.
            fields.append(field.with_nullable(True))
    table = pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=schema.metadata))
    return with_tombstone(table, True)


def storage_schema(schema: pa.Schema) -> pa.Schema:
    """Schema of WAL entries and flushed generations: table columns + ``_tombstone``.

    Non-key columns are nullable so that delete tombstones fit.
    """
    pk = set(primary_key_columns(schema))
    fields = [f if f.name in pk else f.with_nullable(True) for f in schema]
    fields.append(pa.field(TOMBSTONE, pa.bool_(), nullable=False))
    return pa.schema(fields, metadata=schema.metadata)


def as_int64(col: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Integer, boolean or temporal values as int64 (dates in days, times in their unit).

    uint64 values are reinterpreted bit for bit (values >= 2**63 become negative): the
    mapping is one-to-one over the full range, so key equality holds, but order does not.
    """
    t = col.type
    if pa.types.is_int64(t):
        return col
    if pa.types.is_uint64(t):
        if isinstance(col, pa.ChunkedArray):
            return pa.chunked_array([c.view(pa.int64()) for c in col.chunks], pa.int64())
        return col.view(pa.int64())
    if pa.types.is_date32(t) or pa.types.is_time32(t):
        return pc.cast(pc.cast(col, pa.int32()), pa.int64())
    if pa.types.is_boolean(t):
        return pc.cast(pc.cast(col, pa.int8()), pa.int64())
    return pc.cast(col, pa.int64())


def normalize_key_column(col: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Canonical key values: floating ``-0.0`` becomes ``0.0`` (one key, as in Lance)."""
    if pa.types.is_floating(col.type):
        return pc.add(col, pa.scalar(0.0, col.type))  # -0.0 + 0.0 == +0.0
    return col


def normalize_keys(table: pa.Table, pk: list[str]) -> pa.Table:
    """``table`` with its primary-key columns normalized (see normalize_key_column)."""
    for k in pk:
        i = table.schema.get_field_index(k)
        if i >= 0 and pa.types.is_floating(table.schema.field(i).type):
            table = table.set_column(
                i, table.schema.field(i), normalize_key_column(table.column(i))
            )
    return table


def fill_missing(
    rows: pa.Table, missing: list[str], current: pa.Table, pk: list[str], schema: pa.Schema
) -> pa.Table:
    """A partial update's full rows: ``missing`` columns of ``rows`` taken from
    ``current`` (the keys' newest live rows), NULL for keys it lacks.

    Keys are matched as the table matches them: a float ``-0.0`` and ``0.0`` are one
    key (:func:`normalize_keys`), whichever sign the update and the stored row carry.
    Vectorised: keys are matched with ``pc.index_in`` (one key column) or a hash join.
    Raises SchemaError when a non-nullable missing column stays NULL (a new key).
    """
    left = normalize_keys(rows.select(pk), pk)
    right = normalize_keys(current.select(pk), pk)
    if current.num_rows == 0:
        idx = pa.nulls(rows.num_rows, pa.int64())
    elif len(pk) == 1:
        idx = pc.index_in(left.column(0), value_set=right.column(0))
    else:
        import numpy as np

        left = left.append_column("__l", pa.array(np.arange(rows.num_rows)))
        right = right.append_column("__r", pa.array(np.arange(current.num_rows)))
        joined = left.join(right, keys=pk, join_type="left outer", use_threads=False)
        joined = joined.sort_by("__l")
        idx = joined.column("__r")
    out = rows
    for name in missing:
        col = current.column(name).take(idx)
        out = out.set_column(out.schema.get_field_index(name), schema.field(name), col)
    for name in missing:
        field = schema.field(name)
        nulls = out.column(name).null_count
        if not field.nullable and nulls:
            raise SchemaError(
                f"column {name!r} is missing from a partial update and not nullable, but "
                f"{nulls} row(s) have keys that do not exist yet; give it for new keys"
            )
    return out.cast(schema)


RESERVED_COLUMNS = (
    TOMBSTONE,
    GEN_COLUMN,
    ROWADDR_COLUMN,
    "_change_type",
    "_region",
    "_seq",
    "_distance",
    "_score",
    "_rowid",
)
"""Column names the library adds to what it stores or returns: a table column cannot
have one of them."""

SCHEMA_MODES = (None, "merge")
"""``schema_mode`` of a write: None refuses columns the table lacks; ``"merge"`` adds
them (nullable) first, as deltalake's ``write_deltalake(..., schema_mode="merge")``."""


def new_fields(fields: Any, schema: pa.Schema) -> list[pa.Field]:
    """Columns to add to a table of ``schema``: ``fields`` (a ``pyarrow.Field``, a list
    of them, a ``pyarrow.Schema``, or ``{name: type}`` with a ``pyarrow.DataType`` or an
    Arrow type name such as ``"string"``) checked.

    Raises
    ------
    SchemaError
        A field is not nullable (the existing rows have no value for it), exists
        already, is named twice or like a column the library adds (``_tombstone``...),
        or has the NULL type (give its type).
    """
    if isinstance(fields, pa.Field):
        items = [fields]
    elif isinstance(fields, dict):
        items = []
        for name, typ in fields.items():
            if isinstance(typ, str):
                try:
                    typ = pa.type_for_alias(typ)
                except ValueError:
                    raise SchemaError(
                        f"column {name!r}: no Arrow type named {typ!r} (e.g. 'string', "
                        "'int64', 'float64', 'bool', 'timestamp[us]', or a pyarrow.DataType)"
                    ) from None
            if not isinstance(typ, pa.DataType):
                raise SchemaError(f"column {name!r}: expected a pyarrow.DataType, got {typ!r}")
            items.append(pa.field(name, typ))
    else:
        items = list(fields)
    if not items:
        raise SchemaError("no column to add")
    for f in items:
        if not isinstance(f, pa.Field):
            raise SchemaError(f"expected pyarrow.Field(s), got {type(f).__name__}")
        if f.name in schema.names:
            raise SchemaError(f"column {f.name!r} exists already ({schema.field(f.name).type})")
        if f.name in RESERVED_COLUMNS:
            raise SchemaError(f"column name {f.name!r} is reserved (the library adds it)")
        if not f.nullable:
            raise SchemaError(
                f"column {f.name!r} is not nullable, but the rows already written have no "
                "value for it: add it nullable"
            )
        if pa.types.is_null(f.type):
            raise SchemaError(f"column {f.name!r} has no type (all NULL): give its type")
    names = [f.name for f in items]
    if len(set(names)) != len(names):
        raise SchemaError(f"a column is named twice: {names}")
    return [wide_field(f) for f in items]


def wide_field(f: pa.Field) -> pa.Field:
    """``f`` with a dictionary type of 8- or 16-bit indices given
    :data:`WIDE_DICTIONARY_INDEX` indices (see :func:`widen_dictionaries`)."""
    if dictionary_capacity(f.type) is None:
        return f
    return f.with_type(pa.dictionary(WIDE_DICTIONARY_INDEX, f.type.value_type, f.type.ordered))


def extra_columns(data_schema: pa.Schema, schema: pa.Schema) -> list[pa.Field]:
    """Fields of ``data_schema`` (an input's) that ``schema`` (the table's) lacks,
    nullable, in input order: what ``schema_mode="merge"`` adds."""
    return [
        wide_field(f).with_nullable(True) for f in data_schema if schema.get_field_index(f.name) < 0
    ]
