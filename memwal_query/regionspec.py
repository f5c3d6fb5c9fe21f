"""Region specs: how rows map to regions, and how predicates prune regions.

A :class:`RegionSpec` holds :class:`RegionField` s, each deriving one region value from
source columns (referenced by Lance field id) with a well-known *transform* or a
DataFusion SQL *expression* over ``col0, col1, …`` (evaluated by DataFusion). They mirror
the ``RegionSpec``/``RegionField`` protobuf messages and pylance's
``ShardingSpec``/``ShardingField``.

Transforms (spec table) and their exact semantics here:

- ``identity``: ``col0``.
- ``year`` / ``month`` / ``day`` / ``hour``: ``date_part`` of a date or timestamp
  (``int32``; month 1-12, day 1-31, hour 0-23). Timestamps with a time zone use their
  UTC value.
- ``bucket`` (``num_buckets`` = N): ``abs(murmur3_x86_32(bytes, seed 0)) % N`` as
  ``int32``, with the bytes Iceberg's bucket transform uses, so that equal values of
  different types land in the same bucket: every integer type (and ``bool``) as the
  value's 8-byte little-endian ``int64``; dates as days since the epoch (8-byte int64);
  timestamps as microseconds since the epoch (8-byte int64, any unit); strings as UTF-8;
  binary as is. ``abs`` is taken in 64 bits, so ``abs(-2**31) = 2**31``. Floats and
  decimals are refused (not type-promotion safe). NULL gives NULL.
- ``multi_bucket`` (``num_buckets``): the same hash over the concatenation, for each
  non-NULL input in order, of a 4-byte little-endian length followed by its bytes as
  above; NULL inputs are skipped; NULL only if all are NULL.
- ``truncate`` (``width`` = W): strings ``left(col0, W)`` characters, binary the first W
  bytes, integers ``v - (((v % W) + W) % W)`` (floor, as Iceberg), same type as source.

Differences from pylance's native ``evaluate_sharding_spec`` (measured with pylance
14.0.2): it supports only ``bucket``; for int64 it computes ``(h & 0x7fffffff) % N``
instead of ``abs(h) % N`` (the two agree whenever the hash is non-negative), and an int32
column hashes its 4-byte value, so int32 and int64 columns holding equal numbers get
different buckets there. memwal_query follows the spec; ``tests/test_regionspec.py`` pins
the cases where both agree.

Vectorisation: integer/temporal hashing is numpy (murmur3 on 8-byte blocks); string,
binary and ``multi_bucket`` hashing call ``mmh3`` once per value.
"""

from __future__ import annotations

import datetime as dt
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

import mmh3
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ._proto import memwal_pb2 as pb
from .exceptions import RegionSpecError
from .fieldvalues import arrow_type

TRANSFORMS = ("identity", "year", "month", "day", "hour", "bucket", "multi_bucket", "truncate")
_SINGLE_SOURCE = ("identity", "year", "month", "day", "hour", "bucket", "truncate")
_M32 = np.uint64(0xFFFFFFFF)


# -- murmur3 -----------------------------------------------------------------------------
def _rotl32(x: np.ndarray, r: int) -> np.ndarray:
    return ((x << np.uint64(r)) | (x >> np.uint64(32 - r))) & _M32


def murmur3_int64(values: np.ndarray) -> np.ndarray:
    """murmur3_x86_32 (seed 0) of each value's 8 little-endian bytes, as int32 (numpy)."""
    v = values.astype(np.int64, copy=False).view(np.uint64)
    h = np.zeros(len(v), dtype=np.uint64)
    for block in (v & _M32, v >> np.uint64(32)):
        k = (block * np.uint64(0xCC9E2D51)) & _M32
        k = _rotl32(k, 15)
        k = (k * np.uint64(0x1B873593)) & _M32
        h ^= k
        h = _rotl32(h, 13)
        h = (h * np.uint64(5) + np.uint64(0xE6546B64)) & _M32
    h ^= np.uint64(8)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & _M32
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & _M32
    h ^= h >> np.uint64(16)
    return h.astype(np.uint32).view(np.int32)


