"""The ``memwal`` command line: maintenance and inspection commands (``status``,
``drain``, ``merge``, ``gc``, ``catch-up``, ``refresh-snapshots``, ``fsck``, ``repair``);
the other commands live in :mod:`memwal_query.cli.setup` and :mod:`memwal_query.cli.sql`,
registered on the group of :mod:`memwal_query.cli.app` when this module is imported.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from typing import Any

import click

from memwal_query.cli import setup as _setup  # noqa: F401  (registers its commands)
from memwal_query.cli import specs as _specs  # noqa: F401  (registers its commands)
from memwal_query.cli import sql as _sql  # noqa: F401  (registers its commands)
from memwal_query.cli.app import _handle_errors, _open, _progress, _regions, main, record_done
from memwal_query.cli.options import Duration
from memwal_query.cli.sql import _split_statements, _write_atomically  # noqa: F401
from memwal_query.exceptions import (
    MemWalError,
    NotInitializedError,
)


@main.command()
@click.argument("uri")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_handle_errors
def status(uri: str, as_json: bool) -> None:
    """One row per region: epoch, generations, unflushed WAL entries and rows (and the
    oldest one's age), whether its writer is alive, bytes."""
    st = _open(uri).maintenance.status()
    if as_json:
        click.echo(json.dumps(st.to_dict(), indent=2, default=str))
        return
    click.echo(
        f"{st.uri}  base version {st.base_version}  {st.live_rows:,} rows "
        f"({st.unflushed_rows:,} unflushed)  primary key {', '.join(st.primary_key)}  "
        f"region spec {st.region_spec}"
    )
    header = (
        f"{'region':36}  {'values':>14}  epoch  cur  flushed        merged  wal_span   "
        "unflushed  oldest  writer  bytes"
    )
    click.echo(header)
    for rid, r in st.regions.items():
        first, last = r.replay_after_wal_entry_position + 1, r.wal_last_position
        wal = f"{first}-{last}" if last >= first else "-"  # unflushed WAL entries
        gens = ",".join(map(str, r.flushed_generations)) or "-"
        vals = ",".join(f"{v}" for v in (r.region_values or {}).values()) or "-"
        age = "-" if r.oldest_unflushed_age is None else f"{r.oldest_unflushed_age:.0f}s"
        writer = "alive" if r.writer_alive else ("gone" if r.unflushed_rows else "-")
        click.echo(
            f"{rid:36}  {vals:>14}  {r.writer_epoch:5}  {r.current_generation:3}  "
            f"{gens:13}  {r.merged_generation:6}  {wal:9}  {r.unflushed_rows:9}  "
            f"{age:>6}  {writer:6}  {r.generation_bytes + r.wal_bytes}"
        )


@main.command()
@click.argument("uri")
@click.option("--region", multiple=True, help="Only this region (repeatable).")
@click.option("--dry-run", is_flag=True, help="Only show what would be drained.")
@_handle_errors
def drain(uri: str, region: tuple[str, ...], dry_run: bool) -> None:
    """Claim each region with unflushed rows, replay its WAL and flush it as a generation.

    Each such region is claimed (epoch + 1): meant for regions whose writer is gone; a
    live writer of such a region is fenced. (A table object's own ``flush()`` flushes
    only the writers it opened.)
    """
    _drain(uri, region, dry_run)


@main.command(hidden=True)
@click.argument("uri")
@click.option("--region", multiple=True, help="Only this region (repeatable).")
@click.option("--dry-run", is_flag=True, help="Only show what would be drained.")
@_handle_errors
def flush(uri: str, region: tuple[str, ...], dry_run: bool) -> None:
    """Deprecated spelling of ``memwal drain``."""
    from memwal_query.cli.options import warn

    warn("memwal flush is deprecated and will be removed in the next release; use memwal drain")
    _drain(uri, region, dry_run)


def _drain(uri: str, region: tuple[str, ...], dry_run: bool) -> None:
    t = _open(uri)
    regions = _regions(t, region)
    st = t.maintenance.status().regions
    todo = [rid for rid in regions if rid in st and st[rid].unflushed_rows]
    if dry_run:
        for rid in todo:
            click.echo(f"would flush {rid}: {st[rid].unflushed_rows} rows")
        click.echo(f"{len(todo)} region(s) would be flushed")
        return
    lines = []
    with _progress(todo, label="flushing") as bar:
        for rid in bar:
            gen = t.maintenance.drain(rid)
            lines.append(f"{rid}: generation {gen}")
            record_done(f"flushed region {rid} (generation {gen})")
    for line in lines:
        click.echo(line)
    click.echo(f"{len(lines)} region(s) flushed")


@main.command()
@click.argument("uri")
@click.option("--region", multiple=True, help="Only this region (repeatable).")
@click.option("--max-generations", type=click.IntRange(min=1), help="Per region.")
@click.option("--dry-run", is_flag=True, help="Only list the generations to merge.")
@_handle_errors
def merge(uri: str, region: tuple[str, ...], max_generations: int | None, dry_run: bool) -> None:
    """Merge flushed generations into the base table, in order."""
    t = _open(uri)
    regions = _regions(t, region)
    merged = t.catalog.index().merged_generations()
    if dry_run:
        for rid in regions:
            m = t.catalog.region_manifest(rid)
            todo = [
                g.generation for g in m.flushed_generations if g.generation > merged.get(rid, 0)
            ]
            click.echo(f"{rid}: would merge {todo[:max_generations] if max_generations else todo}")
        return
    lines = []
    with _progress(regions, label="merging") as bar:
        for rid in bar:
            done = t.maintenance.merge(regions=[rid], max_generations=max_generations)
            if done.merged:
                gens = done.by_region()[rid]
                lines.append(f"{rid}: merged {gens}")
                record_done(f"merged region {rid} generation(s) {gens}")
    for line in lines:
        click.echo(line)


@main.command()
@click.argument("uri")
@click.option("--dry-run", is_flag=True, help="Only say what would be removed.")
@click.option(
    "--cleanup-older-than",
    type=Duration(bare_unit="h"),
    help="First remove base versions older than this (e.g. 24h, 30m, 7d).",
)
@click.option("--verbose", "-v", is_flag=True, help="List every path and each kept generation.")
@_handle_errors
def gc(uri: str, dry_run: bool, cleanup_older_than: dt.timedelta | None, verbose: bool) -> None:
    """Delete merged, caught-up generations and their WAL entries; print one summary line
    (counts and bytes) and why generations were kept (--verbose: every path)."""
    from memwal_query.maintain.gcreasons import kept_generations

    t = _open(uri)
    older = cleanup_older_than
    sizes: dict[str, int] = {}
    with _progress(length=0, label="collecting", show_pos=True) as bar:

        def step(done: int, total: int) -> None:
            bar.length = total
            bar.update(done - bar.pos)

        removed = t.maintenance.gc(
            dry_run=dry_run, cleanup_older_than=older, progress=step, sizes=sizes
        )
    if dry_run and older is not None:
        click.echo(
            "note: a dry run removes no base versions, so generations that only those "
            "versions still need are not listed",
            err=True,
        )
    verb = "would remove" if dry_run else "removed"
    if verbose:
        for p in removed:
            click.echo(f"{verb} {p} ({_size_text(sizes.get(p, 0))})")
    wal = sum("/wal/" in p for p in removed)
    gens = len(removed) - wal
    click.echo(
        f"{t.uri}: {verb} {gens} generation(s) and {wal} WAL entr{'y' if wal == 1 else 'ies'}"
        f", {_size_text(sum(sizes.values()))}"
    )
    kept = kept_generations(t.catalog)
    if verbose:
        for k in kept:
            click.echo(f"kept {k.region_id} generation {k.generation}: {'; '.join(k.reasons)}")
    elif kept:
        reasons: dict[str, int] = {}
        for k in kept:
            for r in k.reasons:
                if r.startswith("retained base version"):  # names a version: one group
                    r = "kept by retained base versions (memwal gc --cleanup-older-than DURATION)"
                reasons[r] = reasons.get(r, 0) + 1
        why = "; ".join(f"{n} {r}" for r, n in reasons.items())
        click.echo(f"kept {len(kept)} generation(s): {why} (--verbose lists them)")


def _size_text(n: int) -> str:
    """``n`` bytes for a person: ``512 B``, ``3.2 KiB``, ``1.5 GiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


@main.command(name="catch-up")
@click.argument("uri")
@click.option("--index", "names", multiple=True, help="Index names (default: maintained).")
@click.option("--dry-run", is_flag=True, help="Only show what would be caught up.")
@_handle_errors
def catch_up(uri: str, names: tuple[str, ...], dry_run: bool) -> None:
    """Extend base indexes over merged data and record index catch-up progress."""
    t = _open(uri)
    chosen = list(names) or t.catalog.maintained_indexes
    existing = {d.name for d in t.catalog.dataset().describe_indices()}
    missing = [n for n in chosen if n not in existing]
    if missing:
        raise NotInitializedError(f"{t.uri}: no base index named {missing}")
    if dry_run:
        click.echo(_catch_up_plan(t, chosen))
        return
    if not chosen:
        click.echo("no maintained indexes: nothing to catch up")
        return
    progress: dict[str, dict[str, int]] = {}
    with _progress(chosen, label="catching up") as bar:
        for index_name in bar:
            progress.update(t.maintenance.catch_up_indexes([index_name]))
    click.echo(json.dumps(progress, indent=2))


def _catch_up_plan(t: Any, chosen: list[str]) -> str:
    """What ``catch-up`` would do: per index, the regions merged past its progress."""
    index = t.catalog.index()
    merged = index.merged_generations()
    progress = index.index_catchup()
    lines = []
    for name in chosen:
        done = progress.get(name, {})
        behind = {r: g for r, g in merged.items() if g > done.get(r, 0)}
        if behind:
            lines.append(f"would catch up {name} to {behind}")
    return "\n".join(lines) or "nothing to do: every index has caught up with the merged data"


@main.command(name="refresh-snapshots")
@click.argument("uri")
@click.option("--dry-run", is_flag=True, help="Only list the regions a snapshot would hold.")
@_handle_errors
def refresh_snapshots(uri: str, dry_run: bool) -> None:
    """Write region snapshots into the MemWAL index (for eventual reads)."""
    t = _open(uri)
    if dry_run:
        regions = t.catalog.region_ids()
        for rid in regions:
            click.echo(f"would snapshot {rid}")
        click.echo(f"{len(regions)} region(s) would be in the snapshot")
        return
    idx = t.maintenance.refresh_snapshots()
    click.echo(f"{idx.regions} region(s) in the snapshot")


# -- read-only SQL, fsck and repair -----------------------------------------------------


@main.command()
@click.argument("uri")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_handle_errors
def fsck(uri: str, as_json: bool) -> None:
    """Check every manifest, WAL entry, generation, bloom filter and the MemWAL index.

    Prints each finding (severity, file, problem, repair command); exits 1 when
    anything is corrupt (an error), 0 when the table is clean or has warnings only.
    """
    from memwal_query.maintain.fsck import ERROR, check

    t = _open(uri)
    try:
        regions = len(t.catalog.region_ids())
    except MemWalError:  # a damaged layout: check() reports it
        regions = 1
    with _progress(length=max(1, regions), label="checking regions") as bar:
        findings = check(t.catalog, progress=lambda _rid: bar.update(1))
    if as_json:
        click.echo(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        for f in findings:
            click.echo(str(f))
        errors = sum(f.severity == ERROR for f in findings)
        click.echo(
            f"{errors} error(s), {len(findings) - errors} warning(s)"
            if findings
            else f"{t.uri}: no problems found"
        )
    if any(f.severity == ERROR for f in findings):
        sys.exit(1)


@main.command()
@click.argument("uri")
@click.option("--region", help="Only this region (default: every region).")
@click.option(
    "--accept-loss",
    is_flag=True,
    help="Move the WAL past missing or corrupt entries; the writes they held are lost.",
)
@click.option("--dry-run", is_flag=True, help="Only show what would be done.")
@_handle_errors
def repair(uri: str, region: str | None, accept_loss: bool, dry_run: bool) -> None:
    """Repair what fsck found: version hints and bloom filters (lossless) and, with
    --accept-loss, WAL holes and corrupt unflushed WAL entries (each dropped position is
    printed). Corrupt manifests and a damaged index have no automatic repair.
    """
    from memwal_query.maintain.fsck import repair as do_repair

    t = _open(uri)
    done = 0
    for rid in _regions(t, region):
        for action in do_repair(t.catalog, rid, accept_loss=accept_loss, dry_run=dry_run):
            click.echo(("would " if dry_run else "") + action)
            done += 1
    click.echo(f"{done} repair(s)" + (" (dry run)" if dry_run else ""))


# Commands defined in their own modules (they import the helpers of cli.app).
from memwal_query.cli.changes import changes as _changes_command  # noqa: E402

main.add_command(_changes_command)
from memwal_query.cli.maintain import COMMAND as _maintain_command  # noqa: E402

main.add_command(_maintain_command)
