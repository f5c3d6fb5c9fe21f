"""``spark.read.format("memwal")``: a PySpark Python Data Source over the LSM view.

Register once per session with :func:`register_source`, then::

    df = spark.read.format("memwal").load(uri)                      # every column
    df = spark.read.format("memwal").option("columns", "id,val").load(uri)
    df = spark.read.format("memwal").schema("id long, val double").load(uri)

It returns the same rows as the DataFusion provider (:meth:`MemWalTable.provider`) with
the same consistency (``option("consistency", "strong" | "eventual" | "latest")``,
default ``strong``): the newest version of every key, deletes applied. Unflushed
MemTables live in their writer's process; ``latest`` reads their durable WAL entries.

Partitions (planned by Spark's planning worker)
-----------------------------------------------
The pinned view is resolved at planning time (:func:`memwal_query.read.view.resolve`): the
base table version, its merge progress, and the unmerged flushed generations of each
region (plus, with ``consistency="latest"``, the durable WAL entries not yet flushed).
Each partition then reads a fixed, immutable piece:

- **one partition of the regions' rows**: the newest row of every key among the
  generations, by :func:`memwal_query.read.sources.newer_view` (the code and the rule of
  the DataFusion provider, :func:`memwal_query.read.dedup.newest_indices`), tombstones
  removed, then filtered;
- **base-table splits**: groups of the pinned base version's fragments (about
  ``rowsPerSplit`` rows each; a larger fragment is cut into row ranges when no filter
  is pushed), read by Lance's scanner, minus the rows whose key
  appears in any planned generation (whatever its filter outcome). The key set is the
  same view's (cached per worker process: generations are immutable).

Spark keeps the partitions a query planned for later queries of the same DataFrame
(see below): those read the same pinned view. A view whose pieces were garbage
collected meanwhile raises :class:`~memwal_query.exceptions.BaseVersionGoneError` or
:class:`~memwal_query.exceptions.GenerationGoneError`: load the DataFrame again.

Column pruning and filter pushdown
----------------------------------
The Python Data Source API (PySpark 4.x) passes no required-column list to a reader, so
Spark cannot prune columns by itself: ask for the columns with ``option("columns",
...)`` or a user schema, and only those (plus the key) are read.
Filters are pushed only on request (``option("pushFilters", "true")``, PySpark >= 4.1 with
``spark.sql.python.filterPushdown.enabled``, which :func:`register_source` turns on).
**Off by default**: Spark (4.1 to 4.3 at least) keeps the read function and partitions
planned by a filter pushdown on the *relation*, shared by every later query of the same
DataFrame (or temporary view); a query without a pushable filter then reuses the
previous query's reader and its filters (``df.where("cat = 7").count()`` followed by
``df.count()`` returned the filtered count). Without pushdown every reader is
identical (Spark evaluates all filters), so a reused reader is only a reused *view*
(see "Pinning" in ``docs/spark.md``). Enable it only for a DataFrame that runs one
query. When enabled:
``=``, ``<``, ``<=``, ``>``, ``>=``, ``IN``, ``IS [NOT] NULL``, ``NOT``,
``LIKE 'a%'/'%a'/'%a%'`` on integer, string, boolean, date, decimal and binary columns
are evaluated exactly here (Lance pushdown on the base table, after deduplication on
the regions) and prune regions whose region value cannot match; other filters (floats
with NaN semantics, timestamps with session time zones, nested fields) stay in Spark.
A pushed filter is evaluated on the newest version of a key only, as in the provider.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import lance
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StructType

from memwal_query.exceptions import BaseVersionGoneError, MemWalError, SchemaError
from memwal_query.format.lancetypes import lance_filterable
from memwal_query.read import sources, view
from memwal_query.spark import changes as _changes
from memwal_query.spark._common import (
    _spark_schema,
    _storage_options,
    open_table,
)

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

FORMAT = "memwal"
PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"
DEFAULT_ROWS_PER_SPLIT = 1_000_000

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
    is true, NULLs included. Raises ValueError for a filter that is not supported
    (then Spark evaluates it).
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
    ``consistency="latest"``), deduplicated by :func:`memwal_query.read.sources.newer_view`
    (the provider's code and rule)."""

    def __init__(self, regions: list[view.RegionView], consistency: str) -> None:
        super().__init__(tuple(r.region_id for r in regions))
        self.regions = regions
        self.consistency = consistency

    def plan(self) -> view.ReadPlan:
        """The partition's regions as a read plan (no base: read by BasePartition)."""
        return view.ReadPlan(None, None, self.regions, [], self.consistency)  # type: ignore[arg-type]