def _as_int64(col: pa.Array) -> pa.Array | None:
    """Integer-like values as int64 per the bucket byte rules, or None for bytes types."""
    t = col.type
    if pa.types.is_boolean(t):
        return pc.cast(col, pa.int8()).cast(pa.int64())
    if pa.types.is_integer(t):
        if t == pa.uint64():
            return pa.Array.from_buffers(pa.int64(), len(col), col.buffers(), col.null_count)
        return pc.cast(col, pa.int64())
    if pa.types.is_date(t):
        return pc.cast(pc.cast(col, pa.date32()), pa.int32()).cast(pa.int64())
    if pa.types.is_timestamp(t):
        us = pc.cast(col, pa.timestamp("us", tz=t.tz))
        return pc.cast(us, pa.int64())
    if pa.types.is_time(t):
        return pc.cast(pc.cast(col, pa.time64("us")), pa.int64())
    return None


def _bytes_values(col: pa.Array) -> list[bytes | None]:
    t = col.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return [None if v is None else v.encode() for v in col.to_pylist()]
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return [None if v is None else bytes(v) for v in col.to_pylist()]
    raise RegionSpecError(f"cannot bucket values of type {t} (not type-promotion safe)")


def hash_column(col: pa.Array) -> pa.Array:
    """Signed murmur3 (seed 0) of each value per the bucket byte rules; NULL stays NULL."""
    ints = _as_int64(col)
    if ints is not None:
        filled = pc.fill_null(ints, 0).to_numpy(zero_copy_only=False)
        h = murmur3_int64(filled)
        return pa.array(h, pa.int32(), mask=pc.is_null(col).to_numpy(zero_copy_only=False))
    values = _bytes_values(col)
    return pa.array([None if v is None else mmh3.hash(v, 0) for v in values], pa.int32())


def _value_bytes(col: pa.Array) -> list[bytes | None]:
    ints = _as_int64(col)
    if ints is not None:
        return [None if v is None else struct.pack("<q", v) for v in ints.to_pylist()]
    return _bytes_values(col)


def _bucket(hashes: pa.Array, n: int) -> pa.Array:
    """``abs(h) % n`` computed in 64 bits (so ``abs(-2**31)`` does not overflow)."""
    mask = pc.is_null(hashes).to_numpy(zero_copy_only=False)
    h = pc.fill_null(pc.cast(hashes, pa.int64()), 0).to_numpy(zero_copy_only=False)
    out = (np.abs(h.astype(np.int64)) % n).astype(np.int32)
    return pa.array(out, pa.int32(), mask=mask if mask.any() else None)


