"""Helpers shared by the Spark ingest, sink, merge and reader (driver and executors).

Imports neither numpy nor pyarrow at module level: the ``.load()`` planner process of
:class:`~memwal_query.spark.datasource.MemWalDataSource` imports this package only.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    from pyspark.sql.types import StructType

    from memwal_query.regions.spec import RegionSpec
    from memwal_query.table import MemWalTable

REGION_COLUMN = "__memwal_region"
"""Column the routing stage adds: the derived region id of the row."""

SPARK_DIR = "_spark"
"""Directory under ``_mem_wal/`` holding Spark state (streaming sink markers)."""

FAULT_DIR_ENV = "MEMWAL_SPARK_FAULT_DIR"
FAULT_POINTS = (
    "ingest.after_put",
    "sink.before_marker",
    "sink.after_marker",
    "merge.after_generation",
)


WORKER_PYTHON_ENV = "PYSPARK_PYTHON"

CHANGES_SINCE = "changes_since"
"""Data source option asking for the change feed (:mod:`memwal_query.spark.changes`)."""


def is_changes_read(options: Any) -> bool:
    """Whether the data source options ask for the change feed."""
    return any(k.lower() == CHANGES_SINCE for k in options)


def default_worker_python() -> str | None:
    """Run Spark's Python workers with this interpreter unless told otherwise.

    PySpark starts its workers with ``$PYSPARK_PYTHON``, else a ``python3`` found on
    PATH: from a virtualenv that is not on PATH, a worker then fails with
    ``ModuleNotFoundError`` (no memwal_query, lance or pyarrow there). When the variable
    is unset, this sets it to ``sys.executable`` (for SparkContexts started from now on)
    and points an already running *local* SparkContext that still uses the default at
    it too (its Python functions are created afterwards by ``write``, ``merge`` and
    ``register_source``). An explicit ``PYSPARK_PYTHON`` is left alone; on a cluster,
    set it to the executors' interpreter. Returns the interpreter now in force (None
    if PySpark is absent).
    """
    if os.environ.get(WORKER_PYTHON_ENV):
        return os.environ[WORKER_PYTHON_ENV]
    os.environ[WORKER_PYTHON_ENV] = sys.executable
    try:
        from pyspark import SparkContext
    except ImportError:
        return None
    sc = SparkContext._active_spark_context
    master = sc.master if sc is not None else None
    if sc is not None and master and master.startswith("local") and sc.pythonExec == "python3":
        sc.pythonExec = sys.executable
    return sys.executable


class InjectedFault(RuntimeError):
    """Raised by an armed fault point (tests of task retries and restarts)."""


def fault(name: str) -> None:
    """Raise :class:`InjectedFault` once if the fault point ``name`` is armed.

    A point is armed by creating the file ``$MEMWAL_SPARK_FAULT_DIR/{name}``; the first
    process that removes it raises, so exactly one task attempt (or one micro-batch)
    fails, and its retry proceeds. Free when the variable is unset. The variable must be
    set before the SparkSession starts, so that Python workers inherit it.
    """
    directory = os.environ.get(FAULT_DIR_ENV)
    if not directory:
        return
    try:
        os.unlink(os.path.join(directory, name))
    except FileNotFoundError:
        return
    raise InjectedFault(f"injected fault at {name}")


def armed(name: str) -> bool:
    """Whether the fault point ``name`` is armed (disarming it, unless the file says
    ``always``): like :func:`fault`, for points that act (e.g. a concurrent writer
    claiming the region) instead of raising."""
    directory = os.environ.get(FAULT_DIR_ENV)
    if not directory:
        return False
    path = os.path.join(directory, name)
    try:
        with open(path, "rb") as f:
            if f.read().strip() == b"always":
                return True
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def open_table(uri: str, storage_options: dict[str, str] | None) -> MemWalTable:
    """Open the table (a fresh object: newest base version, index and region spec)."""
    from memwal_query.table import MemWalTable

    return MemWalTable.open(uri, storage_options)


def require_spec(table: MemWalTable) -> RegionSpec:
    """The spec Spark ingest routes rows by (:meth:`MemWalTable.routing_spec`: the
    table's spec, or the one-region default for a table whose index records none)."""
    return table.catalog.routing_spec()


def region_id_array(spec: RegionSpec, values: pa.RecordBatch | pa.Table) -> pa.Array:
    """Derived region id (``region_id_for``) of every row of evaluated region values.

    Vectorised: each distinct combination of values is hashed once; NULL is a value of
    its own, as it is a region of its own.

    Parameters
    ----------
    spec : RegionSpec
    values : pa.RecordBatch or pa.Table
        :meth:`RegionSpec.evaluate`'s output (one column per region field).

    Returns
    -------
    pa.Array
        One region id (string) per row.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from memwal_query.table import region_id_for

    n = values.num_rows
    if n == 0:
        return pa.array([], pa.string())
    names = list(values.schema.names)
    uniques: list[pa.Array] = []
    codes: list[np.ndarray] = []
    for name in names:
        col = values.column(name)
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks()
        distinct = pc.unique(col)
        uniques.append(distinct)
        codes.append(
            pc.index_in(col, value_set=distinct, skip_nulls=False)
            .to_numpy(zero_copy_only=False)
            .astype(np.int64)
        )
    sizes = [len(u) for u in uniques]
    if len(names) == 1:
        combos = np.arange(sizes[0], dtype=np.int64)[:, None]
        inverse = codes[0]
    elif float(np.prod([float(s) for s in sizes])) < 2**62:
        combined = np.zeros(n, dtype=np.int64)  # mixed-radix code of the combination
        for code, size in zip(codes, sizes):
            combined = combined * size + code
        present, inverse = np.unique(combined, return_inverse=True)
        combos = np.empty((len(present), len(names)), dtype=np.int64)
        for j in range(len(names) - 1, -1, -1):
            present, combos[:, j] = np.divmod(present, sizes[j])
    else:  # pragma: no cover - astronomically many distinct combinations
        combos, inverse = np.unique(np.stack(codes, axis=1), axis=0, return_inverse=True)
    ids = [
        region_id_for(
            spec.spec_id, {name: uniques[j][int(c[j])].as_py() for j, name in enumerate(names)}
        )
        for c in combos
    ]
    return pa.array(ids, pa.string()).take(pa.array(np.asarray(inverse).reshape(-1)))


def split_by_value(column: pa.Array) -> list[tuple[Any, np.ndarray]]:
    """``[(value, row indices in order), ...]`` for each distinct value of ``column``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    encoded = pc.dictionary_encode(column)
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    out = []
    for idx in np.split(order, bounds):
        if len(idx):
            out.append((encoded.dictionary[int(codes[idx[0]])].as_py(), idx))
    return out


def deprecated_spelling(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (kept one release)."""
    import warnings

    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def option(options: Any, name: str, old: str | None = None, default: Any = None) -> Any:
    """Data source option ``name`` (snake_case; Spark lower-cases option names), else
    its deprecated spelling ``old`` (lower-cased, with a warning), else ``default``."""
    value = options.get(name)
    if value is None and old is not None and options.get(old) is not None:
        deprecated_spelling(f"option({old!r})", f"option({name!r})")
        value = options.get(old)
    return default if value is None else value


def _storage_options(options: Any) -> dict[str, str]:
    """``storage.<key>`` data source options, without the prefix."""
    prefix = "storage."
    return {k[len(prefix) :]: v for k, v in options.items() if k.lower().startswith(prefix)}


def _spark_compatible(t: pa.DataType) -> pa.DataType:
    """``t``, or the type Spark reads it as when Spark has no counterpart of it.

    Unsigned integers widen to the next signed type (``uint64`` to ``decimal(20, 0)``),
    ``float16`` to ``float32`` and ``date64`` to ``date32``: every value is kept.
    """
    import pyarrow as pa

    if pa.types.is_unsigned_integer(t):
        return {8: pa.int16(), 16: pa.int32(), 32: pa.int64()}.get(
            t.bit_width, pa.decimal128(20, 0)
        )
    if pa.types.is_float16(t):
        return pa.float32()
    if pa.types.is_date64(t):
        return pa.date32()
    if pa.types.is_dictionary(t):
        return _spark_compatible(t.value_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        item = t.value_field
        return pa.list_(item.with_type(_spark_compatible(item.type)))
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_spark_compatible(f.type)) for f in t])
    if pa.types.is_map(t):
        return pa.map_(_spark_compatible(t.key_type), _spark_compatible(t.item_type))
    return t


def _wide_decimal(t: pa.DataType) -> bool:
    """Whether ``t`` is or holds a decimal of more than 38 digits (Spark's most)."""
    import pyarrow as pa

    if pa.types.is_decimal(t):
        return bool(t.precision > 38)
    return any(_wide_decimal(t.field(i).type) for i in range(t.num_fields))


def _spark_schema(schema: pa.Schema) -> StructType:
    """The Spark schema of ``schema`` (types Spark lacks widened: :func:`_spark_compatible`).

    Raises
    ------
    SchemaError
        A column of a type Spark has no counterpart of (a decimal of more than 38
        digits, an interval of months, days and nanoseconds), naming it.
    """
    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_schema

    from memwal_query.exceptions import SchemaError

    plain = pa.schema([pa.field(f.name, _spark_compatible(f.type), f.nullable) for f in schema])
    for f in plain:
        try:
            if _wide_decimal(f.type):
                raise ValueError("Spark's decimals have at most 38 digits")
            from_arrow_schema(pa.schema([f]))
        except (TypeError, ValueError) as e:  # PySparkTypeError is a TypeError
            raise SchemaError(
                f"column {f.name!r} of type {schema.field(f.name).type} has no Spark type "
                f"({e}); read the other columns with option columns"
            ) from e
    return from_arrow_schema(plain)
