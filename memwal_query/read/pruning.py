"""Predicates for region pruning, read from DataFusion's pushed-down filter.

:func:`predicates_from_expression` reads the filter's tree
(:func:`memwal_query.read.exprtree.decode`) into a conjunction of simple predicates
``(column, op, value)`` with ``op`` in ``= != < <= > >= in``. Anything it does not
understand is dropped from the conjunction, which only means *less* pruning: pruning
never depends on a predicate it could not read. ``OR`` of equalities on one column
becomes ``in``.

The predicates are then checked against each region's value with
:meth:`memwal_query.regions.spec.RegionSpec.may_match` (transform-aware, in the manner of
PyIceberg's ``project``).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.read.exprtree import Node, decode, fields_of

_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "=": "=", "!=": "!="}

Predicate = tuple[str, str, Any]


def predicates_from_expression(expr: Any) -> list[Predicate]:
    """Conjunction of simple predicates implied by a pyarrow filter expression.

    Read from the expression tree (:func:`decode`), whose literals keep their exact
    value: the canonical text cannot be trusted for strings, which pyarrow prints
    without escaping (``'x", "y'`` in an ``IN`` list would read as two values, and
    pruning on them would skip the region that holds the real one). An expression that
    cannot be decoded gives no predicate (less pruning, never a wrong one).
    """
    if expr is None or not isinstance(expr, pc.Expression):
        return []
    node = decode(expr)
    return [] if node is None else _tree_conjuncts(node)


_TREE_OPS = {
    "equal": "=",
    "not_equal": "!=",
    "less": "<",
    "less_equal": "<=",
    "greater": ">",
    "greater_equal": ">=",
}
_NO_VALUE = object()  # a literal without an exact Python value: no predicate from it


def _literal_value(scalar: pa.Scalar) -> Any:
    """Exact Python value of a literal; None for NULL, ``_NO_VALUE`` if not exact."""
    if not scalar.is_valid:
        return None
    t = scalar.type
    if pa.types.is_dictionary(t):
        return _literal_value(scalar.value)
    unit = getattr(t, "unit", None)
    if unit == "ns" and (pa.types.is_timestamp(t) or pa.types.is_duration(t)):
        # as_py() would give a pandas object, or drop the nanoseconds
        nanos = scalar.cast(pa.int64()).as_py()
        if nanos % 1000:
            return _NO_VALUE
        coarse = pa.timestamp("us", t.tz) if pa.types.is_timestamp(t) else pa.duration("us")
        return pa.scalar(nanos // 1000, pa.int64()).cast(coarse).as_py()
    if pa.types.is_time64(t) and unit == "ns":
        nanos = scalar.cast(pa.int64()).as_py()
        if nanos % 1000:
            return _NO_VALUE
        return pa.scalar(nanos // 1000, pa.int64()).cast(pa.time64("us")).as_py()
    try:
        return scalar.as_py()
    except (pa.ArrowException, ValueError, OverflowError):
        return _NO_VALUE


def _tree_conjuncts(node: Node) -> list[Predicate]:
    """:func:`_conjuncts` of a decoded tree (see :func:`predicates_from_expression`)."""
    if node[0] != "call":
        return []
    _, name, args, options = node
    if name in ("and", "and_kleene") and len(args) == 2:
        return _tree_conjuncts(args[0]) + _tree_conjuncts(args[1])
    if name in _TREE_OPS and len(args) == 2:
        a, b = args
        op = _TREE_OPS[name]
        if a[0] == "field" and b[0] == "lit":
            column, lit = a[1], b[1]
        elif a[0] == "lit" and b[0] == "field":
            column, lit, op = b[1], a[1], _FLIP[op]
        else:
            return []
        value = _literal_value(lit)
        return [] if value is None or value is _NO_VALUE else [(column, op, value)]
    if name == "is_in" and len(args) == 1 and args[0][0] == "field" and options is not None:
        try:
            value_set = options["value_set"].values
        except (KeyError, AttributeError, TypeError):
            return []
        if value_set is None:
            return []
        # one Python value per literal of the IN list (not per data row)
        values = [_literal_value(value_set[i]) for i in range(len(value_set))]
        if any(v is _NO_VALUE for v in values):
            return []
        return [(args[0][1], "in", values)]
    if name in ("or", "or_kleene"):
        column, values = _tree_equalities(node)
        if column is not None:
            return [(column, "in", values)]
    return []


def disjunctions_from_expression(expr: Any) -> list[list[list[Predicate]]]:
    """The conjuncts of a filter that are an ``OR``, each as the conjunctions of
    simple predicates of its disjuncts (as :func:`predicates_from_expression` reads
    them): ``(a = 1 AND b = 'x') OR (a = 2 AND b = 'y')`` gives
    ``[[[("a", "=", 1), ("b", "=", "x")], [("a", "=", 2), ("b", "=", "y")]]]``.
    A disjunct's conjunction may be partial (predicates it could not read are
    dropped), so each one is implied by its disjunct."""
    if expr is None or not isinstance(expr, pc.Expression):
        return []
    node = decode(expr)
    if node is None:
        return []
    out = []
    for conjunct in _and_parts(node):
        if conjunct[0] == "call" and conjunct[1] in ("or", "or_kleene"):
            out.append([_tree_conjuncts(d) for d in _or_parts(conjunct)])
    return out


def _and_parts(node: Node) -> list[Node]:
    if node[0] == "call" and node[1] in ("and", "and_kleene") and len(node[2]) == 2:
        return _and_parts(node[2][0]) + _and_parts(node[2][1])
    return [node]


def _or_parts(node: Node) -> list[Node]:
    if node[0] == "call" and node[1] in ("or", "or_kleene") and len(node[2]) == 2:
        return _or_parts(node[2][0]) + _or_parts(node[2][1])
    return [node]


def _tree_equalities(node: Node) -> tuple[str | None, list[Any]]:
    """``a = 1 or a = 2 or a in (3)`` -> ``("a", [1, 2, 3])``; otherwise ``(None, [])``."""
    if node[0] == "call" and node[1] in ("or", "or_kleene") and len(node[2]) == 2:
        c1, v1 = _tree_equalities(node[2][0])
        c2, v2 = _tree_equalities(node[2][1])
        if c1 is not None and c1 == c2:
            return c1, v1 + v2
        return None, []
    preds = _tree_conjuncts(node)
    if len(preds) == 1 and preds[0][1] in ("=", "in"):
        column, op, value = preds[0]
        return column, (list(value) if op == "in" else [value])
    return None, []


def referenced_columns(expr: Any, names: list[str]) -> list[str]:
    """Columns of ``names`` that a filter expression reads (a superset if undecodable)."""
    if expr is None:
        return []
    node = decode(expr) if isinstance(expr, pc.Expression) else None
    if node is not None:
        used = fields_of(node)
        return [n for n in names if n in used]
    return list(names)  # cannot be read: every column may be referenced
