import uuid

import pyarrow as pa
import pytest

from memwal_query.exceptions import FencedError, WalCorruptError
from memwal_query.format.schema import with_tombstone
from memwal_query.format.wal import Wal, decode_entry, encode_entry
from memwal_query.storage.io import LocalFileIO


def rows(ids):
    return with_tombstone(pa.table({"id": pa.array(ids, pa.int64())}), False)


@pytest.fixture
def wal(tmp_path):
    return Wal(LocalFileIO(), str(tmp_path / "wal"), str(uuid.uuid4()))


def test_append_and_replay_in_order(wal):
    for pos in range(1, 6):
        wal.append(pos, rows([pos * 10, pos * 10 + 1]), writer_epoch=1, generation=1)
    entries = list(wal.replay(after=2, current_epoch=1))
    assert [e.position for e in entries] == [3, 4, 5]
    assert entries[0].table.column("id").to_pylist() == [30, 31]
    assert entries[0].writer_epoch == 1 and entries[0].generation == 1
    assert wal.last_position() == 5


def test_replay_across_two_writers_epochs(wal):
    wal.append(1, rows([1]), writer_epoch=6, generation=1)
    wal.append(2, rows([2]), writer_epoch=6, generation=1)
    wal.append(3, rows([3]), writer_epoch=7, generation=1)
    entries = list(wal.replay(after=0, current_epoch=7))
    assert [e.writer_epoch for e in entries] == [6, 6, 7]
    # A writer with epoch 6 replaying finds a newer writer's entry: it is fenced.
    with pytest.raises(FencedError):
        list(wal.replay(after=0, current_epoch=6))


def test_position_taken_means_fenced(wal):
    wal.append(1, rows([1]), writer_epoch=1, generation=1)
    with pytest.raises(FencedError):
        wal.append(1, rows([2]), writer_epoch=2, generation=1)
    assert wal.read(1).table.column("id").to_pylist() == [1]


def test_truncated_entry_every_byte_of_last_64(wal):
    wal.append(1, rows(list(range(50))), writer_epoch=1, generation=1)
    path = wal.path(1)
    io = LocalFileIO()
    data = io.read(path)
    for cut in range(1, 65):
        io.write(path, data[:-cut])
        with pytest.raises(WalCorruptError) as e:
            list(wal.replay(after=0, current_epoch=1))
        assert path in str(e.value)
    io.write(path, data)
    assert len(list(wal.replay(after=0, current_epoch=1))) == 1


def test_garbage_entry(wal):
    LocalFileIO().write(wal.path(1), b"garbage" * 10 + b"\xff\xff\xff\xff\x00\x00\x00\x00")
    with pytest.raises(WalCorruptError):
        wal.read(1)


