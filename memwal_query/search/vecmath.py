"""Exact vector math of search: the non-null vectors of a column as a float32 matrix,
and distances to a query vector by metric (vectorised numpy)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import MemWalError
from memwal_query.search.keys import _mask_to_indices


def _vectors(col: pa.ChunkedArray | pa.Array, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(float32 matrix of the non-null vectors, their row indices)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    n = len(col)
    valid = (
        np.ones(n, bool) if col.null_count == 0 else col.is_valid().to_numpy(zero_copy_only=False)
    )
    idx = _mask_to_indices(valid)
    if len(idx) == 0:
        return np.zeros((0, dim), np.float32), idx
    if col.null_count:
        col = col.filter(pa.array(valid))
    flat = col.flatten() if isinstance(col, pa.FixedSizeListArray) else pc.list_flatten(col)
    mat = flat.to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, dim)
    return mat, idx


def _distances(mat: np.ndarray, q: np.ndarray, metric: str) -> np.ndarray:
    if metric in ("l2", "euclidean"):
        diff = mat - q
        return np.einsum("ij,ij->i", diff, diff)
    if metric == "cosine":
        denom = np.linalg.norm(mat, axis=1) * float(np.linalg.norm(q))
        with np.errstate(divide="ignore", invalid="ignore"):
            d = 1.0 - (mat @ q) / denom
        return np.where(np.isfinite(d), d, np.inf)
    if metric == "dot":
        return 1.0 - mat @ q
    if metric == "hamming":  # uint8 vectors: differing bits
        diff = np.bitwise_xor(mat.astype(np.uint8), q.astype(np.uint8))
        return np.unpackbits(diff, axis=1).sum(1).astype(np.float32)
    raise MemWalError(f"exact re-scoring does not support metric {metric!r}")
