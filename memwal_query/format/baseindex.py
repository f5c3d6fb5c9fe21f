"""The base table's indexes as stored by Lance: what they are, and the parameters a
generation's index reuses.

:func:`base_indexes` describes the user indexes of a base version; :func:`vector_model`
reads a vector index's IVF centroids and PQ codebook (:func:`read_pq_codebook` decodes
the codebook from the index file, which pylance has no getter for); :func:`fts_params`
and :func:`tokenize_kwargs` give the tokenizer of an INVERTED index. Results are cached
per base version or index segments (they never change under those keys).
"""

from __future__ import annotations

import contextlib
import json
import logging
import weakref
import zlib
from dataclasses import dataclass
from typing import Any

import lance
import numpy as np
import pyarrow as pa

from memwal_query.storage.cache import LRUCache
from memwal_query.storage.io import join

LOG = logging.getLogger(__name__)

# Tensor.DataType of Lance's index protobuf -> numpy dtype.
_TENSOR_DTYPES = {1: np.float16, 2: np.float32, 3: np.float64, 4: np.uint8}

# Keys of an INVERTED index's ``params`` that configure tokenization.
TOKENIZE_KEYS = (
    "base_tokenizer",
    "language",
    "max_token_length",
    "lower_case",
    "stem",
    "remove_stop_words",
    "custom_stop_words",
    "ascii_folding",
    "min_ngram_length",
    "max_ngram_length",
    "prefix_only",
    "split_identifiers",
    "split_on_numerics",
    "preserve_original",
    "index_operators",
)


@dataclass(frozen=True)
class BaseIndexInfo:
    """One index of the base table.

    Attributes
    ----------
    name : str
    index_type : str
        Lance's type name (``IVF_PQ``, ``Inverted``, ``BTree``...).
    kind : str
        ``"vector"``, ``"fts"`` or ``"scalar"``.
    column : str
    fragment_ids : frozenset[int]
        Base fragments covered by the index (union of its segments).
    segment_uuids : tuple[str, ...]
    """

    name: str
    index_type: str
    kind: str
    column: str
    fragment_ids: frozenset[int]
    segment_uuids: tuple[str, ...]


@dataclass(frozen=True)
class VectorModel:
    """Quantization parameters of a base vector index, reused for generations."""

    index_type: str
    metric: str
    num_partitions: int
    centroids: pa.FixedSizeListArray
    num_sub_vectors: int | None = None
    num_bits: int = 8
    codebook: pa.FixedSizeListArray | None = None


_VERSION_KEYS: weakref.WeakKeyDictionary[Any, tuple[str, int, int]] = weakref.WeakKeyDictionary()


def version_key(ds: lance.LanceDataset) -> tuple[str, int, int]:
    """``(URI, version, CRC-32 of its manifest)``: a dataset version as the key of a
    cache of what never changes under it (computed once per dataset object). The
    version number alone does not tell apart two tables created one after the other
    at one URI (the first deleted): their manifests differ (data files are named
    uniquely)."""
    try:
        return _VERSION_KEYS[ds]
    except (KeyError, TypeError):
        pass
    try:
        manifest = ds._ds.serialized_manifest()
    except AttributeError:  # a pylance without it: the fragments' files instead
        manifest = repr([f.metadata for f in ds.get_fragments()]).encode()
    key = (ds.uri, ds.version, zlib.crc32(manifest))
    with contextlib.suppress(TypeError):  # an object without weak references
        _VERSION_KEYS[ds] = key
    return key


BASE_INDEXES: LRUCache[tuple[str, int, int], dict[str, BaseIndexInfo]] = LRUCache(256)
"""The user indexes of a base version, per (base URI, version)."""
VECTOR_MODELS: LRUCache[tuple[str, str, tuple[str, ...]], VectorModel] = LRUCache(64)
"""Centroids and PQ codebook of a base vector index, per (base URI, name, segment UUIDs)."""
FTS_PARAMS: LRUCache[tuple[str, int, str], dict[str, Any]] = LRUCache(64)
"""Tokenizer parameters of a base INVERTED index, per (base URI, version, name)."""


