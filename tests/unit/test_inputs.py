"""laminar.inputs: numbers and sizes read in linear time, within bounds, with errors that name
the value (cut) and the range; never an OverflowError or a ValueError of int()."""

from __future__ import annotations

import time

import pytest

from laminar.inputs import NUMBER_TEXT_MAX, InputError, brief, read_int, read_number, read_text, size_mib


@pytest.mark.parametrize("text,mib", [
    ("512", 512), ("512M", 512), ("2G", 2048), ("2g", 2048), ("1.5G", 1536), ("4 GiB", 4096), ("512MB", 512),
    (" 1T ", 1 << 20), ("2048K", 2), ("1K", 0), ("7.000001M", 7), ("512b", 512), ("3Gi", 3072),
])
def test_sizes_read_as_before(text: str, mib: int) -> None:
    assert size_mib(text) == mib


@pytest.mark.parametrize("text", [
    "", "G", "1.G", ".5G", "1..5G", "1 G iB", "1e3", "-1G", "1x", "²", "١٢", "1" * 16, "1." + "1" * 7,
    "1" + " " * 40 + "x",
])
def test_what_is_not_a_size(text: str) -> None:
    assert size_mib(text) is None


def test_a_size_is_read_in_linear_time_whatever_its_length() -> None:
    """The old regex backtracked over the spaces: 4.8 s at 16 KB, quadratic. Now the length is
    checked first; a 1 MiB text is refused at once (bound: a liveness bound, far above)."""
    t0 = time.monotonic()
    for text in ("1" + " " * (1 << 20) + "x", " " * (1 << 20) + "1" + " " * (1 << 20) + "x", "9" * (1 << 20)):
        assert size_mib(text) is None
    assert time.monotonic() - t0 < 1.0


def test_read_int_bounds_and_ascii() -> None:
    assert read_int(5, "n", 0, 10) == 5
    assert read_int(" 7 ", "n", 0, 10) == 7
    assert read_int("-3", "n", -5, 5) == -3
    for bad in ("²", "1" * 5000, 10 ** 400, True, 1.5, None, [], "1e3", "--1"):
        with pytest.raises(InputError) as e:
            read_int(bad, "count", 0, 10)
        assert "count" in str(e.value) and len(str(e.value)) < 200, str(e.value)
    with pytest.raises(InputError, match="out of range 0..10"):
        read_int(11, "n", 0, 10)


def test_read_number_refuses_inf_nan_and_huge() -> None:
    assert read_number(0.5, "x", 0, 1) == 0.5
    for bad in (float("inf"), float("nan"), 10 ** 400, "1", True, None):
        with pytest.raises(InputError) as e:
            read_number(bad, "load", 0, 1)
        assert "load" in str(e.value) and len(str(e.value)) < 200


def test_read_text_and_brief() -> None:
    assert read_text("abc", "pool", 32) == "abc"
    for bad in ("", "x" * 33, [], {}, 3):
        with pytest.raises(InputError):
            read_text(bad, "pool", 32)
    assert len(brief("x" * (1 << 20))) < 120 and "1048576 characters" in brief("x" * (1 << 20))
    assert "bits" in brief(10 ** 400) and brief(12) == "12"
    assert "items" in brief(list(range(10 ** 5)))
    assert NUMBER_TEXT_MAX >= len("1099511627776")