class BasePartition(InputPartition):
    """Fragments of the pinned base version, minus keys of the ``newer`` partition;
    with ``row_range`` (offset, limit), that range of the rows of one fragment."""

    def __init__(
        self,
        version: int,
        fragment_ids: list[int] | None,
        newer: NewerPartition | None,
        row_range: tuple[int, int] | None = None,
    ) -> None:
        super().__init__((fragment_ids, row_range))
        self.version = version
        self.fragment_ids = fragment_ids
        self.newer = newer
        self.row_range = row_range


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

    def __init__(self, uri: str, options: dict[str, str], schema: StructType) -> None:
        self.uri = uri
        self.options = options
        self.schema = schema
        self.consistency = options.get("consistency", "strong")
        self.as_of = options.get("as_of")  # time travel (memwal_query.read.view.resolve_as_of)
        self.rows_per_split = int(options.get("rowspersplit", DEFAULT_ROWS_PER_SPLIT))
        self.storage_options = _storage_options(options)
        self.filters: list[Any] = []
        table = open_table(uri, self.storage_options)
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
        """Resolve the view now: one partition of the regions' rows, plus base splits."""
        table = self.__dict__.pop("_table", None) or open_table(self.uri, self.storage_options)
        _, preds = self._expression()
        plan = sources.resolve(table, self.consistency, None, preds or None, as_of=self.as_of)
        parts: list[InputPartition] = []
        newer = NewerPartition(plan.regions, plan.consistency) if plan.regions else None
        if newer is not None:
            parts.append(newer)
        base = plan.base
        frags = base.get_fragments()
        if not frags:
            parts.append(BasePartition(base.version, None, newer))
            return parts
        group: list[int] = []
        rows = 0
        for frag in frags:
            n = frag.count_rows()
            if n > self.rows_per_split and not self.filters:
                # A large fragment is read in row ranges by several tasks (without a
                # pushed filter, offset/limit of one fragment's scan are row ranges).
                if group:
                    parts.append(BasePartition(base.version, group, newer))
                    group, rows = [], 0
                for start in range(0, n, self.rows_per_split):
                    size = min(self.rows_per_split, n - start)
                    parts.append(
                        BasePartition(base.version, [frag.fragment_id], newer, (start, size))
                    )
                continue
            group.append(frag.fragment_id)
            rows += n
            if rows >= self.rows_per_split:
                parts.append(BasePartition(base.version, group, newer))
                group, rows = [], 0
        if group:
            parts.append(BasePartition(base.version, group, newer))
        return parts

    # reading -------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Rows of one partition as Arrow batches of the output schema."""
        if isinstance(partition, NewerPartition):
            yield from self._read_newer(partition)
        elif isinstance(partition, BasePartition):
            yield from self._read_base(partition)
        else:  # pragma: no cover
            raise MemWalError(f"unknown partition {partition!r}")

    def _view(self, part: NewerPartition) -> sources.NewerView:
        return sources.newer_view(
            part.plan(), self.table_schema, self.primary_key, self.storage_options
        )

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

    def _read_newer(self, part: NewerPartition) -> Iterator[pa.RecordBatch]:
        expr, _ = self._expression()
        used = [_filter_column(f) for f in self.filters]
        yield from self._out(self._view(part).live(self.columns, expr, used))

    def _read_base(self, part: BasePartition) -> Iterator[pa.RecordBatch]:
        try:
            ds = lance.dataset(
                self.uri, version=part.version, storage_options=self.storage_options or None
            )
        except (ValueError, OSError) as e:  # the pinned version was cleaned up
            raise BaseVersionGoneError(
                f"{self.uri}: base version {part.version} this DataFrame planned on is gone "
                f"(load the DataFrame again): {e}"
            ) from e
        keys = self._view(part.newer).keys if part.newer is not None else None
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
        fragments = None
        if part.fragment_ids is not None:
            fragments = []
            for i in part.fragment_ids:
                fragment = ds.get_fragment(i)
                if fragment is None:  # the pinned version lists it: it cannot vanish
                    raise BaseVersionGoneError(
                        f"{ds.uri}: fragment {i} of version {ds.version} is gone"
                    )
                fragments.append(fragment)
        offset, limit = part.row_range if part.row_range is not None else (None, None)
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


