"""The checked-in protobuf code matches ``protos/``, and the field numbers match the spec."""

from __future__ import annotations

import shutil

import pytest

from memwal_query import protogen
from memwal_query._proto import memwal_pb2 as pb

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
