"""``spark.read.format("memwal")``: a PySpark Python Data Source over the LSM view.

Register once per session with :func:`register_source`, then::

    df = spark.read.format("memwal").load(uri)                      # every column
    df = spark.read.format("memwal").option("columns", "id,val").load(uri)
    df = spark.read.format("memwal").schema("id long, val double").load(uri)

Contract: the same rows as the DataFusion provider (:meth:`MemWalTable.provider`)
with the same ``consistency`` (``latest`` by default: every acknowledged write), read
from a view pinned when Spark plans the query and kept for later queries of the same
DataFrame. Partitions hold about ``rows_per_split`` rows each and together each live
row once. Pieces of the pinned view that GC removed raise
:class:`~memwal_query.exceptions.BaseVersionGoneError` or
:class:`~memwal_query.exceptions.GenerationGoneError` (load the DataFrame again).
:func:`read` (``mqs.read``) reads a view of at most ``driver_read_bytes`` in the driver
instead, with this module's reader, pinned at the call (:func:`read_in_driver`).
Options are checked in the caller's process (:func:`check_read`). Filter pushdown is
opt-in (``option("push_filters", "true")``; :class:`PushdownWarning`): pushed filters
are evaluated exactly, on the newest version of each key.

Partitions, column pruning, why pushdown is off by default: docs/spark.md ("Reader:
``spark.read.format("memwal")``").
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import lance
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSourceReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StructType

from memwal_query.exceptions import BaseVersionGoneError, MemWalError, SchemaError
from memwal_query.format.lancetypes import lance_filterable
from memwal_query.read import newer, pointview, view
from memwal_query.spark._common import (
    _spark_schema,
    _storage_options,
    armed,
    deprecated_spelling,
    is_changes_read,
    open_table,
    option,
)
from memwal_query.spark.datasource import FORMAT, MemWalDataSource
from memwal_query.storage.cache import LRUCache

try:  # PySpark >= 4.1
    from pyspark.sql import datasource as _ds

    _FILTERS = {
        name: getattr(_ds, name)
        for name in (
            "EqualTo",
            "EqualNullSafe",
            "GreaterThan",
            "GreaterThanOrEqual",
            "LessThan",
            "LessThanOrEqual",
            "In",
            "IsNull",
            "IsNotNull",
            "Not",
            "StringStartsWith",
            "StringEndsWith",
            "StringContains",
        )
    }
except AttributeError:  # pragma: no cover - PySpark 4.0: no pushdown API
    _FILTERS = {}

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from memwal_query.table import MemWalTable

PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"
KEY_PINNED_POINT = "read.key_pinned"
"""The point a reader disarms (:func:`memwal_query.spark._common.armed`) when it reads a
key-pinned view: how tests see, across Spark's worker processes, that it was taken."""
DEFAULT_ROWS_PER_SPLIT = 1_000_000
#: :func:`read`'s ``driver_read_bytes``: views of at most this many Arrow bytes are read
#: in the driver and handed to Spark as data (``0``: never).
DEFAULT_DRIVER_READ_BYTES = 64 << 20

_CMP = {
    "EqualTo": ("==", "!="),
    "GreaterThan": (">", "<="),
    "GreaterThanOrEqual": (">=", "<"),
    "LessThan": ("<", ">="),
    "LessThanOrEqual": ("<=", ">"),
}
_PRUNE_OP = {"==": "=", ">": ">", ">=": ">=", "<": "<", "<=": "<="}
_STRING_FNS = {
    "StringStartsWith": pc.starts_with,
    "StringEndsWith": pc.ends_with,
    "StringContains": pc.match_substring,
}


