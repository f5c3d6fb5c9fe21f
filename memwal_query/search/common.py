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
