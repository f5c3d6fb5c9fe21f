"""The public surface of MemWalTable (docs/api.md), its typed results, and every
deprecated spelling: it still works, and warns naming the new one."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lance
import pytest
from click.testing import CliRunner

import memwal_query as mq

from helpers import basic_rows, default_region

API_DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def _documented_surface() -> list[str]:
    """The names of the table under "The surface of `MemWalTable`" in docs/api.md."""
    text = API_DOC.read_text()
    section = text.split("## The surface of `MemWalTable`", 1)[1].split("\n`t.maintenance`", 1)[0]
    return sorted(re.findall(r"^\| `(\w+)` \|", section, flags=re.M))


def test_dir_is_the_documented_surface(table):
    public = sorted(n for n in dir(table) if not n.startswith("_"))
    assert public == _documented_surface()
    assert public == sorted(n for n in dir(mq.MemWalTable) if not n.startswith("_"))
    assert isinstance(table.catalog, mq.MemWalTable.open.__globals__["Catalog"])
    assert not isinstance(table, mq.MemWalTable.open.__globals__["Catalog"])  # holds, is not


def test_namespaces_are_documented():
    text = API_DOC.read_text()
    for name in ("merge", "gc", "catch_up_indexes", "refresh_snapshots", "fsck", "status"):
        assert f"`{name}(" in text
    for name in ("maintain", "set_region_spec", "drain"):
        assert f"`{name}(" in text
    for name in ("register", "list", "drop"):
        assert f"`{name}(" in text
    assert "`add_columns(" in text


def test_alter_namespace_surface(table):
    assert sorted(n for n in dir(table.alter) if not n.startswith("_")) == ["add_columns"]
    assert issubclass(mq.SchemaChangedError, mq.SchemaError)


def test_options_are_keyword_only(table):
    with pytest.raises(TypeError):
        table.to_table(None, None, "strong")  # type: ignore[misc]
    with pytest.raises(TypeError):
        table.vector_search("vec", [0.0], 5, None)  # type: ignore[misc]
    with pytest.raises(TypeError):
        table.maintenance.merge("r")  # type: ignore[misc]
    with pytest.raises(TypeError):
        mq.MemWalTable.initialize("x", None, ["idx"])  # type: ignore[misc]
    with pytest.raises(TypeError):
        mq.MemWalTable.create("x", {"id": [1]}, "id")  # type: ignore[misc]
    with pytest.raises(TypeError):
        table.write(basic_rows([1]), True)  # type: ignore[misc]


def test_typed_results(table):
    from memwal_query.maintain.fsck import FsckReport
    from memwal_query.maintain.merger import MergeReport
    from memwal_query.maintain.snapshots import SnapshotRefresh

    table.write(basic_rows([1, 2, 3], val=[9.0] * 3))
    flushed = table.flush()
    report = table.maintenance.merge()
    assert isinstance(report, MergeReport)
    ((region, gen),) = flushed.items()
    assert report.by_region() == {region: [gen]}
    assert report.upserted == 3 and len(report) == 1
    snap = table.maintenance.refresh_snapshots()
    assert isinstance(snap, SnapshotRefresh)
    assert snap.regions == 1 and snap.dataset_version == table.catalog.dataset().version
    fsck = table.maintenance.fsck()
    assert isinstance(fsck, FsckReport) and fsck.ok and list(fsck) == []
    assert fsck.to_dict() == {"ok": True, "findings": []}
    assert table.count_rows() == 100


def test_index_is_pure_and_refresh_index_refreshes(table):
    """index() reads without changing what the spec properties answer from;
    refresh_index() makes the latest index the one they use."""
    from memwal_query.format import index as mwindex
    from memwal_query.regions.spec import bucket_spec

    cat = table.catalog
    before = cat.region_spec
    spec2 = bucket_spec(cat.dataset(), "id", 4, spec_id=2)
    mwindex.update_details(
        cat.io, cat.uri, lambda d: d.region_specs.append(spec2.to_proto()), cat.storage_options
    )
    assert max(s.spec_id for s in cat.index().details.region_specs) == 2
    assert cat.region_spec is before  # index() changed nothing
    assert cat.refresh_index().dataset_version == cat.dataset().version
    assert cat.region_spec.spec_id == 2


# -- deprecated spellings -----------------------------------------------------------


def _warns(new: str):
    return pytest.warns(DeprecationWarning, match=re.escape(new))


def test_deprecated_maintenance_spellings_warn_and_work(table):
    table.write(basic_rows([1, 2], val=[5.0, 6.0]))
    ((region, gen),) = table.flush().items()
    with _warns("MemWalTable.maintenance.merge"):
        assert table.merge(region) == [(region, gen)]  # the old shape
    with _warns("MemWalTable.maintenance.catch_up_indexes"):
        table.catch_up_indexes()
    with _warns("MemWalTable.maintenance.refresh_snapshots"):
        idx = table.refresh_snapshots()
    assert idx.details.num_regions == 1  # the old MemWalIndex
    with _warns("MemWalTable.maintenance.fsck"):
        assert table.check() == []
    with _warns("MemWalTable.maintenance.status"):
        assert region in table.status().regions
    with _warns("MemWalTable.maintenance.gc"):
        assert isinstance(table.gc(True), list)  # old positional dry_run
    with _warns("MemWalTable.maintenance.maintain"):
        table.maintain(None, True)


def test_deprecated_set_region_spec_warns_and_works(table):
    from memwal_query.regions.spec import bucket_spec

    spec = bucket_spec(table.catalog.dataset(), "id", 2, spec_id=2)
    with _warns("MemWalTable.maintenance.set_region_spec"):
        table.set_region_spec(spec)
    assert table.region_spec.spec_id == 2


def test_deprecated_consumer_spellings_warn_and_work(table):
    with _warns("MemWalTable.consumers.register"):
        table.register_consumer("etl")
    with _warns("MemWalTable.consumers.list()"):
        assert list(table.consumers()) == ["etl"]
    with _warns("MemWalTable.consumers.drop"):
        table.drop_consumer("etl")
    assert table.consumers.list() == {}


def test_deprecated_write_retries_warns_and_sets_fence_retries(table):
    with _warns("MemWalTable.fence_retries"):
        table.write_retries = 2
    assert table.fence_retries == 2
    with _warns("MemWalTable.fence_retries"):
        assert table.write_retries == 2


def test_catalog_names_through_the_table_warn(table):
    with _warns("MemWalTable.catalog.dataset"):
        assert table.dataset().version == table.catalog.dataset().version
    with _warns("MemWalTable.catalog.io"):
        assert table.io is table.catalog.io
    with _warns("MemWalTable.catalog.refresh_index"):
        table.refresh_index()
    with pytest.raises(AttributeError):
        table.no_such_name  # noqa: B018
    io = table.catalog.io
    with _warns("MemWalTable.catalog.io"):
        table.io = io  # set on the catalog, where lower layers read it
    assert "io" not in vars(table)


def test_a_table_passed_to_a_lower_layer_still_works_with_a_warning(table):
    from memwal_query.write.writer import RegionWriter

    with pytest.warns(DeprecationWarning, match="MemWalTable.catalog"):
        w = RegionWriter(table, default_region(), region_values={"bucket": 0}, region_spec_id=1)
        w.put(basic_rows([5]))  # the writer holds the table: each catalog name it uses warns
        w.close()
    assert table.lookup([5])["val"].to_pylist() == [5.0]


def test_spark_deprecated_spellings_warn():
    pytest.importorskip("pyspark")
    from memwal_query.spark import ingest
    from memwal_query.spark._common import option

    with _warns("option('rows_per_split')"):
        assert option({"rowspersplit": "5"}, "rows_per_split", "rowspersplit") == "5"
    with _warns("option('push_filters')"):
        assert option({"pushfilters": "true"}, "push_filters", "pushfilters") == "true"
    assert option({"rows_per_split": "7"}, "rows_per_split", "rowspersplit") == "7"
    with _warns("parallelism="), pytest.raises(mq.MemWalError):  # warned before opening
        ingest.write(object(), "/nowhere", num_partitions=2)  # type: ignore[arg-type]


# -- the CLI -------------------------------------------------------------------------


def _cli(*args: str):
    from memwal_query.cli.commands import main

    return CliRunner().invoke(main, list(args), prog_name="memwal")


def test_cli_flush_is_drain_with_a_warning(table):
    table.write(basic_rows([1, 2]))
    table.close(flush=False)  # acknowledged, not flushed
    old = _cli("flush", table.uri)
    assert old.exit_code == 0, old.output
    assert "memwal flush is deprecated" in old.stderr and "memwal drain" in old.stderr
    assert "1 region(s) flushed" in old.stdout
    new = _cli("drain", table.uri)
    assert new.exit_code == 0 and "deprecated" not in new.stderr
    assert "0 region(s) flushed" in new.stdout


def test_cli_deprecated_options_warn(tmp_path, base_uri):
    ds = lance.dataset(base_uri)
    ds.create_scalar_index("val", "BTREE", name="val_idx")
    old = _cli("init", base_uri, "--primary-key", "id", "--maintain", "val_idx")
    assert old.exit_code == 0, old.output
    assert "--maintain is deprecated" in old.stderr and "--maintained-indexes" in old.stderr
    assert mq.MemWalTable.open(base_uri).catalog.maintained_indexes == ["val_idx"]

    rows = tmp_path / "rows.parquet"
    import pyarrow.parquet as pq

    pq.write_table(basic_rows([1, 2, 3]), rows)
    ingest = _cli("ingest", base_uri, str(rows), "--batch-rows", "2")
    assert ingest.exit_code == 0, ingest.output
    assert "--batch-rows is deprecated" in ingest.stderr and "--buffer-rows" in ingest.stderr

    gc = _cli("gc", base_uri, "--dry-run", "--cleanup-older-than", "24")
    assert gc.exit_code == 0, gc.output
    assert "a bare number of hours for --cleanup-older-than is deprecated" in gc.stderr
    assert "24h" in gc.stderr
    gc = _cli("gc", base_uri, "--dry-run", "--cleanup-older-than", "24h")
    assert gc.exit_code == 0 and "deprecated" not in gc.stderr

    m = _cli("maintain", base_uri, "--dry-run", "--retention-hours", "2")
    assert m.exit_code == 0, m.output
    assert "--retention-hours is deprecated" in m.stderr and "--retention" in m.stderr
    m = _cli("maintain", base_uri, "--dry-run", "--retention", "2h")
    assert m.exit_code == 0 and "deprecated" not in m.stderr
    bad = _cli("maintain", base_uri, "--dry-run", "--retention", "2 hours")
    assert bad.exit_code != 0 and "not a duration" in bad.output


def test_cli_abandoned_after_is_a_duration(table):
    # a writer process that acknowledged a put and died without flushing
    code = (
        "import os, sys\n"
        "import memwal_query as mq\n"
        "from helpers import basic_rows\n"
        "mq.MemWalTable.open(sys.argv[1]).write(basic_rows([7]))\n"
        "os._exit(0)\n"
    )
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(API_DOC.parent.parent), tests])}
    subprocess.run([sys.executable, "-c", code, table.uri], env=env, check=True, timeout=120)
    kept = _cli("maintain", table.uri, "--json")  # the default, 5m: its writer may be alive
    assert kept.exit_code == 0 and json.loads(kept.stdout)["recovered"] == [], kept.output
    assert "[default: 5m]" in _cli("maintain", "--help").stdout
    bare = _cli("maintain", table.uri, "--dry-run", "--abandoned-after", "0")
    assert bare.exit_code == 0, bare.output
    assert "a bare number of seconds for --abandoned-after is deprecated; write 0s" in bare.stderr
    done = _cli("maintain", table.uri, "--json", "--abandoned-after", "0s")
    assert done.exit_code == 0 and "deprecated" not in done.stderr, done.output
    assert json.loads(done.stdout)["recovered"] != []
    assert table.lookup([7])["id"].to_pylist() == [7]


def test_durations():
    from memwal_query.cli.options import format_duration, parse_duration

    assert parse_duration("90s") == dt.timedelta(seconds=90)
    assert parse_duration("1h30m") == dt.timedelta(minutes=90)
    assert parse_duration("7d") == dt.timedelta(days=7)
    assert format_duration(dt.timedelta(hours=1)) == "1h"
    for bad in ("", "5", "h", "1x", "1h 30m"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_policy_thresholds_deprecated_spellings_warn():
    from memwal_query.maintain.policy import MaintenancePolicy

    with _warns("MaintenancePolicy.merge_over_generations"):
        p = MaintenancePolicy(max_generations=2)
    with _warns("MaintenancePolicy.merge_over_rows"):
        q = MaintenancePolicy(max_rows=7)
    assert (p.merge_over_generations, q.merge_over_rows) == (2, 7)
    with _warns("MaintenancePolicy.merge_over_generations"):
        assert p.max_generations == 2
    with _warns("MaintenancePolicy.merge_over_rows"):
        assert q.max_rows == 7


def test_cli_maintain_threshold_spellings(table):
    old = _cli("maintain", table.uri, "--dry-run", "--max-generations", "0", "--max-rows", "0")
    assert old.exit_code == 0, old.output
    assert "--max-generations is deprecated" in old.stderr
    assert "--merge-over-generations" in old.stderr and "--merge-over-rows" in old.stderr
    new = _cli("maintain", table.uri, "--dry-run", "--merge-over-generations", "0")
    assert new.exit_code == 0 and "deprecated" not in new.stderr


def test_spark_read_checks_take_both_spellings(table):
    pytest.importorskip("pyspark")
    from memwal_query.spark.source import check_read

    for name in ("rows_per_split", "rowsPerSplit"):
        with pytest.raises(mq.MemWalError, match=f"option {name}='0'"):
            check_read(table.uri, {name: "0"})
    for name in ("push_filters", "pushFilters"):
        with pytest.raises(mq.MemWalError, match=f"option {name}='x'"):
            check_read(table.uri, {name: "x"})
    check_read(table.uri, {"rows_per_split": "5", "push_filters": "true"})


def test_spark_read_columns_must_name_columns_once(table):
    """``columns`` naming no column (a blank or a lone comma) or one twice is an error
    naming the option; it read no column, then counted 0 rows."""
    pytest.importorskip("pyspark")
    from memwal_query.spark.source import check_read

    for blank in (" ", ",", "", " , "):
        with pytest.raises(mq.SchemaError, match="names no column"):
            check_read(table.uri, {"columns": blank})
    with pytest.raises(mq.SchemaError, match=r"\['id'\] more than once"):
        check_read(table.uri, {"columns": "id, id"})
    _, schema = check_read(table.uri, {"columns": " id "})
    assert schema.names == ["id"]
