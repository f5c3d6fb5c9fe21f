"""Shared pieces of the searches: column names and tuning constants."""

from __future__ import annotations

DISTANCE = "_distance"
ROWID = "_rowid"
SCORE = "_score"
K1 = 1.2
B = 0.75
BLOOM_FILE = "bloom_filter.bin"
_PROBE = "__memwal_probe"
_IDX = "__memwal_idx"
_SRC = "__memwal_src"
_PRUNE_MAX_KEYS = 64
_SMALL_MATCH = 64  # key pairs compared as Python values (see _match_keys)
_BASE_LOOKUP_CHUNK = 20_000
# Lookups of many keys scan the base's key columns instead (see _use_base_key_scan).
_BASE_KEY_SCAN_MIN_KEYS = 20_000
_BASE_KEY_SCAN_ROWS_PER_KEY = 50
_BASE_KEY_SCAN_MAX_ROWS = 32_000_000
_MAX_ROUNDS = 12
_BOUND_SLACK = 1e-5  # relative: float32 scores, and df recovered from a rounded score
_BOUND_MAX_FETCH = 256  # rows (or 16 k) a full-text source is re-asked for at most

DEFAULT_NPROBES = 20
"""Default ``nprobes`` of vector search (Python, SQL functions, CLI, Spark)."""
DEFAULT_REFINE_FACTOR = 20
"""Default ``refine_factor`` of vector search (Python, SQL functions, CLI, Spark): an
indexed source re-ranks at least ``refine_factor * k`` candidates by their exact
distance, and more while its quantization error says a better row may lie beyond them
(``docs/search.md``, "Vector search")."""
POOL_SCAN_FACTOR = 8
"""An indexed source's quantized scan asks for this many times its refine pool (row ids
and quantized distances only: 1,600 cost about what 200 do), so a pool widened by the
quantization error rarely needs a second scan (which asks for this many times more)."""
POOL_ERROR_MARGIN = 1.25
"""An indexed source reads every row whose quantized distance is below its ``k``-th
exact distance plus this many times the largest quantization error measured on the rows
it read, until no more qualify. On 32-d clustered data with IVF_PQ 64x8, 300 queries,
k=10, a first read of 200 rows: 1.0 gives recall@10 0.965 (median 200 rows read, mean
532), 1.25 gives 0.985 (median 240, mean 758), 1.5 gives 0.995 (median 383, mean 1033).
Reading a row costs about what Lance's own refinement of it does."""
POOL_MAX_GROWTH = 64
"""The widened pool stops at this many times ``refine_factor * k`` rows."""