# -- field and spec ---------------------------------------------------------------------
@dataclass
class RegionField:
    """One region field: a transform or a DataFusion SQL expression over source columns.

    Parameters
    ----------
    field_id : str
        Name of the derived value (``region_field_{field_id}`` in snapshots).
    source_ids : list of int
        Lance field ids of the source columns (``col0``, ``col1``, … in expressions).
    transform : str, optional
        One of ``identity, year, month, day, hour, bucket, multi_bucket, truncate``.
    expression : str, optional
        DataFusion SQL expression (exclusive with ``transform``).
    result_type : str
        Arrow type name of the value ("" = same as the source, for identity/truncate).
    parameters : dict of str to str
        ``num_buckets`` for bucket/multi_bucket, ``width`` for truncate.
    """

    field_id: str
    source_ids: list[int]
    transform: str | None = None
    expression: str | None = None
    result_type: str = ""
    parameters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"region field {self.field_id!r}"
        if not self.field_id:
            raise RegionSpecError("a region field needs a non-empty field_id")
        self.source_ids = [int(i) for i in self.source_ids]
        if (self.transform is None) == (self.expression is None):
            raise RegionSpecError(f"{where}: give exactly one of transform or expression")
        if self.transform is not None:
            if self.transform not in TRANSFORMS:
                raise RegionSpecError(f"{where}: unknown transform {self.transform!r}")
            if self.transform in _SINGLE_SOURCE and len(self.source_ids) != 1:
                raise RegionSpecError(f"{where}: {self.transform} takes exactly one source")
            if self.transform == "multi_bucket" and not self.source_ids:
                raise RegionSpecError(f"{where}: multi_bucket needs at least one source")
            if self.transform in ("bucket", "multi_bucket"):
                self._positive("num_buckets", where)
            if self.transform == "truncate":
                self._positive("width", where)
        elif not self.source_ids:
            raise RegionSpecError(f"{where}: an expression needs source columns")
        if self.expression is not None and not self.result_type:
            raise RegionSpecError(f"{where}: an expression needs a result_type")
        if self.result_type:
            arrow_type(self.result_type)

    def _positive(self, name: str, where: str) -> int:
        raw = self.parameters.get(name)
        try:
            value = int(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise RegionSpecError(f"{where}: parameter {name} must be a positive integer") from None
        if value <= 0:
            raise RegionSpecError(f"{where}: parameter {name} must be positive, got {value}")
        return value

    def to_proto(self) -> pb.RegionField:
        """Protobuf message."""
        msg = pb.RegionField(
            field_id=self.field_id,
            source_ids=self.source_ids,
            result_type=self.result_type,
            parameters=self.parameters,
        )
        if self.transform is not None:
            msg.transform = self.transform
        if self.expression is not None:
            msg.expression = self.expression
        return msg

    @classmethod
    def from_proto(cls, msg: pb.RegionField) -> RegionField:
        """From a protobuf message."""
        return cls(
            field_id=msg.field_id,
            source_ids=list(msg.source_ids),
            transform=msg.transform if msg.HasField("transform") else None,
            expression=msg.expression if msg.HasField("expression") else None,
            result_type=msg.result_type,
            parameters=dict(msg.parameters),
        )

    # -- evaluation --------------------------------------------------------------------
    def evaluate(self, columns: list[pa.Array]) -> pa.Array:
        """Region values of the rows whose source columns are ``columns``."""
        t = self.transform
        if t == "identity":
            out = columns[0]
        elif t in ("year", "month", "day", "hour"):
            out = _date_part(columns[0], t)
        elif t == "bucket":
            out = _bucket(hash_column(columns[0]), int(self.parameters["num_buckets"]))
        elif t == "multi_bucket":
            out = self._multi_bucket(columns)
        elif t == "truncate":
            out = _truncate(columns[0], int(self.parameters["width"]))
        else:
            out = _evaluate_expression(self.expression or "", columns, self.result_type)
        if self.result_type and t != "bucket" and t != "multi_bucket":
            target = arrow_type(self.result_type)
            if out.type != target:
                try:
                    out = pc.cast(out, target)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise RegionSpecError(
                        f"region field {self.field_id!r}: result is {out.type}, not "
                        f"{self.result_type}: {e}"
                    ) from e
        return out

    def _multi_bucket(self, columns: list[pa.Array]) -> pa.Array:
        n = int(self.parameters["num_buckets"])
        parts = [_value_bytes(c) for c in columns]
        hashes = []
        for row in zip(*parts):
            present = [v for v in row if v is not None]
            if not present:
                hashes.append(None)
                continue
            data = b"".join(struct.pack("<I", len(v)) + v for v in present)
            hashes.append(mmh3.hash(data, 0))
        return _bucket(pa.array(hashes, pa.int32()), n)


def _date_part(col: pa.Array, part: str) -> pa.Array:
    t = col.type
    if pa.types.is_timestamp(t) and t.tz is not None:
        col = pc.cast(col, pa.timestamp(t.unit))  # the UTC wall clock
    elif not (pa.types.is_timestamp(t) or pa.types.is_date(t)):
        raise RegionSpecError(f"{part} needs a date or timestamp column, got {t}")
    fn = {"year": pc.year, "month": pc.month, "day": pc.day, "hour": pc.hour}[part]
    return pc.cast(fn(col), pa.int32())


def _truncate(col: pa.Array, width: int) -> pa.Array:
    t = col.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pc.utf8_slice_codeunits(col, 0, width)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return pc.binary_slice(col, 0, width)
    if pa.types.is_integer(t):
        v = pc.cast(col, pa.int64())
        mask = pc.is_null(v).to_numpy(zero_copy_only=False)
        filled = pc.fill_null(v, 0).to_numpy(zero_copy_only=False)
        out = filled - np.mod(filled, width)  # floor semantics, as Iceberg
        return pc.cast(pa.array(out, pa.int64(), mask=mask if mask.any() else None), t)
    raise RegionSpecError(f"truncate needs a string, binary or integer column, got {t}")


_df_local = threading.local()


def _evaluate_expression(expression: str, columns: list[pa.Array], result_type: str) -> pa.Array:
    import datafusion

    ctx = getattr(_df_local, "ctx", None)
    if ctx is None:
        ctx = _df_local.ctx = datafusion.SessionContext()
    batch = pa.RecordBatch.from_arrays(columns, names=[f"col{i}" for i in range(len(columns))])
    name = "memwal_region_input"
    ctx.deregister_table(name) if ctx.table_exist(name) else None
    ctx.register_record_batches(name, [[batch]])
    try:
        result = ctx.sql(f"SELECT ({expression}) AS v FROM {name}").to_arrow_table()
    except Exception as e:  # noqa: BLE001
        raise RegionSpecError(f"region expression {expression!r} failed: {e}") from e
    finally:
        ctx.deregister_table(name)
    out = (
        result.column("v").combine_chunks()
        if result.num_rows
        else pa.array([], arrow_type(result_type))
    )
    if len(out) != len(batch):
        raise RegionSpecError(f"region expression {expression!r} is not row-wise")
    return out


def _field_names(schema: Any) -> dict[int, str]:
    """Lance field id -> top-level column name, from a LanceSchema / pa.Schema / None."""
    if schema is None:
        return {}
    if isinstance(schema, pa.Schema):
        out = {}
        for i, f in enumerate(schema):
            meta = f.metadata or {}
            out[int(meta.get(b"lance:field_id", i))] = f.name
        return out
    out = {}
    for f in schema.fields():
        out[f.id()] = f.name()
    return out


@dataclass
class RegionSpec:
    """How rows are divided into regions (spec id + region fields).

    Parameters
    ----------
    spec_id : int
        Positive id, unique within the MemWAL index, never reused.
    fields : list of RegionField
    """

    spec_id: int
    fields: list[RegionField]

    def __post_init__(self) -> None:
        if not self.fields:
            raise RegionSpecError("a region spec needs at least one field")
        ids = [f.field_id for f in self.fields]
        if len(set(ids)) != len(ids):
            raise RegionSpecError(f"duplicate region field ids in {ids}")

    def to_proto(self) -> pb.RegionSpec:
        """Protobuf message."""
        return pb.RegionSpec(spec_id=self.spec_id, fields=[f.to_proto() for f in self.fields])

    @classmethod
    def from_proto(cls, msg: pb.RegionSpec) -> RegionSpec:
        """From a protobuf message."""
        return cls(msg.spec_id, [RegionField.from_proto(f) for f in msg.fields])

    def _sources(self, data: pa.Table, names: dict[int, str], f: RegionField) -> list[pa.Array]:
        cols = []
        for sid in f.source_ids:
            name = names.get(sid) if names else None
            if name is None and not names and sid < data.num_columns:
                name = data.column_names[sid]
            if name is not None and name in data.column_names:
                cols.append(data.column(name).combine_chunks())
            else:  # column-removal resistant: a missing source reads as NULL
                cols.append(pa.nulls(data.num_rows))
        return cols

    def evaluate(self, data: pa.RecordBatch | pa.Table, schema: Any = None) -> pa.RecordBatch:
        """One column per region field (named by ``field_id``) for the rows of ``data``.

        ``schema`` resolves source field ids: a ``lance.schema.LanceSchema``, a
        ``pa.Schema`` whose fields carry ``lance:field_id`` metadata, or None (field id
        = column position).
        """
        table = pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch) else data
        names = _field_names(schema)
        arrays = []
        for f in self.fields:
            cols = self._sources(table, names, f)
            if f.transform in ("bucket", "identity", "truncate", "year", "month", "day", "hour"):
                if pa.types.is_null(cols[0].type):
                    rtype = arrow_type(f.result_type) if f.result_type else pa.int32()
                    arrays.append(pa.nulls(table.num_rows, rtype))
                    continue
            arrays.append(f.evaluate(cols))
        return pa.RecordBatch.from_arrays(arrays, names=[f.field_id for f in self.fields])

    def source_columns(self, schema: Any) -> dict[str, list[str]]:
        """``{field_id: [source column names]}``."""
        names = _field_names(schema)
        return {f.field_id: [names.get(i, f"#{i}") for i in f.source_ids] for f in self.fields}

    # -- pruning -------------------------------------------------------------------------
    def may_match(
        self,
        region_values: dict[str, Any],
        predicates: list[tuple[str, str, Any]],
        schema: Any = None,
    ) -> bool:
        """Whether a region with ``region_values`` may hold rows matching all predicates.

        ``predicates`` are ``(source column, op, value)`` with ops ``= != < <= > >= in``
        (a conjunction). Conservative: returns True unless it can prove no match.
        """
        names = _field_names(schema)
        for f in self.fields:
            sources = [names.get(i) for i in f.source_ids]
            value = region_values.get(f.field_id)
            if not _field_may_match(f, sources, value, predicates, schema):
                return False
        return True


