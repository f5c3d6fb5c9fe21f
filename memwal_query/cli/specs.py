"""``memwal spec set`` and ``memwal spec show``: a table's region specs."""

from __future__ import annotations

import click

from memwal_query.cli.app import _handle_errors, _open, _progress, main
from memwal_query.cli.setup import _spec_from_options, spec_options


@main.group()
def spec() -> None:
    """Region specs: show them, or set the spec of new writes."""


@spec.command("set")
@click.argument("uri")
@spec_options
@click.option("--spec-id", type=int, help="Id of the new spec (default: the highest id + 1).")
@_handle_errors
def spec_set(
    uri: str,
    bucket: str | None,
    identity: str | None,
    expression: str | None,
    columns: str | None,
    result_type: str,
    spec_id: int | None,
) -> None:
    """Make a new region spec the spec of new writes (t.maintenance.set_region_spec).

    Regions of older specs are flushed, sealed and merged into the base table first
    (their writers are fenced); the new spec's writers start after that. A rejected
    spec leaves the table unchanged.
    """
    t = _open(uri)
    if spec_id is None:
        spec_id = max(t.catalog.region_specs, default=0) + 1
    new = _spec_from_options(uri, bucket, identity, expression, columns, result_type, spec_id)
    if new is None:
        raise click.UsageError("give the new spec: --bucket, --identity or --expression")
    before = set(t.catalog.region_ids())
    with _progress(length=max(len(before), 1), label="sealing and merging") as bar:

        def step(done: int, total: int) -> None:
            bar.length = total  # the regions of older specs, known once listed
            bar.update(1)

        t.maintenance.set_region_spec(new, progress=step)
    sealed = [
        rid
        for rid in sorted(before)
        if (m := t.catalog.region_manifest(rid)) is not None and m.sealed
    ]
    click.echo(
        f"{t.uri}: region spec {new.spec_id} is current ({new.describe(t.catalog.lance_schema)}); "
        f"{len(sealed)} region(s) of older specs sealed and merged"
    )


@spec.command("show")
@click.argument("uri")
@_handle_errors
def spec_show(uri: str) -> None:
    """Every region spec of the table, with its regions (live and sealed)."""
    t = _open(uri)
    current = t.region_spec
    counts: dict[int, list[int]] = {}
    for rid in t.catalog.region_ids():
        m = t.catalog.region_manifest(rid)
        if m is not None:
            c = counts.setdefault(m.region_spec_id, [0, 0])
            c[1 if m.sealed else 0] += 1
    if current is None:
        click.echo(f"{t.uri}: no region spec recorded (one region, the default spec)")
    for spec_id, s in sorted(t.catalog.region_specs.items()):
        live, sealed = counts.get(spec_id, [0, 0])
        mark = " (current)" if current is not None and spec_id == current.spec_id else ""
        shown = s.describe(t.catalog.lance_schema)
        click.echo(f"spec {spec_id}{mark}: {shown}; regions: {live} live, {sealed} sealed")
    if 0 in counts:
        click.echo(f"manual regions (spec 0): {counts[0][0]} live, {counts[0][1]} sealed")
    if t.catalog.spec_change_pending:
        click.echo("the change to the current spec is not complete (the next writer does it)")
