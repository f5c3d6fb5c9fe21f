"""Region fields defined by a DataFusion SQL expression over ``col0, col1, ...``.

``expression`` is evaluated by DataFusion (``datafusion`` package) over a batch with
columns ``col0..colN-1`` (``DataFrame.select_exprs``: only an expression is accepted,
never a statement), and the result is cast to ``result_type`` (required). Row order is
checked with a row-number column. The ``SessionContext`` is cached per thread (a context
holds no spec state; each call registers and drops its own table): a fresh context per
call measured ~0.6 ms vs ~0.45 ms cached for a small batch. Obviously volatile functions
(``random()``, ``now()``, ``current_date``...) are rejected when the field is built.

Only deterministic scalar functions whose output is bounded by their input and the
expression's text may be called (:data:`EXPRESSION_FUNCTIONS`; e.g. ``repeat``,
``lpad``, ``replace``, aggregates, window and table functions and subqueries are
refused when the field is built): a region expression runs on every write. The
expression text is at most :data:`MAX_EXPRESSION_CHARS` characters, and a string or
binary region value longer than :data:`MAX_REGION_VALUE_BYTES` is a RegionSpecError.
Expressions prune only when every source column is pinned by ``=``/``in``.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import RegionSpecError
from memwal_query.regions.arrowtypes import cast_result
from memwal_query.regions.transform import MultiSourceTransform

__all__ = [
    "EXPRESSION_FUNCTIONS",
    "MAX_EXPRESSION_CHARS",
    "MAX_REGION_VALUE_BYTES",
    "ExpressionTransform",
]

_VOLATILE = re.compile(
    r"\b(?:(?:random|rand|uuid|now|today|clock_timestamp)\s*\(|"
    r"(?:current_date|current_time|current_timestamp|localtime|localtimestamp)\b)",
    re.IGNORECASE,
)
_SQL_STRING = re.compile(r"'(?:[^']|'')*'")
_SQL_QUOTED_NAME = re.compile(r'"(?:[^"]|"")*"')
_CALL = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\(")
_SQL_WORDS = {"in", "not", "and", "or", "when", "then", "else", "is", "like", "ilike"}
_SQL_WORDS |= {"between", "case", "end", "cast", "try_cast", "similar", "to", "as"}
EXPRESSION_FUNCTIONS = frozenset(
    """abs acos asin atan atan2 cbrt ceil cos cosh degrees exp factorial floor gcd isnan
    iszero lcm ln log log10 log2 nanvl pi power pow radians round signum sin sinh sqrt
    tan tanh trunc greatest least coalesce nullif nvl nvl2 ifnull
    ascii bit_length btrim char_length character_length chr concat concat_ws ends_with
    initcap left length levenshtein lower ltrim octet_length reverse right rtrim
    split_part starts_with strpos instr position substr substring substr_index
    substring_index translate trim upper md5 sha224 sha256 sha384 sha512 digest to_hex
    encode decode date_part datepart date_trunc datetrunc extract date_bin to_timestamp
    to_timestamp_seconds to_timestamp_millis to_timestamp_micros to_timestamp_nanos
    to_date to_char date_format to_unixtime from_unixtime make_date arrow_cast
    arrow_typeof""".split()
)
"""Functions a region expression may call: deterministic, scalar, and with an output
bounded by their input and the expression's text (no ``repeat``/``lpad``/``rpad``/
``replace``/``regexp_replace``, which can multiply a value's size)."""
MAX_EXPRESSION_CHARS = 4096
MAX_REGION_VALUE_BYTES = 1024
_ROW = "__memwal_row"


class ExpressionTransform(MultiSourceTransform):
    """A region field's SQL ``expression`` over its sources, as a transform.

    Parameters
    ----------
    field_id : str
        The region field's id.
    num_sources : int
        Number of source columns (at least one).
    expression : str
        The DataFusion SQL expression (checked: deterministic, bounded functions only).
    declared : pyarrow.DataType or None
        The declared result type (required).

    Raises
    ------
    RegionSpecError
        If the expression is empty, has no source, no result type, or calls a function
        that is volatile or not in :data:`EXPRESSION_FUNCTIONS`.
    """

    name = "expression"

    def __init__(
        self, field_id: str, num_sources: int, expression: str, declared: pa.DataType | None
    ) -> None:
        fid = field_id
        if not isinstance(expression, str) or not expression.strip():
            raise RegionSpecError(f"region field {fid!r}: empty expression")
        if not num_sources:
            raise RegionSpecError(f"region field {fid!r}: an expression needs source ids")
        if declared is None:
            raise RegionSpecError(f"region field {fid!r}: an expression needs result_type")
        volatile = _VOLATILE.search(_SQL_STRING.sub("''", expression))
        if volatile:
            raise RegionSpecError(
                f"region field {fid!r}: expression uses {volatile.group(0).strip('( ')!r}, "
                "which is not deterministic and stateless"
            )
        _check_expression_calls(fid, expression)
        super().__init__(field_id, num_sources, {}, declared)
        self.expression = expression
        self.out_type: pa.DataType = declared

    def check_sources(self, num_sources: int) -> None:
        """One or more sources (checked in the constructor)."""

    def can_transform(self, source_type: pa.DataType) -> bool:
        """Decided by DataFusion when the expression is evaluated."""
        return True

    def transform_columns(self, arrays: Sequence[pa.Array], n: int) -> pa.Array:
        """The expression's values (already of the declared type)."""
        return _eval_expression(self.expression, list(arrays), n, self.out_type, self.field_id)