def _kind(index_type: str) -> str:
    t = index_type.upper()
    if t.startswith("IVF") or t in ("HNSW", "VECTOR"):
        return "vector"
    if t in ("INVERTED", "FTS"):
        return "fts"
    return "scalar"


def base_indexes(ds: lance.LanceDataset) -> dict[str, BaseIndexInfo]:
    """``{name: BaseIndexInfo}`` of the user indexes of ``ds`` (MemWAL index excluded).

    Cached per dataset version (a version's indexes never change).
    """
    key = version_key(ds)
    cached = BASE_INDEXES.get(key)
    if cached is not None:
        return cached
    out: dict[str, BaseIndexInfo] = {}
    for d in ds.describe_indices():
        if d.name.startswith("__") or not d.field_names:
            continue
        frags: set[int] = set()
        for s in d.segments:
            frags.update(int(f) for f in s.fragment_ids)
        out[d.name] = BaseIndexInfo(
            name=d.name,
            index_type=d.index_type,
            kind=_kind(d.index_type),
            column=d.field_names[0],
            fragment_ids=frozenset(frags),
            segment_uuids=tuple(str(s.uuid) for s in d.segments),
        )
    BASE_INDEXES.put(key, out)
    return out


def find_index(ds: lance.LanceDataset, column: str, kind: str) -> BaseIndexInfo | None:
    """The first index of ``kind`` (``vector``/``fts``/``scalar``) on ``column``."""
    for info in base_indexes(ds).values():
        if info.column == column and info.kind == kind:
            return info
    return None


# -- vector models -----------------------------------------------------------------------
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The protobuf varint at ``pos`` and the position after it."""
    shift = value = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, pos


def _parse_tensor(buf: bytes) -> tuple[int, list[int], bytes]:
    """Decode Lance's ``Tensor`` protobuf: (data_type, shape, data)."""
    pos = 0
    dtype, shape, data = 0, [], b""
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        fnum, wire = key >> 3, key & 7
        if wire == 0:
            v, pos = _varint(buf, pos)
            if fnum == 1:
                dtype = v
            elif fnum == 2:
                shape.append(v)
        elif wire == 2:
            n, pos = _varint(buf, pos)
            chunk = buf[pos : pos + n]
            pos += n
            if fnum == 2:  # packed shape
                spos = 0
                while spos < len(chunk):
                    v, spos = _varint(chunk, spos)
                    shape.append(v)
            elif fnum == 3:
                data = bytes(chunk)
        elif wire == 5:
            pos += 4
        elif wire == 1:
            pos += 8
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
    return dtype, shape, data


def read_pq_codebook(
    base_uri: str, segment_uuid: str, storage_options: dict[str, str] | None = None
) -> pa.FixedSizeListArray:
    """The PQ codebook of a vector index segment, as ``2**nbits`` rows of full dimension.

    Raises ValueError when the segment holds no readable codebook.
    """
    from lance.file import LanceFileReader

    path = join(base_uri, "_indices", segment_uuid, "auxiliary.idx")
    reader = LanceFileReader(path, storage_options=storage_options or None)
    meta = reader.metadata().schema.metadata or {}
    raw = meta.get(b"storage_metadata")
    if raw is None:
        raise ValueError(f"{path}: no storage_metadata")
    entries = json.loads(raw)
    info = json.loads(entries[0]) if isinstance(entries[0], str) else entries[0]
    if "codebook_position" not in info:
        raise ValueError(f"{path}: not a PQ storage ({sorted(info)})")
    dtype_code, shape, data = _parse_tensor(reader.read_global_buffer(info["codebook_position"]))
    dtype = _TENSOR_DTYPES.get(dtype_code)
    if dtype is None or len(shape) != 2:
        raise ValueError(f"{path}: unsupported codebook tensor type {dtype_code} {shape}")
    values = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"))
    if values.size != shape[0] * shape[1] or shape[1] != int(info.get("dimension", shape[1])):
        raise ValueError(f"{path}: codebook size {values.size} does not match shape {shape}")
    return pa.FixedSizeListArray.from_arrays(pa.array(values.astype(dtype)), shape[1])


