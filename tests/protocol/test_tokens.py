import numpy as np
import pybase64
import pytest

from splitserve.errors import InvalidRequestError, PlaceholderReadError
from splitserve.tokens import PromptTokens


def test_array_is_int32_readonly_and_zero_copy():
    src = np.arange(10, dtype="<i4")
    t = PromptTokens(src)
    assert t.array.dtype == np.dtype("<i4") and len(t) == 10
    assert np.shares_memory(t.array, src)
    with pytest.raises(ValueError):
        t.array[0] = 5


def test_list_is_built_once_and_only_on_demand():
    t = PromptTokens(np.arange(5, dtype=np.int32))
    assert t._list is None
    first = t.tolist()
    assert first == [0, 1, 2, 3, 4] and t.tolist() is first


def test_b64_round_trip_is_little_endian_int32():
    t = PromptTokens.from_list([1, 2, 70000, 49151])
    raw = pybase64.b64decode(t.b64())
    assert raw == np.array([1, 2, 70000, 49151], dtype="<i4").tobytes()
    assert PromptTokens.from_b64(t.b64()) == t


@pytest.mark.parametrize("bad", ["not base64!!", "AAAAAA=", "AAA"])
def test_bad_b64_is_a_clear_error(bad):
    with pytest.raises(InvalidRequestError) as err:
        PromptTokens.from_b64(bad)
    assert err.value.param.startswith("prompt_token_ids")


def test_length_not_multiple_of_four():
    with pytest.raises(InvalidRequestError, match="multiple of 4"):
        PromptTokens.from_b64(pybase64.b64encode(b"\x01\x02\x03\x04\x05\x06").decode())


def test_placeholder_knows_its_length_and_raises_on_read():
    p = PromptTokens.placeholder(7)
    assert len(p) == 7 and p.is_placeholder
    for read in (lambda: p.array, p.tolist, p.b64, p.tobytes):
        with pytest.raises(PlaceholderReadError):
            read()
    with pytest.raises(InvalidRequestError):
        PromptTokens.placeholder(-1)
