import pytest

from memwal_query.exceptions import InvalidPathError
from memwal_query.format.naming import (
    bit_reversed,
    from_bit_reversed,
    manifest_name,
    wal_entry_name,
)


def test_spec_example_position_5():
    assert bit_reversed(5) == "101" + "0" * 61
    assert wal_entry_name(5) == "101" + "0" * 61 + ".arrow"
    assert manifest_name(5) == "101" + "0" * 61 + ".binpb"


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 1000, 2**32 + 7, 2**63, 2**64 - 1])
def test_round_trip(n):
    name = bit_reversed(n)
    assert len(name) == 64
    assert from_bit_reversed(name) == n
    assert from_bit_reversed(wal_entry_name(n)) == n
    assert from_bit_reversed("some/dir/" + manifest_name(n)) == n


def test_consecutive_names_differ_in_first_bits():
    # The point of bit reversal: sequential positions spread over the key space.
    firsts = {wal_entry_name(i)[:3] for i in range(1, 9)}
    assert len(firsts) == 8


@pytest.mark.parametrize("bad", ["", "0101", "2" * 64, "1" * 65, "x" * 64 + ".arrow"])
def test_bad_names_rejected(bad):
    with pytest.raises(InvalidPathError):
        from_bit_reversed(bad)


@pytest.mark.parametrize("n", [-1, 2**64])
def test_out_of_range(n):
    with pytest.raises(InvalidPathError):
        bit_reversed(n)
