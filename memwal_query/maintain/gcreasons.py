"""Why garbage collection keeps a flushed generation (``memwal gc`` prints it).

:func:`memwal_query.maintain.gc.gc` removes a generation only when every retained base version
has merged it and every maintained index has caught up to it (see that module). Right
after a merge, the base version *before* the merge is still retained (Lance keeps old
versions until ``cleanup_old_versions``), and it has not merged anything: that is the
usual reason a gc frees nothing. :func:`kept_generations` names, per kept generation,
each rule that holds it, with the version or index responsible, read from the same
state ``gc`` reads.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memwal_query.format.index import read_index

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog


@dataclass
class Kept:
    """One generation gc keeps, and why (one line per rule that holds it)."""

    region_id: str
    generation: int
    reasons: list[str]


def _age(timestamp: object) -> str:
    if not isinstance(timestamp, dt.datetime):
        return ""
    now = dt.datetime.now(timestamp.tzinfo)
    hours = (now - timestamp).total_seconds() / 3600
    return f", {hours:.1f} h old"


def kept_generations(table: Catalog) -> list[Kept]:
    """Every generation listed in a region manifest that gc keeps, with its reasons:
    not merged yet; a retained base version that has not merged it (the oldest such
    version is named, with its age: ``--cleanup-older-than`` below that age frees it);
    a maintained index not caught up to it."""
    ds = table.dataset()
    retained = []  # (version, timestamp, merged map or None before the MemWAL existed)
    for v in ds.versions():
        idx = read_index(table.io, table.dataset(version=v["version"]))
        retained.append((v["version"], v.get("timestamp"), idx and idx.merged_generations()))
    latest = table.index()
    merged_now = latest.merged_generations()
    catchup = latest.index_catchup()
    out: list[Kept] = []
    for region_id in table.region_ids():
        manifest = table.region_manifest(region_id)
        if manifest is None:
            continue
        for g in sorted(x.generation for x in manifest.flushed_generations):
            reasons = []
            if g > merged_now.get(region_id, 0):
                reasons.append("not merged yet (memwal merge)")
            else:
                behind = [(rv, ts) for rv, ts, m in retained if (m or {}).get(region_id, 0) < g]
                if behind:
                    first, ts = behind[0]
                    more = f" (and {len(behind) - 1} later ones)" if len(behind) > 1 else ""
                    reasons.append(
                        f"retained base version {first}{_age(ts)}{more} predates its merge: "
                        "kept for time travel until old versions are cleaned up "
                        "(memwal gc --cleanup-older-than DURATION, e.g. 24h)"
                    )
            for name in table.maintained_indexes:
                done = catchup.get(name, {}).get(region_id, 0) if name in catchup else g
                if done < g:
                    reasons.append(
                        f"index {name} caught up to generation {done} only (memwal catch-up)"
                    )
            if reasons:
                out.append(Kept(region_id, g, reasons))
    return out
