"""Reading what a caller sends: numbers and sizes, in linear time, within stated bounds.

Every request field the agent reads as a number goes through here (or checks as much itself):
a local user chooses these values, and the agent reads them on its one event loop. So:

- text is measured before it is parsed: a number is at most `NUMBER_TEXT_MAX` characters (no
  unit of this agent needs more), so nothing is parsed whose length the caller chose;
- nothing backtracks: the text is split with ``str`` methods, never with a regex that can try
  every split of a run of spaces (the old memory-size regex took 4.8 s for 16 KB, quadratic);
- only ASCII digits count as digits (``"²".isdigit()`` is true, and ``int("²")`` fails);
- a number out of range is an `InputError` (a ValueError) that names the value, cut to a few
  dozen characters, and the range allowed, never an OverflowError (``int(1e400)``) or a
  "cannot convert" that the API would answer 500.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

# The longest text read as a number or a size ("1099511627776", "1.5G", " 512 MiB ").
NUMBER_TEXT_MAX = 32
# A value quoted in an error is cut to this many characters.
BRIEF_MAX = 60


class InputError(ValueError):
    """A value a caller sent is not what the field takes; the message names the value (cut to
    `BRIEF_MAX` characters) and what is allowed."""


def brief(value: Any, limit: int = BRIEF_MAX) -> str:
    """``repr(value)`` cut to `limit` characters, saying how long it was: an error names a huge
    value without quoting it whole (nor building its whole repr: a 10**400 int or a 1 MiB
    string is cut before it is formatted)."""
    if isinstance(value, str):
        text = repr(value[:limit + 1])
        return text if len(value) <= limit else f"{text[:limit]}... ({len(value)} characters)"
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() <= 200:
            return repr(value)
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, (list, tuple, dict)):
        text = repr(value) if len(value) <= 8 else f"{type(value).__name__} of {len(value)} items"
        return text if len(text) <= limit else f"{text[:limit]}... ({len(value)} items)"
    return f"a {type(value).__name__}"


def _digits(text: str) -> bool:
    return bool(text) and text.isascii() and text.isdigit()


def read_int(value: Any, what: str, lo: int, hi: int) -> int:
    """An integer lo..hi: a JSON integer, or text of ASCII digits (with a leading '-' where lo
    is negative). InputError naming the value and the range otherwise (a bool, a float, "²",
    400 digits)."""
    if isinstance(value, bool):
        raise InputError(f"{what} {brief(value)}: expected an integer {lo}..{hi}")
    if isinstance(value, str):
        text = value.strip()
        neg = text.startswith("-")
        body = text[1:] if neg else text
        if len(text) > NUMBER_TEXT_MAX or not _digits(body):
            raise InputError(f"{what} {brief(value)}: expected an integer {lo}..{hi}")
        value = -int(body) if neg else int(body)
    if not isinstance(value, int):
        raise InputError(f"{what} {brief(value)}: expected an integer {lo}..{hi}")
    if not lo <= value <= hi:
        raise InputError(f"{what} {brief(value)}: out of range {lo}..{hi}")
    return value


def read_number(value: Any, what: str, lo: float, hi: float) -> float:
    """A finite number lo..hi (a JSON integer or float; JSON's 1e400 reads as inf, refused).
    InputError naming the value and the range otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{what} {brief(value)}: expected a number {lo:g}..{hi:g}")
    if isinstance(value, int) and value.bit_length() > 64:
        raise InputError(f"{what} {brief(value)}: out of range {lo:g}..{hi:g}")
    f = float(value)
    if not math.isfinite(f) or not lo <= f <= hi:
        raise InputError(f"{what} {brief(value)}: out of range {lo:g}..{hi:g}")
    return f


def read_text(value: Any, what: str, most: int, *, empty: bool = False) -> str:
    """A string of at most `most` characters (and not empty unless `empty`)."""
    if not isinstance(value, str) or len(value) > most or (not value and not empty):
        raise InputError(f"{what} {brief(value)}: expected text of {0 if empty else 1}..{most} characters")
    return value


# Size units: MiB per unit (sizes are read in MiB; K rounds down, so 1K is 0 MiB).
_UNITS = {"": Fraction(1), "K": Fraction(1, 1024), "M": Fraction(1), "G": Fraction(1024), "T": Fraction(1024 ** 2)}


def size_mib(text: str) -> int | None:
    """'512M', '2G', '1.5G', '2048' (MiB), '4 GiB', '512MB' -> MiB (rounded down); None when the
    text is not such a size. Linear in the text, which must be at most NUMBER_TEXT_MAX
    characters (the caller says so in its error): at most 15 integer and 6 fractional digits."""
    if len(text) > NUMBER_TEXT_MAX:
        return None
    s = text.strip()
    if s[-1:] in ("b", "B"):
        s = s[:-1]
    if s[-1:] in ("i", "I"):
        s = s[:-1]
    unit = s[-1:].upper() if s[-1:].upper() in ("K", "M", "G", "T") else ""
    if unit:
        s = s[:-1]
    s = s.rstrip()
    whole, dot, frac = s.partition(".")
    if not _digits(whole) or len(whole) > 15 or (dot and (not _digits(frac) or len(frac) > 6)):
        return None
    return int(Fraction(s) * _UNITS[unit])