def vector_model(
    ds: lance.LanceDataset, info: BaseIndexInfo, storage_options: dict[str, str] | None = None
) -> VectorModel:
    """Centroids (+ PQ codebook) of a base vector index; cached per index segments."""
    key = (ds.uri, info.name, info.segment_uuids)
    cached = VECTOR_MODELS.get(key)
    if cached is not None:
        return cached
    stats = ds.stats.index_stats(info.name)
    first = stats["indices"][0]
    metric = str(first.get("metric_type", "l2")).lower()
    sub = first.get("sub_index") or {}
    centroids = ds.get_ivf_model(info.name).centroids
    index_type = str(stats.get("index_type", info.index_type)).upper()
    codebook = None
    num_sub_vectors = sub.get("num_sub_vectors")
    num_bits = int(sub.get("nbits", 8) or 8)
    if "PQ" in index_type:
        try:
            codebook = read_pq_codebook(ds.uri, info.segment_uuids[0], storage_options)
        except Exception as e:  # noqa: BLE001 - IVF_FLAT fallback below
            LOG.warning("cannot read the PQ codebook of %s: %s", info.name, e)
    model = VectorModel(
        index_type=index_type,
        metric=metric,
        num_partitions=len(centroids),
        centroids=centroids,
        num_sub_vectors=int(num_sub_vectors) if num_sub_vectors else None,
        num_bits=num_bits,
        codebook=codebook,
    )
    VECTOR_MODELS.put(key, model)
    return model


def vector_metric(ds: lance.LanceDataset, info: BaseIndexInfo | None) -> str:
    """Distance type of a vector index (``l2`` when there is none).

    An index whose model cannot be read (e.g. Lance recorded an index without files,
    which it does when PQ training has too few rows) still has a metric in its
    statistics; failing that, ``l2`` (Lance's default for a flat search).
    """
    if info is None:
        return "l2"
    try:
        return vector_model(ds, info).metric
    except Exception as e:  # noqa: BLE001 - unreadable model: the metric is all we need
        LOG.warning("cannot read the model of vector index %s: %s", info.name, e)
    try:
        first = ds.stats.index_stats(info.name)["indices"][0]
        return str(first.get("metric_type", "l2")).lower()
    except Exception:  # noqa: BLE001 - no statistics either
        return "l2"


# -- full-text parameters ----------------------------------------------------------------
def fts_params(ds: lance.LanceDataset, index_name: str) -> dict[str, Any]:
    """The tokenizer parameters of an INVERTED index (as ``index_stats`` reports them)."""
    key = (ds.uri, ds.version, index_name)
    cached = FTS_PARAMS.get(key)
    if cached is not None:
        return cached
    stats = ds.stats.index_stats(index_name)
    params = dict((stats.get("indices") or [{}])[0].get("params") or {})
    FTS_PARAMS.put(key, params)
    return params


def tokenize_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of ``lance.tokenize`` that reproduce an index's tokenizer."""
    out = {k: params[k] for k in TOKENIZE_KEYS if k in params}
    analyzer = params.get("lance_tokenizer")
    if analyzer in ("text", "code"):
        out["analyzer"] = analyzer
    if "max_token_length" in params and params["max_token_length"] is None:
        out["max_token_length"] = None
    return out


def fts_tokenizers(base: lance.LanceDataset) -> list[tuple[str, dict[str, Any]]]:
    """``(column, lance.tokenize keywords)`` of every INVERTED index of the base table
    (each pair once): what a full-text search tokenizes a generation's column with."""
    out: list[tuple[str, dict[str, Any]]] = []
    for name, info in base_indexes(base).items():
        if info.kind != "fts":
            continue
        pair = (info.column, tokenize_kwargs(fts_params(base, name)))
        if pair not in out:
            out.append(pair)
    return out
