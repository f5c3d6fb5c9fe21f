"""The checked-in protobuf code matches ``protos/``, and the field numbers match the spec."""

from __future__ import annotations

import shutil

import pytest

from memwal_query import protogen
from memwal_query.format._proto import memwal_pb2 as pb

pytest.importorskip("grpc_tools")


def test_checked_in_code_is_up_to_date():
    assert protogen.stale_files() == [], "run: python -m memwal_query.protogen"


def test_a_changed_proto_is_detected_as_stale(tmp_path):
    """The staleness check can fail: renumber one field in a copy of ``protos/``."""
    for name in protogen.PROTO_FILES:
        shutil.copy(protogen.PROTO_DIR / name, tmp_path / name)
    src = (tmp_path / "memwal.proto").read_text()
    changed = src.replace("uint64 current_generation = 6;", "uint64 current_generation = 16;")
    assert changed != src
    (tmp_path / "memwal.proto").write_text(changed)
    assert protogen.stale_files(tmp_path) == ["memwal.proto"]


def _numbers(message) -> dict[str, int]:
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def test_region_manifest_field_numbers_are_the_spec_s():
    numbers = _numbers(pb.RegionManifest)
    spec = {
        "version": 1,
        "writer_epoch": 2,
        "replay_after_wal_entry_position": 3,
        "wal_entry_position_last_seen": 4,
        "current_generation": 6,
        "flushed_generations": 8,
        "region_spec_id": 10,
        "region_id": 11,
    }
    assert {k: numbers[k] for k in spec} == spec
    assert 7 not in numbers.values()  # removed: merged_generation lives in the index


def test_memwal_index_details_field_numbers_are_the_spec_s():
    numbers = _numbers(pb.MemWalIndexDetails)
    spec = {
        "snapshot_ts_millis": 1,
        "num_regions": 2,
        "inline_snapshots": 3,
        "region_specs": 7,
        "maintained_indexes": 8,
        "merged_generations": 9,
        "index_catchup": 10,
    }
    assert {k: numbers[k] for k in spec} == spec


def test_native_writer_manifests_decode_fully_and_byte_exactly(tmp_path):
    """Region manifests written by pylance's own MemWAL writer: every field (including
    ``FlushedGeneration``'s statistics) is known to our schema, and re-encoding them
    through :class:`RegionManifest` gives back the very same bytes."""
    import uuid

    import lance
    import pyarrow as pa
    from google.protobuf.unknown_fields import UnknownFieldSet

    from memwal_query.format.manifest import RegionManifest, RegionManifestStore
    from memwal_query.storage.io import LocalFileIO

    pk = {"lance-schema:unenforced-primary-key": "true"}
    schema = pa.schema([pa.field("id", pa.int64(), False, pk), pa.field("v", pa.float64())])
    uri = str(tmp_path / "t")
    lance.write_dataset(pa.table({"id": [0], "v": [0.0]}, schema=schema), uri)
    ds = lance.dataset(uri)
    ds.initialize_mem_wal()
    shard = str(uuid.uuid4())
    with ds.mem_wal_writer(shard, max_memtable_rows=3) as w:
        for i in range(3):
            w.put(pa.table({"id": [3 * i, 3 * i + 1, 3 * i + 2], "v": [1.0] * 3}, schema=schema))
    store = RegionManifestStore(LocalFileIO(), uri, shard)
    latest = store.latest_version()
    assert latest >= 2
    for version in range(1, latest + 1):
        raw = LocalFileIO().read(store.path(version))
        msg = pb.RegionManifest.FromString(raw)
        assert len(UnknownFieldSet(msg)) == 0
        for g in msg.flushed_generations:
            assert len(UnknownFieldSet(g)) == 0
        manifest = RegionManifest.from_proto(msg)
        assert manifest.to_bytes() == raw
    gens = store.load(latest).flushed_generations
    assert [g.generation for g in gens] == [1, 2, 3]
    for g in gens:  # the native writer's statistics, decoded
        assert (g.physical_rows, g.primary_key_bytes) == (3, 24)
        assert g.in_memory_bytes and g.in_memory_bytes > 0