def _column_type(schema: Any, name: str) -> pa.DataType | None:
    if schema is None:
        return None
    if isinstance(schema, pa.Schema):
        i = schema.get_field_index(name)
        return schema.field(i).type if i >= 0 else None
    try:
        return schema.to_pyarrow().field(name).type
    except (KeyError, AttributeError):
        return None


def _literal_array(values: list[Any], t: pa.DataType | None) -> pa.Array | None:
    try:
        if t is not None and pa.types.is_timestamp(t) and t.tz is not None:
            values = [
                v.replace(tzinfo=dt.timezone.utc)
                if isinstance(v, dt.datetime) and v.tzinfo is None
                else v
                for v in values
            ]
        return pa.array(values, type=t) if t is not None else pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        return None


def _field_may_match(
    f: RegionField, sources: list[str | None], value: Any, predicates: list, schema: Any
) -> bool:
    t = f.transform
    if t in _SINGLE_SOURCE:
        col = sources[0]
        preds = [p for p in predicates if p[0] == col and p[1] != "!="]
        if not preds or col is None:
            return True
        if value is None:
            return False  # NULL region values satisfy no comparison
        ctype = _column_type(schema, col)
        for _, op, lit in preds:
            if not _pred_may_match(f, op, lit, value, ctype):
                return False
        return True
    # multi_bucket / expression: prune only when every source is pinned by '='
    pinned = []
    for col in sources:
        eq = [p for p in predicates if p[0] == col and p[1] == "="]
        if col is None or not eq:
            return True
        pinned.append(eq[0][2])
    arrays = []
    for col, lit in zip(sources, pinned):
        arr = _literal_array([lit], _column_type(schema, col))  # type: ignore[arg-type]
        if arr is None:
            return True
        arrays.append(arr)
    try:
        got = f.evaluate(arrays)[0].as_py()
    except Exception:  # noqa: BLE001 - never prune on an evaluation problem
        return True
    return got == value


