"""A bounded repetition in O(log n) grammar rules, for the counts real schemas write.

llama.cpp's converter writes `x{0,n}` as n nested optional groups: one live parse at a
time, but some 8 bytes of grammar per unit, so a string of `maxLength: 4096` alone is
32 KB, and the Snowplow schemas that hold a dozen such strings of different bounds did not
fit any sane grammar limit. Here a count is written in binary instead:

- `E(j)`, exactly 2**j units: `E(j-1) E(j-1)`, one parse;
- `A(j)`, 0 to 2**j - 1 units: `E(j-1)? A(j-1)`, the bits of the length from the top;
- `U(d)`, 0 to d units: `A(k) | E(k) U(d - 2**k)` with 2**k the top bit of d.

Every text has exactly one parse, and after any prefix at most one parse per bit is still
alive (the one whose current block the prefix ends in), so llama.cpp's sampler follows
O(log n) stacks. Counts up to `NESTED_UP_TO` keep the nested form, whose single stack is
the cheapest to follow. The rules are named after the unit and the count, so every string
of the same bound in a grammar shares them.
"""

from __future__ import annotations

from collections.abc import Callable

NESTED_UP_TO = 32

AddRule = Callable[[str, str], str]


def repeat(unit: str, lo: int, hi: int | None, *, add: AddRule, name: str) -> str:
    """Grammar text for `lo` to `hi` copies of `unit` (hi None: no upper bound).

    `unit` is a rule name or a parenthesised group; `add(name, body)` adds a rule and
    returns its key; `name` prefixes the rules added (the same unit, the same name)."""
    parts = [_exactly(unit, lo, add, name)] if lo else []
    if hi is None:
        parts.append(f"{unit}*")
    elif hi > lo:
        parts.append(_up_to(unit, hi - lo, add, name))
    return " ".join(p for p in parts if p)


def _exactly(unit: str, n: int, add: AddRule, name: str) -> str:
    if n <= NESTED_UP_TO:
        return " ".join([unit] * n)
    return " ".join(_block(unit, j, add, name) for j in reversed(range(n.bit_length()))
                    if n >> j & 1)


def _block(unit: str, j: int, add: AddRule, name: str) -> str:
    """E(j): exactly 2**j units."""
    if j == 0:
        return unit
    half = _block(unit, j - 1, add, name)
    return add(f"{name}-e{j}", f"{half} {half}")


def _below(unit: str, j: int, add: AddRule, name: str) -> str:
    """A(j): 0 to 2**j - 1 units."""
    if (1 << j) - 1 <= NESTED_UP_TO:
        return add(f"{name}-a{j}", _nested(unit, (1 << j) - 1))
    return add(f"{name}-a{j}",
               f"{_block(unit, j - 1, add, name)}? {_below(unit, j - 1, add, name)}")


def _up_to(unit: str, d: int, add: AddRule, name: str) -> str:
    """U(d): 0 to d units."""
    if d <= NESTED_UP_TO:
        return _nested(unit, d)
    k = d.bit_length() - 1
    rest = d - (1 << k)
    longer = _block(unit, k, add, name)
    if rest:
        longer += " " + _up_to(unit, rest, add, name)
    return add(f"{name}-u{d}", f"{_below(unit, k, add, name)} | {longer}")


def _nested(unit: str, d: int) -> str:
    """0 to d units as nested optional groups (llama.cpp's own form)."""
    return (f"({unit} " * d).rstrip() + ")?" * d
