"""Bit-reversed 64-bit file naming for WAL entries and region manifest versions.

Position 5 (binary ``...000101``) is written as the 64-character string
``1010000...0``: the binary digits reversed, so that consecutive numbers differ in
their first characters and spread across an object store's key space.
"""

from __future__ import annotations

from memwal_query.exceptions import InvalidPathError

_WIDTH = 64
_MAX = (1 << _WIDTH) - 1

WAL_SUFFIX = ".arrow"
MANIFEST_SUFFIX = ".binpb"


def bit_reversed(n: int) -> str:
    """Return the 64-character bit-reversed binary name of ``n`` (0 <= n < 2**64)."""
    if not 0 <= n <= _MAX:
        raise InvalidPathError(f"position {n} is out of range for a 64-bit name")
    return format(n, "064b")[::-1]


def from_bit_reversed(name: str) -> int:
    """Inverse of :func:`bit_reversed`; accepts a name with or without a suffix."""
    stem = name.rsplit("/", 1)[-1].split(".", 1)[0]
    if len(stem) != _WIDTH or set(stem) - {"0", "1"}:
        raise InvalidPathError(f"{name!r} is not a bit-reversed 64-bit name")
    return int(stem[::-1], 2)


def numbers_in(names: list[str], suffix: str) -> list[int]:
    """Sorted numbers of the bit-reversed names ending with ``suffix`` (others ignored)."""
    out = []
    for name in names:
        if name.endswith(suffix):
            try:
                out.append(from_bit_reversed(name))
            except ValueError:
                continue
    return sorted(out)


def wal_entry_name(position: int) -> str:
    """File name of the WAL entry at ``position``."""
    return bit_reversed(position) + WAL_SUFFIX


def manifest_name(version: int) -> str:
    """File name of region manifest ``version``."""
    return bit_reversed(version) + MANIFEST_SUFFIX