def _pred_may_match(f: RegionField, op: str, lit: Any, value: Any, ctype) -> bool:
    t = f.transform
    lits = list(lit) if op == "in" else [lit]
    arr = _literal_array(lits, ctype)
    if arr is None:
        return True
    try:
        mapped = f.evaluate([arr]).to_pylist()
    except Exception:  # noqa: BLE001
        return True
    if op in ("=", "in"):
        return value in mapped
    if t == "bucket" or t in ("month", "day", "hour"):
        return True  # not order-preserving
    m = mapped[0]
    if m is None:
        return True
    try:
        if op in (">", ">="):
            return value >= m
        if op in ("<", "<="):
            return value <= m
    except TypeError:
        return True
    return True


# -- convenience constructors -----------------------------------------------------------
def _field_id_of(schema: Any, column: str) -> int:
    for fid, name in _field_names(schema).items():
        if name == column:
            return fid
    raise RegionSpecError(f"no column {column!r} in the schema")


def bucket_spec(schema: Any, column: str, num_buckets: int, spec_id: int = 1) -> RegionSpec:
    """``bucket(column, num_buckets)`` as field ``bucket``."""
    return RegionSpec(
        spec_id,
        [
            RegionField(
                "bucket",
                [_field_id_of(schema, column)],
                "bucket",
                result_type="int32",
                parameters={"num_buckets": str(num_buckets)},
            )
        ],
    )


def identity_spec(schema: Any, column: str, spec_id: int = 1) -> RegionSpec:
    """``identity(column)`` as field ``column``."""
    return RegionSpec(spec_id, [RegionField(column, [_field_id_of(schema, column)], "identity")])


def expression_spec(
    schema: Any, columns: list[str], sql: str, result_type: str, spec_id: int = 1
) -> RegionSpec:
    """A DataFusion SQL expression over ``col0..`` = ``columns``, as field ``expr``."""
    ids = [_field_id_of(schema, c) for c in columns]
    return RegionSpec(spec_id, [RegionField("expr", ids, expression=sql, result_type=result_type)])
