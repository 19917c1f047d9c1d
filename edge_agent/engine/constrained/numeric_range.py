"""Numbers within bounds, as grammar: exact for integers, never too wide for decimals.

An integer range is written digit by digit (`[1-9] [0-9]` and the like), matching exactly
the decimal integers in it. A number range is the integers in it, plus decimals `n.ddd`
whose whole unit interval lies inside the bounds (or, at an exclusive bound that is an
integer, those whose fraction ends in a non-zero digit, so never equal to it). That leaves
out some valid values near a fractional bound (with `minimum: 0.5`, the grammar starts at
1) but admits no value outside: a model may be kept from a valid number, never handed an
invalid one. Exponents are not written in a bounded number.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

INT_CAP = 10**15 - 1  # the converter's own integers are at most 16 digits
_FRACTION_DIGITS = 14


@dataclass(frozen=True)
class Bounds:
    """`minimum`/`maximum` with their exclusive forms folded in."""

    lo: float
    lo_open: bool
    hi: float
    hi_open: bool

    @staticmethod
    def of(schema: dict[str, object]) -> Bounds:
        lo, lo_open, hi, hi_open = -math.inf, False, math.inf, False
        for key, open_ in (("minimum", False), ("exclusiveMinimum", True)):
            value = schema.get(key)
            if isinstance(value, (int, float)) and (value > lo or (value == lo and open_)):
                lo, lo_open = value, open_
        for key, open_ in (("maximum", False), ("exclusiveMaximum", True)):
            value = schema.get(key)
            if isinstance(value, (int, float)) and (value < hi or (value == hi and open_)):
                hi, hi_open = value, open_
        return Bounds(lo, lo_open, hi, hi_open)

    def integers(self) -> tuple[int, int]:
        """The integers inside, capped to the converter's widest integers."""
        lo = math.floor(self.lo) + 1 if self.lo_open and float(self.lo).is_integer() \
            else math.ceil(self.lo) if math.isfinite(self.lo) else -INT_CAP
        hi = math.ceil(self.hi) - 1 if self.hi_open and float(self.hi).is_integer() \
            else math.floor(self.hi) if math.isfinite(self.hi) else INT_CAP
        return max(lo, -INT_CAP), min(hi, INT_CAP)


def int_range(lo: int, hi: int) -> str:
    """A GBNF alternation matching exactly the decimal integers in [lo, hi]."""
    alts: list[str] = []
    if lo < 0:
        neg_hi = -lo
        neg_lo = max(1, -hi)
        if neg_lo <= neg_hi:
            alts += [f'"-" {p}' for p in _natural_range(neg_lo, neg_hi)]
    if hi >= 0:
        alts += _natural_range(max(0, lo), hi)
    return " | ".join(alts)


def number_range(bounds: Bounds, fraction: str, nonzero_fraction: str) -> str:
    """A GBNF alternation of numbers inside `bounds`, or "" when it finds none.
    `fraction` and `nonzero_fraction` name rules for the digits after the point (any; ending
    in a non-zero digit)."""
    lo_int, hi_int = bounds.integers()
    alts = [int_range(lo_int, hi_int)] if lo_int <= hi_int else []
    # Non-negative n.ddd lies in [n, n+1): every fraction fits when lo <= n and n + 1 <= hi.
    first = max(0, math.ceil(bounds.lo)) if math.isfinite(bounds.lo) else 0
    last = min(math.floor(bounds.hi) - 1 if math.isfinite(bounds.hi) else INT_CAP, INT_CAP)
    if bounds.lo_open and first == bounds.lo:
        if first <= last:  # n == lo: only a fraction above zero
            alts.append(f'{int_range(first, first)} "." {nonzero_fraction}')
        first += 1
    if first <= last:
        alts.append(f'({int_range(first, last)}) "." {fraction}')
    # Negative -n.ddd lies in (-(n+1), -n]: every fraction fits when -(n+1) >= lo, -n <= hi.
    first = max(0, math.ceil(-bounds.hi)) if math.isfinite(bounds.hi) else 0
    last = min(math.floor(-bounds.lo) - 1 if math.isfinite(bounds.lo) else INT_CAP, INT_CAP)
    if bounds.hi_open and first == -bounds.hi:
        if first <= last:
            alts.append(f'"-" {int_range(first, first)} "." {nonzero_fraction}')
        first += 1
    if first <= last:
        alts.append(f'"-" ({int_range(first, last)}) "." {fraction}')
    return " | ".join(f"({a})" for a in alts)


FRACTION_RULE = "[0-9] " * 1 + "[0-9]? " * _FRACTION_DIGITS
NONZERO_FRACTION_RULE = "[0-9]? " * _FRACTION_DIGITS + "[1-9]"


def _natural_range(lo: int, hi: int) -> list[str]:
    out = []
    for width in range(len(str(lo)), len(str(hi)) + 1):
        a = max(lo, 10 ** (width - 1) if width > 1 else 0)
        b = min(hi, 10**width - 1)
        if a <= b:
            out += [" ".join(p) for p in _fixed(str(a), str(b))]
    return out


def _digit(a: int, b: int) -> str:
    return json.dumps(str(a)) if a == b else f"[{a}-{b}]"


def _fixed(a: str, b: str) -> list[list[str]]:
    """Patterns for the same-width digit strings from a to b (leading zeros allowed)."""
    if not a:
        return [[]]
    if a[0] == b[0]:
        return [[json.dumps(a[0]), *p] for p in _fixed(a[1:], b[1:])]
    n = len(a) - 1
    lo_d, hi_d = int(a[0]), int(b[0])
    out: list[list[str]] = []
    tail: list[list[str]] = []
    full_lo, full_hi = lo_d, hi_d
    if a[1:] != "0" * n:
        out += [[json.dumps(a[0]), *p] for p in _fixed(a[1:], "9" * n)]
        full_lo = lo_d + 1
    if b[1:] != "9" * n:
        tail = [[json.dumps(b[0]), *p] for p in _fixed("0" * n, b[1:])]
        full_hi = hi_d - 1
    if full_lo <= full_hi:
        out.append([_digit(full_lo, full_hi), *(["[0-9]"] * n)])
    return out + tail
