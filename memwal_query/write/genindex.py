"""Maintained indexes of flushed generations (``MemWalIndexDetails.maintained_indexes``).

At flush time :func:`build_maintained_indexes` builds, on the generation's Lance table,
the same kind of index as each maintained base-table index, under the same name (vector
indexes with the base index's centroids and PQ codebook, full-text with its tokenizer,
scalar of the same type), and records what was built in ``memwal_indexes.json``
(:func:`read_report`): ``status`` ``built``, ``fallback`` (a simpler index) or
``skipped`` (``reason`` says why). A maintained index never makes a flush fail. What the
base indexes are is read by :mod:`memwal_query.format.baseindex`; the reasoning:
``docs/search.md``, "Generation indexes".
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import lance

from memwal_query.format.baseindex import (
    TOKENIZE_KEYS,
    BaseIndexInfo,
    VectorModel,
    base_indexes,
    fts_params,
    vector_model,
)
from memwal_query.format.schema import TOMBSTONE
from memwal_query.storage.io import join

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog

LOG = logging.getLogger(__name__)
REPORT_FILE = "memwal_indexes.json"

_CREATE_EXTRA_KEYS = ("with_position", "block_size")


def _inverted_create_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    keys = TOKENIZE_KEYS + _CREATE_EXTRA_KEYS
    return {k: params[k] for k in keys if k in params and params[k] is not None}


# -- building ----------------------------------------------------------------------------
def _build_vector(
    gen_ds: lance.LanceDataset, info: BaseIndexInfo, model: VectorModel
) -> dict[str, Any]:
    col = info.column
    if TOMBSTONE in gen_ds.schema.names and gen_ds.count_rows(filter=f"NOT {TOMBSTONE}") == 0:
        return {"status": "skipped", "reason": "only tombstones"}
    common = dict(
        name=info.name,
        metric=model.metric,
        num_partitions=model.num_partitions,
        ivf_centroids=model.centroids,
        replace=True,
    )
    attempts: list[tuple[str, dict[str, Any]]] = []
    t = model.index_type
    if "PQ" in t and model.codebook is not None and model.num_sub_vectors:
        attempts.append(
            (t, dict(common, num_sub_vectors=model.num_sub_vectors, pq_codebook=model.codebook))
        )
    elif "PQ" not in t:
        attempts.append((t, common))
    attempts.append(("IVF_FLAT", common))
    errors = []
    for index_type, kwargs in attempts:
        try:
            gen_ds.create_index(col, index_type, **kwargs)
        except Exception as e:  # noqa: BLE001 - try the next, simpler index
            errors.append(f"{index_type}: {e}")
            continue
        status = "built" if index_type == t else "fallback"
        out: dict[str, Any] = {"status": status, "built_type": index_type}
        if errors:
            out["reason"] = "; ".join(errors)
        return out
    return {"status": "skipped", "reason": "; ".join(errors)}


def build_maintained_indexes(
    table: Catalog, gen_ds: lance.LanceDataset, base: lance.LanceDataset | None = None
) -> dict[str, Any]:
    """Build every maintained index of ``table`` on a freshly written generation.

    Parameters
    ----------
    table : Catalog
        The table (its base dataset supplies the index definitions).
    gen_ds : lance.LanceDataset
        The generation's Lance table (already written, with its bloom filter).
    base : lance.LanceDataset, optional
        The base table's latest version when the caller has it (default: checked out).

    Returns
    -------
    dict
        ``{index_name: report}`` as written to ``memwal_indexes.json``.
    """
    if base is None:
        base = table.dataset()
    known = base_indexes(base)
    existing = {d.name for d in gen_ds.describe_indices()}
    report: dict[str, Any] = {}
    for name in table.maintained_indexes:
        info = known.get(name)
        if info is None:
            report[name] = {"status": "skipped", "reason": "no such index on the base table"}
            continue
        entry: dict[str, Any] = {
            "kind": info.kind,
            "type": info.index_type,
            "column": info.column,
        }
        if name in existing:
            entry.update(status="built", built_type=info.index_type, reason="already present")
            report[name] = entry
            continue
        try:
            if info.kind == "vector":
                model = vector_model(base, info, table.storage_options)
                entry.update(_build_vector(gen_ds, info, model))
            elif info.kind == "fts":
                params = fts_params(base, name)
                gen_ds.create_scalar_index(
                    info.column, "INVERTED", name=name, **_inverted_create_kwargs(params)
                )
                entry.update(status="built", built_type="INVERTED")
            else:
                gen_ds.create_scalar_index(
                    info.column,
                    info.index_type.upper(),  # type: ignore[arg-type]  # a Lance index type
                    name=name,
                )
                entry.update(status="built", built_type=info.index_type.upper())
        except Exception as e:  # noqa: BLE001 - a maintained index never fails a flush
            LOG.warning("generation %s: cannot build index %s: %s", gen_ds.uri, name, e)
            entry.update(status="skipped", reason=str(e))
        report[name] = entry
    table.io.write(join(gen_ds.uri, REPORT_FILE), json.dumps(report, sort_keys=True).encode())
    return report


def read_report(table: Catalog, gen_uri: str) -> dict[str, Any]:
    """The ``memwal_indexes.json`` of a generation (``{}`` when absent)."""
    try:
        return json.loads(table.io.read(join(gen_uri, REPORT_FILE)))
    except Exception:  # noqa: BLE001 - no report: nothing maintained
        return {}
