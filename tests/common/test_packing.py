import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.packing import (pack_float32, pack_int32, pack_strings, pack_uint8,
                                     unpack_float32, unpack_int32, unpack_strings, unpack_uint8)


@settings(max_examples=200, derandomize=True)
@given(st.lists(st.text()))
def test_string_lists_round_trip(items: list[str]) -> None:
    assert unpack_strings(pack_strings(items)) == items


def test_empty_string_list_is_empty_bytes_compatible() -> None:
    assert unpack_strings(b"") == []
    assert unpack_strings(pack_strings([])) == []


def test_numeric_arrays_round_trip() -> None:
    assert unpack_int32(pack_int32([1, -2, 2**31 - 1])).tolist() == [1, -2, 2**31 - 1]
    assert unpack_uint8(pack_uint8([0, 4, 255])).tolist() == [0, 4, 255]
    np.testing.assert_array_equal(unpack_float32(pack_float32([0.5, -1.25])), [0.5, -1.25])
    assert pack_int32([]) == b""