def _check_expression_calls(field_id: str, expression: str) -> None:
    """RegionSpecError unless the expression only calls :data:`EXPRESSION_FUNCTIONS`."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise RegionSpecError(
            f"region field {field_id!r}: expression is {len(expression)} characters long "
            f"(at most {MAX_EXPRESSION_CHARS})"
        )
    code = _SQL_QUOTED_NAME.sub('""', _SQL_STRING.sub("''", expression))
    if re.search(r"\bselect\b", code, re.IGNORECASE):
        raise RegionSpecError(f"region field {field_id!r}: a subquery is not a scalar expression")
    for m in _CALL.finditer(code):
        name = m.group(1).lower()
        if name not in EXPRESSION_FUNCTIONS and name not in _SQL_WORDS:
            raise RegionSpecError(
                f"region field {field_id!r}: expression calls {m.group(1)!r}, which is not "
                "a deterministic scalar function with a bounded result; allowed: "
                "memwal_query.regions.spec.EXPRESSION_FUNCTIONS"
            )


def _check_value_sizes(values: pa.Array, field_id: str) -> None:
    """RegionSpecError when a string/binary region value exceeds MAX_REGION_VALUE_BYTES."""
    t = values.type
    if not (
        pa.types.is_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_string(t)
        or pa.types.is_large_binary(t)
    ):
        return
    longest = pc.max(pc.binary_length(values)).as_py()
    if longest is not None and longest > MAX_REGION_VALUE_BYTES:
        raise RegionSpecError(
            f"region field {field_id!r}: expression produced a {longest}-byte value "
            f"(region values are at most {MAX_REGION_VALUE_BYTES} bytes)"
        )


_DF_LOCAL = threading.local()


def _df_context() -> Any:
    ctx = getattr(_DF_LOCAL, "ctx", None)
    if ctx is None:
        import datafusion

        config = datafusion.SessionConfig().with_target_partitions(1)
        ctx = _DF_LOCAL.ctx = datafusion.SessionContext(config)
    return ctx


_REGION_EXPR_POOL: ThreadPoolExecutor | None = None
_REGION_EXPR_POOL_LOCK = threading.Lock()


def _eval_expression(
    expression: str, arrays: list[pa.Array], n: int, out_type: pa.DataType, field_id: str
) -> pa.Array:
    """Evaluate a region expression with DataFusion, on a worker thread of our own.

    The caller may itself run inside DataFusion (region pruning during a SQL scan):
    starting DataFusion's runtime from within its runtime panics, so the evaluation
    always runs on a thread that is not driving one.
    """
    global _REGION_EXPR_POOL
    if _REGION_EXPR_POOL is None:
        with _REGION_EXPR_POOL_LOCK:
            if _REGION_EXPR_POOL is None:
                _REGION_EXPR_POOL = ThreadPoolExecutor(4, thread_name_prefix="memwal-region-expr")
    return _REGION_EXPR_POOL.submit(
        _eval_expression_here, expression, arrays, n, out_type, field_id
    ).result()


def _eval_expression_here(
    expression: str, arrays: list[pa.Array], n: int, out_type: pa.DataType, field_id: str
) -> pa.Array:
    if n == 0:
        return pa.array([], out_type)
    names = [f"col{i}" for i in range(len(arrays))]
    batch = pa.RecordBatch.from_arrays(
        [*arrays, pa.array(np.arange(n, dtype=np.int64))], names=[*names, _ROW]
    )
    ctx = _df_context()
    table = f"__memwal_region_{uuid.uuid4().hex}"
    try:
        ctx.register_record_batches(table, [[batch]])
    except Exception as e:  # noqa: BLE001 - e.g. an Arrow type DataFusion lacks
        raise RegionSpecError(f"region field {field_id!r}: cannot pass columns: {e}") from e
    try:
        result = ctx.table(table).select_exprs(f"({expression}) AS v", _ROW).collect()
    except Exception as e:  # noqa: BLE001 - DataFusion raises plain Exceptions
        raise RegionSpecError(
            f"region field {field_id!r}: cannot evaluate expression {expression!r}: {e}"
        ) from e
    finally:
        ctx.deregister_table(table)
    if not result:
        raise RegionSpecError(f"region field {field_id!r}: expression returned no rows")
    out = pa.Table.from_batches(result)
    rows = out.column(_ROW).to_numpy()
    values = out.column("v").combine_chunks()
    if len(values) != n:
        raise RegionSpecError(f"region field {field_id!r}: expression changed the row count")
    if n > 1 and not bool(np.all(rows[1:] > rows[:-1])):
        values = values.take(pa.array(np.argsort(rows, kind="stable")))
    _check_value_sizes(values, field_id)
    return cast_result(values, out_type, field_id)