# -- filters ---------------------------------------------------------------------------
def _pushable_type(t: pa.DataType) -> bool:
    return (
        pa.types.is_integer(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_boolean(t)
        or pa.types.is_date(t)
        or pa.types.is_decimal(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    )


def _literal(value: Any, t: pa.DataType) -> pa.Scalar:
    if value is None or isinstance(value, float) and math.isnan(value):
        raise ValueError("NULL/NaN literal")
    if isinstance(value, dt.datetime):
        raise ValueError("timestamp literal")
    if isinstance(value, bool) != pa.types.is_boolean(t):
        raise ValueError("boolean mismatch")
    if isinstance(value, float) and not pa.types.is_floating(t):
        if not value.is_integer():
            raise ValueError("fractional literal on a non-float column")
        value = int(value) if not pa.types.is_decimal(t) else decimal.Decimal(value)
    if isinstance(value, decimal.Decimal) and pa.types.is_integer(t):
        if value != value.to_integral_value():  # pyarrow would truncate 5.5 to 5
            raise ValueError("fractional literal on an integer column")
        value = int(value)
    return pa.scalar(value, type=t)


def filter_expression(
    f: Any, schema: pa.Schema, negate: bool = False
) -> tuple[pc.Expression, list[tuple[str, str, Any]]]:
    """A Spark data source ``Filter`` as a pyarrow expression (+ pruning predicates).

    The expression keeps exactly the rows for which Spark's filter (or its negation)
    is true, NULLs included.

    Parameters
    ----------
    f : pyspark.sql.datasource.Filter
    schema : pa.Schema
        The table schema the filter's columns refer to.
    negate : bool
        Translate ``NOT f`` instead.

    Returns
    -------
    tuple
        ``(expression, pruning predicates)``: the pyarrow expression, and
        ``(column, op, value)`` predicates that region pruning can use.

    Raises
    ------
    ValueError
        The filter is not supported (Spark then evaluates it).
    """
    kind = type(f).__name__
    if kind == "Not":
        expr, _ = filter_expression(f.child, schema, not negate)
        return expr, []
    attr = getattr(f, "attribute", None)
    if not isinstance(attr, tuple) or len(attr) != 1:
        raise ValueError("nested or missing column")
    name = attr[0]
    idx = schema.get_field_index(name)
    if idx < 0:
        raise ValueError(f"unknown column {name!r}")
    t = schema.field(idx).type
    if not _pushable_type(t):
        raise ValueError(f"type {t} is not pushed")
    col = pc.field(name)
    if kind == "IsNull" or kind == "IsNotNull":
        want_null = (kind == "IsNull") != negate
        return (col.is_null() if want_null else col.is_valid()), []
    if kind in _CMP:
        op = _CMP[kind][1 if negate else 0]
        lit = _literal(f.value, t)
        expr = {
            "==": col == lit,
            "!=": col != lit,
            "<": col < lit,
            "<=": col <= lit,
            ">": col > lit,
            ">=": col >= lit,
        }[op]
        preds = [(name, _PRUNE_OP[op], lit.as_py())] if op in _PRUNE_OP else []
        return expr, preds
    if kind == "EqualNullSafe":
        if f.value is None:
            return (col.is_valid() if negate else col.is_null()), []
        raise ValueError("null-safe equality with a value")
    if kind == "In":
        values = [_literal(v, t) for v in f.value]
        if not values:
            raise ValueError("empty IN")
        isin = col.isin(pa.array([v.as_py() for v in values], type=t))
        if negate:  # NOT IN: NULL stays NULL (dropped)
            return (~isin) & col.is_valid(), []
        return isin, [(name, "in", [v.as_py() for v in values])]
    if kind in _STRING_FNS:
        if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
            raise ValueError("string filter on a non-string column")
        if not isinstance(f.value, str):
            raise ValueError("non-string pattern")
        expr = _STRING_FNS[kind](col, pattern=f.value)
        return ((~expr) & col.is_valid() if negate else expr), []
    raise ValueError(f"filter {kind} is not supported")


def _filter_column(f: Any) -> str:
    """The column a (supported) Spark filter reads."""
    while type(f).__name__ == "Not":
        f = f.child
    return f.attribute[0]


def _combine(filters: Sequence[Any], schema: pa.Schema):
    expr = None
    preds: list[tuple[str, str, Any]] = []
    for f in filters:
        e, p = filter_expression(f, schema)
        expr = e if expr is None else expr & e
        preds.extend(p)
    return expr, preds


# -- partitions ------------------------------------------------------------------------
class NewerPartition(InputPartition):
    """The newest rows of every planned region (generations; WAL tails with
    ``consistency="latest"``), deduplicated by :func:`memwal_query.read.newer.newer_view`
    (the provider's code and rule)."""

    def __init__(self, regions: list[view.RegionView], consistency: str) -> None:
        super().__init__(tuple(r.region_id for r in regions))
        self.regions = regions
        self.consistency = consistency

    def plan(self) -> view.ReadPlan:
        """The partition's regions as a read plan (no base: read by BasePartition)."""
        return view.ReadPlan(None, None, self.regions, [], self.consistency)  # type: ignore[arg-type]


class BasePartition(InputPartition):
    """Pieces of the pinned base version, minus keys of the ``newer`` partition; with
    ``with_newer``, the ``newer`` partition's rows too (one task reads both, so that the
    tasks of a query carry about the same number of rows).

    A piece is ``(fragment_id, offset, limit)``: that row range of the fragment, or the
    whole fragment when ``offset`` is None."""

    def __init__(
        self,
        version: int,
        pieces: list[tuple[int, int | None, int | None]],
        newer: NewerPartition | None,
        with_newer: bool = False,
    ) -> None:
        super().__init__((tuple(pieces), with_newer))
        self.version = version
        self.pieces = pieces
        self.newer = newer
        self.with_newer = with_newer


def split_rows(
    fragments: Sequence[tuple[int, int]], newer_rows: int, rows_per_split: int, cut: bool
) -> list[list[tuple[int, int | None, int | None]]]:
    """Base pieces of each task: ``ceil(rows / rows_per_split)`` tasks of about equal
    rows, the first one also reading the ``newer_rows`` rows of the regions.

    ``fragments`` are ``(fragment_id, rows)`` in order. With ``cut``, a fragment is cut
    into row ranges ``(fragment_id, offset, limit)`` to balance the tasks; without (a
    pushed filter: Lance's offset/limit count filtered rows), whole fragments
    ``(fragment_id, None, None)`` are packed, a fragment larger than what is left of a
    task starting the next task.
    """
    total = newer_rows + sum(n for _, n in fragments)
    tasks = max(1, -(-total // max(1, rows_per_split)))
    target = max(1, -(-total // tasks))
    out: list[list[tuple[int, int | None, int | None]]] = [[]]
    filled = newer_rows
    for fid, n in fragments:
        if not cut:
            if filled and filled + n > target:
                out.append([])
                filled = 0
            out[-1].append((fid, None, None))
            filled += n
            continue
        start = 0
        while start < n:
            if filled >= target:
                out.append([])
                filled = 0
            take = min(n - start, target - filled)
            out[-1].append((fid, None, None) if take == n else (fid, start, take))
            filled += take
            start += take
    return out


def _newer_rows(plan: view.ReadPlan, storage_options: dict[str, str]) -> int:
    """Rows of the plan's generations and MemTables (duplicates included): the size
    of the regions' partition, for balancing (generation row counts are cached)."""
    rows = 0
    for r in plan.regions:
        rows += sum(m.num_rows for m in r.memtables)
        for g in r.generations:
            n = _GENERATION_ROWS.get(g.uri)
            if n is None:
                ds = lance.dataset(g.uri, storage_options=storage_options or None)
                n = _GENERATION_ROWS.put(g.uri, ds.count_rows())
            rows += n
    return rows


# generation directory -> rows (generations are immutable)
_GENERATION_ROWS: LRUCache[str, int] = LRUCache(4096)


# -- the data source -------------------------------------------------------------------


def _to_spark_array(a: pa.Array, t: pa.DataType) -> pa.Array:
    """``a`` cast to ``t`` (the output schema's type); nanosecond timestamps are floored
    to Spark's microseconds, as PySpark itself converts pandas' nanoseconds."""
    if a.type == t:
        return a
    if pa.types.is_timestamp(a.type) and a.type.unit == "ns" and pa.types.is_timestamp(t):
        a = pc.floor_temporal(a, unit="microsecond")
    return a.cast(t)


class MemWalReader(DataSourceReader):
    """Reader of one query (picklable; see the module docs).

    Parameters
    ----------
    uri : str
    options : dict
        Data source options.
    schema : StructType
        Columns to return (a subset of the table's, by name).
    """

    def __init__(
        self,
        uri: str,
        options: dict[str, str],
        schema: StructType,
        table: MemWalTable | None = None,
    ) -> None:
        self.uri = uri
        self.options = options
        self.schema = schema
        self.consistency = options.get("consistency", view.DEFAULT_CONSISTENCY)
        self.as_of = options.get("as_of")  # time travel (memwal_query.read.view.resolve_as_of)
        self.rows_per_split = int(
            option(options, "rows_per_split", "rowspersplit", DEFAULT_ROWS_PER_SPLIT)
        )
        self.storage_options = _storage_options(options)
        self.filters: list[Any] = []
        table = table if table is not None else open_table(uri, self.storage_options)
        self._table = table  # reused by partitions() in this process, not pickled
        self.uri = table.uri
        self.table_schema = table.schema
        self.primary_key = list(table.primary_key)
        missing = [n for n in schema.fieldNames() if table.schema.get_field_index(n) < 0]
        if missing:
            raise SchemaError(f"{uri}: column(s) {missing} are not in the table")
        self.columns = schema.fieldNames()
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")

    def __getstate__(self) -> dict[str, Any]:
        """Picklable state (the open table stays in the planning process)."""
        state = dict(self.__dict__)
        state.pop("_table", None)
        return state

    # planning ------------------------------------------------------------------------
    def _expression(self):
        return _combine(self.filters, self.table_schema)

    def partitions(self) -> list[InputPartition]:
        """Resolve the view now: tasks of about ``rows_per_split`` rows each, of equal size,
        the first one reading the regions' rows too (:func:`split_rows`)."""
        return self._plan()[0]

    def _plan(self) -> tuple[list[InputPartition], int, int]:
        """:meth:`partitions`, with the planned view's base rows and newer rows (the
        generations' and WAL tails' rows, duplicates included)."""
        table = self.__dict__.pop("_table", None) or open_table(self.uri, self.storage_options)
        _, preds = self._expression()
        plan = view.resolve(table.catalog, self.consistency, None, preds or None, as_of=self.as_of)
        newer = NewerPartition(plan.regions, plan.consistency) if plan.regions else None
        newer_rows = _newer_rows(plan, self.storage_options) if newer is not None else 0
        fragments = [(f.fragment_id, f.count_rows()) for f in plan.base.get_fragments()]
        tasks = split_rows(fragments, newer_rows, self.rows_per_split, cut=not self.filters)
        version = plan.base.version
        parts: list[InputPartition] = [
            BasePartition(version, pieces, newer, with_newer=i == 0 and newer is not None)
            for i, pieces in enumerate(tasks)
        ]
        return parts, sum(n for _, n in fragments), newer_rows

    # reading -------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Rows of one partition as Arrow batches of the output schema."""
        if not isinstance(partition, BasePartition):  # pragma: no cover
            raise MemWalError(f"unknown partition {partition!r}")
        # One view of the newer rows per task: its rows and the keys masking the base.
        newer_view = self._view(partition.newer) if partition.newer is not None else None
        if partition.with_newer and newer_view is not None:
            yield from self._read_newer(newer_view)
        if partition.pieces:
            yield from self._read_base(partition, newer_view)

    def _view(self, part: NewerPartition) -> newer.NewerView:
        """The newer rows of ``part``: when the pushed filters pin the primary key to a
        few literals (:func:`memwal_query.read.pointview.pinned_keys`), those keys'
        rows only (:func:`memwal_query.read.pointview.point_view`: the same newest row
        of each such key as the full view's), else the full view."""
        plan = part.plan()
        if self.filters:
            _, preds = self._expression()
            keys = pointview.pinned_keys(preds, self.table_schema, self.primary_key)
            if keys is not None:
                armed(KEY_PINNED_POINT)  # tests: observe that the key-pinned view was read
                return pointview.point_view(
                    plan, self.table_schema, self.primary_key, keys, self.storage_options
                )
        return newer.newer_view(plan, self.table_schema, self.primary_key, self.storage_options)

    def _out(self, batch: pa.RecordBatch | pa.Table) -> Iterator[pa.RecordBatch]:
        if isinstance(batch, pa.Table):
            batches = batch.to_batches(max_chunksize=65536)
        else:
            batches = [batch]
        for b in batches:
            if b.num_rows == 0:
                continue
            arrays = []
            for f in self.arrow_schema:
                arrays.append(_to_spark_array(b.column(f.name), f.type))
            yield pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)

    def _read_newer(self, newer_view: newer.NewerView) -> Iterator[pa.RecordBatch]:
        expr, _ = self._expression()
        used = [_filter_column(f) for f in self.filters]
        yield from self._out(newer_view.live(self.columns, expr, used))

    def _read_base(
        self, part: BasePartition, newer_view: newer.NewerView | None
    ) -> Iterator[pa.RecordBatch]:
        try:
            ds = lance.dataset(
                self.uri, version=part.version, storage_options=self.storage_options or None
            )
        except (ValueError, OSError) as e:  # the pinned version was cleaned up
            raise BaseVersionGoneError(
                f"{self.uri}: base version {part.version} this DataFrame planned on is gone "
                f"(load the DataFrame again): {e}"
            ) from e
        keys = newer_view.keys if newer_view is not None else None
        # Filters on columns Lance cannot filter are evaluated here, after the scan.
        in_lance = [
            f
            for f in self.filters
            if lance_filterable(self.table_schema.field(_filter_column(f)).type)
        ]
        in_arrow = [f for f in self.filters if not any(f is g for g in in_lance)]
        lance_expr, _ = _combine(in_lance, self.table_schema)
        arrow_expr, _ = _combine(in_arrow, self.table_schema)
        read_cols = list(
            dict.fromkeys(
                self.columns
                + (self.primary_key if keys is not None and len(keys) else [])
                + [_filter_column(f) for f in in_arrow]
            )
        )
        whole: list[Any] = []  # whole fragments: one scan; row ranges: one scan each
        scans: list[tuple[list[Any], int | None, int | None]] = []
        for fid, offset, limit in part.pieces:
            fragment = ds.get_fragment(fid)
            if fragment is None:  # the pinned version lists it: it cannot vanish
                raise BaseVersionGoneError(
                    f"{ds.uri}: fragment {fid} of version {ds.version} is gone"
                )
            if offset is None:
                whole.append(fragment)
            else:
                scans.append(([fragment], offset, limit))
        if whole:
            scans.insert(0, (whole, None, None))
        for fragments, offset, limit in scans:
            scanner = ds.scanner(
                columns=read_cols,
                filter=lance_expr,
                fragments=fragments,
                batch_size=65536,
                offset=offset,
                limit=limit,
            )
            for batch in scanner.to_batches():
                if keys is not None and len(keys):
                    mask = keys.contains(batch.select(self.primary_key))
                    if mask.any():
                        batch = batch.filter(pa.array(~mask))
                if arrow_expr is not None and batch.num_rows:
                    batch = batch.filter(arrow_expr)
                yield from self._out(batch.select(self.columns))


class MemWalPushdownReader(MemWalReader):
    """:class:`MemWalReader` that takes Spark's filters (PySpark >= 4.1)."""

    def pushFilters(self, filters: list[Any]) -> Iterator[Any]:
        """Keep the filters evaluated exactly here; return the others to Spark."""
        for f in filters:
            try:
                filter_expression(f, self.table_schema)
            except Exception:  # noqa: BLE001 - anything we cannot express stays with Spark
                yield f
                continue
            self.filters.append(f)


def check_read(uri: str, options: Any) -> tuple[MemWalTable, pa.Schema]:
    """Open the table and check the read options: ``(table, schema to return)``.

    Checks ``consistency``, ``rows_per_split``, ``push_filters``, ``columns``,
    ``driver_read_bytes`` and ``as_of`` (names are case-insensitive, as Spark passes
    them; ``rowsPerSplit`` and ``pushFilters`` are their deprecated spellings).

    Raises
    ------
    TableNotFoundError, NotInitializedError
        No MemWAL table at ``uri``.
    MemWalError, SchemaError
        A bad option value (the message names the option) or an unknown column.
    """
    from memwal_query.read.view import CONSISTENCY_MODES, as_of_moment

    opts = {str(k).lower(): v for k, v in options.items()}
    table = open_table(uri, _storage_options(opts))
    consistency = opts.get("consistency", view.DEFAULT_CONSISTENCY)
    if consistency not in CONSISTENCY_MODES:
        raise MemWalError(
            f"memwal data source: option consistency={consistency!r}: use one of "
            + ", ".join(CONSISTENCY_MODES)
        )
    # an error names the option as the caller spelled it (the deprecated spelling too)
    given = {str(k).lower(): str(k) for k in options}
    key = "rows_per_split" if "rows_per_split" in opts else "rowspersplit"
    split = str(opts.get(key, DEFAULT_ROWS_PER_SPLIT))
    if not split.isdigit() or int(split) <= 0:
        raise MemWalError(
            f"memwal data source: option {given.get(key, key)}={split!r}: give a positive "
            "number of rows"
        )
    key = "push_filters" if "push_filters" in opts else "pushfilters"
    push = str(opts.get(key, "false")).lower()
    if push not in ("true", "false"):
        raise MemWalError(
            f"memwal data source: option {given.get(key, key)}={push!r}: use true or false"
        )
    budget = str(opts.get("driver_read_bytes", DEFAULT_DRIVER_READ_BYTES))
    if not budget.isdigit():
        raise MemWalError(
            f"memwal data source: option {given.get('driver_read_bytes')}={budget!r}: give "
            "a number of bytes (0: never read in the driver)"
        )
    if opts.get("as_of") is not None:
        as_of_moment(table.catalog, opts["as_of"])  # a bad or unknown moment: its typed error
    schema = table.schema
    cols = opts.get("columns")
    if cols is not None:
        names = [c.strip() for c in cols.split(",") if c.strip()]
        if not names:
            raise SchemaError(
                f"{table.uri}: option columns={cols!r} names no column "
                "(leave it out to read every column)"
            )
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise SchemaError(f"{table.uri}: option columns names {twice} more than once")
        missing = [n for n in names if schema.get_field_index(n) < 0]
        if missing:
            raise SchemaError(f"{table.uri}: column(s) {missing} are not in the table")
        schema = pa.schema([schema.field(n) for n in names])
    return table, schema


# -- the driver path -------------------------------------------------------------------
_LOCAL_RELATION_CONF = "spark.sql.execution.arrow.localRelationThreshold"
_BATCH_ROWS_CONF = "spark.sql.execution.arrow.maxRecordsPerBatch"
_CONF_LOCK = threading.Lock()


def _least_bytes(t: pa.DataType) -> int:
    """The fewest Arrow bytes one value of ``t`` takes: its width when fixed, the offset
    of a variable-length value (its bytes beyond that are not known before reading),
    the children's of a struct or fixed-size list (0 for booleans and nulls)."""
    if pa.types.is_dictionary(t):
        return _least_bytes(t.index_type)
    if pa.types.is_struct(t):
        return sum(_least_bytes(f.type) for f in t)
    if pa.types.is_fixed_size_list(t):
        return t.list_size * _least_bytes(t.value_type)
    if pa.types.is_large_string(t) or pa.types.is_large_binary(t) or pa.types.is_large_list(t):
        return 8
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_list(t) or pa.types.is_map(t):
        return 4
    try:
        return t.bit_width // 8
    except ValueError:
        return 0


def read_in_driver(
    uri: str,
    options: dict[str, str],
    schema: StructType,
    budget: int,
    table: MemWalTable | None = None,
) -> pa.Table | None:
    """The view's rows read in this process, or None when they exceed ``budget`` bytes.

    The view is resolved and read by :class:`MemWalReader`, the code Spark's tasks run
    (the same pinned view, deduplication, types and partitions' rows): every partition
    is read here in turn.

    Parameters
    ----------
    uri : str
    options : dict
        Data source options, names lower-cased.
    schema : StructType
        Columns to return.
    budget : int
        Most Arrow bytes (``nbytes``) of rows to hold. Before reading, the view's keys
        give a lower bound of its live rows (the regions' live newest rows, plus the
        base rows minus the regions' keys, each of which replaces at most one base row)
        times the fewest bytes of a row (fixed widths, and the offsets of
        variable-length values); past the budget nothing is read. While reading, the
        rows read so far are counted and dropped once they pass it.

    Returns
    -------
    pa.Table or None
        The rows in ``schema``'s Arrow types, or None (over the budget).

    Raises
    ------
    BaseVersionGoneError, GenerationGoneError
        A piece of the view was removed while it was read.
    """
    reader = MemWalReader(uri, options, schema, table)
    parts, base_rows, newer_rows = reader._plan()
    row_bytes = sum(_least_bytes(f.type) for f in reader.arrow_schema)
    if max(0, base_rows - newer_rows) * row_bytes > budget:
        return None  # from the row counts alone
    newer_part = next(
        (p.newer for p in parts if isinstance(p, BasePartition) and p.newer is not None), None
    )
    if newer_part is not None and row_bytes:
        # The newer rows are read whole before the first of them is counted: their live
        # rows (known from the keys and tombstones) are counted first.
        found = reader._view(newer_part)
        live = found.live_count() + max(0, base_rows - len(found.winners))
        if live * row_bytes > budget:
            return None
    batches: list[pa.RecordBatch] = []
    held = 0
    for part in parts:
        for batch in reader.read(part):
            held += batch.nbytes
            if held > budget:
                return None
            batches.append(batch)
    return pa.Table.from_batches(batches, schema=reader.arrow_schema)


def driver_frame(
    spark: SparkSession, data: pa.Table, schema: StructType, rows_per_split: int
) -> DataFrame:
    """``data`` as a DataFrame of ``ceil(rows / rows_per_split)`` partitions of about
    equal rows, read by the JVM alone (no Python worker).

    Spark keeps the rows as Arrow batches, one per partition (not a ``LocalRelation``,
    whose rows Spark serializes into every task of every query): Spark's
    ``spark.sql.execution.arrow.localRelationThreshold`` and
    ``spark.sql.execution.arrow.maxRecordsPerBatch`` are set for the call and restored.

    Parameters
    ----------
    spark : SparkSession
    data : pa.Table
        Rows in ``schema``'s Arrow types (:func:`read_in_driver`).
    schema : StructType
        The DataFrame's schema.
    rows_per_split : int
        Rows per partition, as for the data source.

    Returns
    -------
    DataFrame
    """
    rows = data.num_rows
    settings = {_LOCAL_RELATION_CONF: "0"}
    if rows:
        tasks = max(1, -(-rows // max(1, rows_per_split)))
        settings[_BATCH_ROWS_CONF] = str(-(-rows // tasks))
        data = data.combine_chunks()  # to_batches splits chunks but never joins them
    with _CONF_LOCK:
        before = {k: spark.conf.get(k, None) for k in settings}
        try:
            for k, v in settings.items():
                spark.conf.set(k, v)
            return spark.createDataFrame(data, schema)
        finally:
            for k, old in before.items():
                if old is None:
                    spark.conf.unset(k)
                else:
                    spark.conf.set(k, old)


def register_source(spark: SparkSession, filter_pushdown: bool = False) -> None:
    """Register the ``memwal`` format in ``spark``.

    Parameters
    ----------
    spark : SparkSession
    filter_pushdown : bool
        Also turn on Spark's Python filter pushdown (see below).

    Notes
    -----
    With ``filter_pushdown``, also turn on Spark's Python filter pushdown
    (``spark.sql.python.filterPushdown.enabled``, PySpark >= 4.1), which readers with
    ``option("push_filters", "true")`` need. It is left as it is otherwise: with it on,
    Spark runs a Python planning worker for *every* query with a filter, whatever the
    reader (a fresh plan each time, ~0.3 s per query on a loaded 2-core machine), where
    a DataFrame's queries otherwise reuse its first plan.
    """
    spark.dataSource.register(MemWalDataSource)
    if filter_pushdown and _FILTERS:
        warnings.warn(PUSHDOWN_WARNING, PushdownWarning, stacklevel=2)
        spark.conf.set(PUSHDOWN_CONF, "true")


class PushdownWarning(UserWarning):
    """Filter pushdown was turned on: Spark shares one pushed-down reader per relation
    (see the module docs), so only a DataFrame read once by one query is answered
    right."""


PUSHDOWN_WARNING = (
    "memwal: Spark filter pushdown is on. Spark (4.1-4.3) keeps ONE pushed-down reader "
    "per DataFrame: a later query on the same DataFrame, or a query reading it twice "
    "(self-union, self-join), can be answered with another query's filters, i.e. wrong "
    "rows. Use option('push_filters', 'true') only on a DataFrame that one query reads "
    "once; without it every answer is right (Spark evaluates the filters)."
)


def read(spark: SparkSession, uri: str, **options: str) -> DataFrame:
    """The deduplicated view as a DataFrame: read here when it is small, else
    ``spark.read.format("memwal").options(**options).load(uri)``.

    The table and the options are checked first, in this process (:func:`check_read`).
    A view of at most ``driver_read_bytes`` Arrow bytes is then read here, now, by the
    reader Spark's tasks run (:func:`read_in_driver`), and handed to Spark as Arrow
    data (:func:`driver_frame`): neither the call nor the DataFrame's queries start a
    Python process, and the ``memwal`` format is not registered. A larger view (or a
    change-feed read, or ``driver_read_bytes="0"``) is read by the ``memwal`` data
    source, registered first (:func:`register_source`, with ``push_filters``' session
    setting), given the schema found here (``.schema(...)``), so Spark's ``.load()``
    process does not open the table nor import lance.

    Both return the same rows and schema. The view is pinned now when read here, and
    when Spark plans the first query otherwise (see docs/spark.md, "Reader").

    Parameters
    ----------
    spark : SparkSession
    uri : str
        The table.
    **options : str
        Reader options (``consistency``, ``rows_per_split``, ``push_filters``,
        ``columns``, ``as_of``, ``driver_read_bytes``, storage options; see
        docs/spark.md). ``driver_read_bytes`` (default
        :data:`DEFAULT_DRIVER_READ_BYTES`, 64 MiB; ``"0"`` turns it off) is the most
        Arrow bytes of rows read in the driver. ``push_filters="true"`` turns on Spark's
        filter pushdown (see :func:`register_source`). ``rowsPerSplit`` and
        ``pushFilters`` are deprecated spellings of ``rows_per_split`` and
        ``push_filters``.

    Returns
    -------
    DataFrame
        The deduplicated view (newest row per key).

    Raises
    ------
    TableNotFoundError, NotInitializedError
        No MemWAL table at ``uri``.
    MemWalError, SchemaError
        A bad option value (the message names the option) or an unknown column.
    BaseVersionGoneError, GenerationGoneError
        A piece of the view was removed while it was read here.
    """
    table, schema = check_read(uri, options)  # here, in the driver: a typed error
    lowered = {k.lower(): v for k, v in options.items()}
    push = str(option(lowered, "push_filters", "pushfilters", "")).lower() == "true"
    if "rowspersplit" in lowered and "rows_per_split" not in lowered:
        deprecated_spelling("option('rowsPerSplit')", "option('rows_per_split')")
    changes = is_changes_read(lowered)
    spark_schema = _spark_schema(schema)
    budget = int(lowered.get("driver_read_bytes", DEFAULT_DRIVER_READ_BYTES))
    if budget > 0 and not changes:
        data = read_in_driver(uri, lowered, spark_schema, budget, table)
        if data is not None:
            split = int(option(lowered, "rows_per_split", "rowspersplit", DEFAULT_ROWS_PER_SPLIT))
            return driver_frame(spark, data, spark_schema, split)
    # Registering makes Spark look its Python data sources up in a Python process: only
    # the data source path pays it.
    register_source(spark, filter_pushdown=push)
    reader = spark.read.format(FORMAT).options(**options)
    if not changes:
        # The schema just computed: Spark's .load() process then neither opens the
        # table nor imports lance (memwal_query.spark.datasource).
        reader = reader.schema(spark_schema)
    return reader.load(uri)


def changes_frame(
    spark: SparkSession, uri: str, since: Any = None, **options: str
) -> tuple[DataFrame, str]:
    """The changes after ``since`` as a DataFrame, and the cursor to continue from.

    The end is fixed here (``changes_until``), so the DataFrame reads exactly the
    changes up to the returned cursor however often it is evaluated.

    Parameters
    ----------
    spark : SparkSession
    uri : str
        The table.
    since : str, int, datetime or None
        As for :meth:`MemWalTable.changes`.
    **options : str
        Reader options of the change feed (see docs/spark.md).

    Returns
    -------
    tuple of (DataFrame, str)
        The changes, and the cursor to pass as ``since`` next time.

    Raises
    ------
    CursorError, ChangesGoneError
        As for :meth:`MemWalTable.changes`.
    """
    from memwal_query.spark import changes as _changes

    register_source(spark)
    table = open_table(uri, _storage_options(options))
    consistency = options.get("consistency", view.DEFAULT_CONSISTENCY)
    start = _changes._start(table, None if since is None else str(since))
    end = _changes.end_cursor(table.catalog, consistency)
    merged = _changes.Cursor({**start.positions, **end.positions}, table.catalog.lineage)
    df = (
        spark.read.format(FORMAT)
        .options(**options)
        .option(_changes.SINCE, start.encode())
        .option(_changes.UNTIL, merged.encode())
        .load(uri)
    )
    return df, merged.encode()