def test_native_entry_format_is_read(tmp_path):
    """An entry as pylance writes it (no num_rows key) replays."""
    schema = pa.schema(
        [pa.field("id", pa.int64()), pa.field("_tombstone", pa.bool_(), nullable=False)],
        metadata={"writer_epoch": "3", "generation": "2"},
    )
    t = pa.table({"id": [5], "_tombstone": [True]}, schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as w:
        w.write_table(t)
    w = Wal(LocalFileIO(), str(tmp_path), str(uuid.uuid4()))
    LocalFileIO().write(w.path(1), sink.getvalue().to_pybytes())
    (entry,) = list(w.replay(0, 3))
    assert (entry.writer_epoch, entry.generation) == (3, 2)
    assert entry.table.column("_tombstone").to_pylist() == [True]


def _reencode_with_metadata(data: bytes, key: bytes, value: bytes) -> bytes:
    """The entry re-written with one metadata value changed and no checksum (as an entry
    of pylance's native writer, which writes none)."""
    t = pa.ipc.open_stream(data).read_all()
    meta = {k: v for k, v in t.schema.metadata.items() if k != b"checksum"}
    t = t.replace_schema_metadata({**meta, key: value})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize(
    "key, value",
    [
        (b"generation", b"x"),
        (b"num_rows", b"1.5"),
        (b"num_rows", b"-1"),
        (b"writer_epoch", b""),
        (b"writer_epoch", b"\xff"),
    ],
)
def test_non_integer_metadata_is_a_typed_error(wal, key, value):
    data = _reencode_with_metadata(encode_entry(rows([1]), 1, 1), key, value)
    with pytest.raises(WalCorruptError) as e:
        decode_entry(wal.path(1), 1, data)
    assert wal.path(1) in str(e.value) and key.decode() in str(e.value)


def test_every_single_bit_flip_decodes_or_is_a_typed_error(wal):
    data = encode_entry(
        with_tombstone(
            pa.table({"id": pa.array([1, 2, 3], pa.int64()), "s": ["a", "bb", None]}), False
        ),
        1,
        1,
    )
    original = decode_entry("the/path", 1, data)
    outcomes = {"same": 0, "corrupt": 0}
    for i in range(len(data)):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[i] ^= 1 << bit
            try:
                entry = decode_entry("the/path", 1, bytes(damaged))
            except WalCorruptError as e:
                assert "the/path" in str(e)
                outcomes["corrupt"] += 1
                continue
            # Decoded despite the flip (padding, an unused flatbuffer byte): the
            # checksum guarantees the very same rows, schema and metadata.
            assert entry.table.equals(original.table, check_metadata=False)
            assert entry.table.schema.equals(original.table.schema, check_metadata=False)
            assert (entry.writer_epoch, entry.generation) == (1, 1)
            outcomes["same"] += 1
    assert outcomes["corrupt"] > outcomes["same"] > 0


def test_checksum_mismatch_names_the_file(wal):
    wal.append(1, rows([7, 8, 9]), writer_epoch=1, generation=1)
    data = bytearray(LocalFileIO().read(wal.path(1)))
    i = bytes(data).rindex((9).to_bytes(8, "little"))  # the value 9 in the id column
    data[i] ^= 0x02  # 9 -> 11: a well-formed entry with another key
    LocalFileIO().write(wal.path(1), bytes(data))
    with pytest.raises(WalCorruptError, match="checksum mismatch") as e:
        wal.read(1)
    assert wal.path(1) in str(e.value)


def test_gap_in_the_wal_is_refused(wal):
    for pos in range(1, 7):
        wal.append(pos, rows([pos]), writer_epoch=1, generation=1)
    LocalFileIO().delete(wal.path(3))
    with pytest.raises(WalCorruptError, match="entry 3 .* is missing") as e:
        list(wal.replay(after=0, current_epoch=1))
    assert wal.path(3) in str(e.value) and "--accept-loss" in str(e.value)
    # the entries before the hole were yielded first; nothing after it
    got = []
    with pytest.raises(WalCorruptError):
        for entry in wal.replay(after=0, current_epoch=1):
            got.append(entry.position)
    assert got == [1, 2]
    # the tail ending is not a gap
    assert [e.position for e in wal.replay(after=3, current_epoch=1)] == [4, 5, 6]


def _raw_entry(table: pa.Table, metadata: dict[bytes, bytes]) -> bytes:
    """An entry as a writer without checksums writes it (pylance's native format)."""
    table = table.replace_schema_metadata(metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def test_two_tombstone_columns_are_a_typed_error(wal):
    t = pa.table({"id": [1], "_tombstone": [False]})
    t = t.append_column(pa.field("_tombstone", pa.bool_()), pa.array([True]))
    with pytest.raises(WalCorruptError, match="_tombstone") as e:
        decode_entry(wal.path(1), 1, _raw_entry(t, {b"writer_epoch": b"1"}))
    assert wal.path(1) in str(e.value)


def test_a_null_in_a_non_nullable_column_of_an_entry_with_the_table_s_fields(wal):
    # The entry's schema equals the table's (no conversion), but its key column holds
    # a NULL (Arrow does not enforce nullability): a typed error naming the entry.
    from memwal_query.format.wal import conform_entry

    schema = pa.schema(
        [pa.field("id", pa.int64(), nullable=False), pa.field("_tombstone", pa.bool_(), False)]
    )
    t = pa.Table.from_arrays(
        [pa.array([1, None], pa.int64()), pa.array([False, False])], schema=schema
    )
    entry = decode_entry(wal.path(1), 1, _raw_entry(t, {b"writer_epoch": b"1"}))
    with pytest.raises(WalCorruptError, match="'id' holds 1 NULL") as e:
        conform_entry(wal.path(1), entry.table, schema, ["id"])
    assert wal.path(1) in str(e.value)
    ok = pa.Table.from_arrays(
        [pa.array([1, 2], pa.int64()), pa.array([False, True])], schema=schema
    )
    entry = decode_entry(wal.path(1), 1, _raw_entry(ok, {b"writer_epoch": b"1"}))
    got = conform_entry(wal.path(1), entry.table, schema, ["id"])
    assert got.schema.equals(schema, check_metadata=True) and got.equals(ok)