class MemWalDataSource(DataSource):
    """The ``memwal`` data source (``spark.read.format("memwal").load(uri)``).

    Options: ``path`` (the ``load`` argument), ``columns`` (comma-separated subset),
    ``consistency`` (``strong``/``eventual``/``latest``), ``rowsPerSplit`` (base rows per
    partition), ``pushFilters`` (``true`` to enable filter pushdown: only for a
    DataFrame that runs a single query, see the module docs), ``as_of`` (time travel:
    a base version or ISO timestamp), ``changes_since`` (the change feed, see
    :mod:`memwal_query.spark.changes`; also a Structured Streaming source),
    ``storage.<key>`` (object-store options; Spark passes option names lower-cased).
    """

    @classmethod
    def name(cls) -> str:
        """Format name: ``memwal``."""
        return FORMAT

    def _uri(self) -> str:
        uri = self.options.get("path")
        if not uri:
            raise MemWalError('memwal data source: give the table URI: .load("/path")')
        return uri

    def schema(self) -> StructType:
        """The table schema (or the ``columns`` option's subset), as Spark types."""
        table = open_table(self._uri(), _storage_options(self.options))
        if _changes.is_changes_read(self.options):
            return _changes.spark_changes_schema(table)
        schema = table.schema
        cols = self.options.get("columns")
        if cols:
            names = [c.strip() for c in cols.split(",") if c.strip()]
            missing = [n for n in names if schema.get_field_index(n) < 0]
            if missing:
                raise SchemaError(f"{table.uri}: column(s) {missing} are not in the table")
            schema = pa.schema([schema.field(n) for n in names])
        return _spark_schema(schema)

    def reader(self, schema: StructType) -> DataSourceReader:
        """A reader returning ``schema``'s columns."""
        options = {k.lower(): v for k, v in self.options.items()}
        if _changes.is_changes_read(options):
            return _changes.MemWalChangesReader(self._uri(), options, schema)
        # Opt-in: Spark shares a pushed-down reader with later queries (module docs).
        pushdown = options.get("pushfilters", "false").lower() == "true"
        cls = MemWalPushdownReader if pushdown and _FILTERS else MemWalReader
        return cls(self._uri(), options, schema)

    def streamReader(self, schema: StructType) -> Any:  # noqa: N802 - PySpark's name
        """Structured Streaming source of the change feed (:mod:`memwal_query.spark.changes`)."""
        return _changes.MemWalChangesStreamReader(self._uri(), dict(self.options), schema)


def register_source(spark: SparkSession) -> None:
    """Register the ``memwal`` format in ``spark`` and enable Python filter pushdown."""
    spark.dataSource.register(MemWalDataSource)
    if _FILTERS:
        spark.conf.set(PUSHDOWN_CONF, "true")


def read(spark: SparkSession, uri: str, **options: str) -> DataFrame:
    """``spark.read.format("memwal").options(**options).load(uri)`` (registers first)."""
    register_source(spark)
    return spark.read.format(FORMAT).options(**options).load(uri)


def changes_frame(
    spark: SparkSession, uri: str, since: Any = None, **options: str
) -> tuple[DataFrame, str]:
    """``(DataFrame of the changes after since, cursor to continue from)``.

    The end is fixed here (``changes_until``), so the DataFrame reads exactly the
    changes up to the returned cursor however often it is evaluated.
    """
    register_source(spark)
    table = open_table(uri, _storage_options(options))
    consistency = options.get("consistency", "strong")
    start = _changes._start(table, None if since is None else str(since))
    end = _changes.end_cursor(table, consistency)
    merged = _changes.Cursor({**start.positions, **end.positions}, table.lineage)
    df = (
        spark.read.format(FORMAT)
        .options(**options)
        .option(_changes.SINCE, start.encode())
        .option(_changes.UNTIL, merged.encode())
        .load(uri)
    )
    return df, merged.encode()
