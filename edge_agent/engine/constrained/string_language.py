"""The texts a JSON string may hold, as a deterministic automaton, written out as grammar.

A schema's `pattern`, `format`, `minLength`/`maxLength`, and an object's key rules
(`patternProperties`, names other than the listed properties) all say which texts a string
may hold. Each becomes a DFA over code points, and DFAs combine exactly (intersection,
complement), so a pattern beside a length, or the keys an additional property may take,
are one automaton — no approximation, no text admitted that the schema refuses.

A pattern is an ECMA-262 regular expression and, as JSON Schema says, a *search*: it
matches anywhere in the string unless anchored (`^a|b$` is `(^a)|(b)|(c$)`). The subset
read here is the one people write (classes, groups, alternatives, quantifiers, `\\d \\w \\s`
and their negations, anchors at the ends of top-level alternatives); anything else —
lookaround, backreferences, word boundaries, an anchor mid-pattern — raises ValueError,
which the converter turns into a 400 naming the pattern.

Written as grammar, a DFA is one rule per state, so llama.cpp follows exactly one parse of
the string whatever the pattern (the port's translation followed one per ambiguous way to
match, `(a?){30}` doubling them). Each character is written as JSON writes it: `"` as `\\"`,
`\\` as `\\\\`, control characters as their escapes, everything else raw; the closing quote
can never be emitted inside the body. Sizes are bounded (`MAX_DFA_STATES`); a pattern whose
automaton would exceed them is refused, never truncated.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass

MAX_NFA_STATES = 20_000
MAX_DFA_STATES = 2_000
_MINIMIZED = 64  # automata up to this size are minimized
_MAX_GROUP_DEPTH = 32
_TOP = 0x10FFFF

# A set of code points: sorted, disjoint, non-adjacent inclusive intervals.
Chars = tuple[tuple[int, int], ...]

ANY: Chars = ((0, 0xD7FF), (0xE000, _TOP))  # every scalar value (surrogates never occur)


def chars(*ranges: tuple[int, int]) -> Chars:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return intersect(tuple((a, b) for a, b in out), ANY) if out else ()


def union(a: Chars, b: Chars) -> Chars:
    return chars(*a, *b)


def intersect(a: Chars, b: Chars) -> Chars:
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def complement(a: Chars) -> Chars:
    out = []
    at = 0
    for lo, hi in a:
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= _TOP:
        out.append((at, _TOP))
    return intersect(tuple(out), ANY)


def _contains(a: Chars, c: int) -> bool:
    i = bisect.bisect_right(a, (c, _TOP + 1)) - 1
    return i >= 0 and a[i][0] <= c <= a[i][1]


_DIGIT = chars((0x30, 0x39))
_WORD = chars((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
# ECMA-262 WhiteSpace and LineTerminator.
_SPACE = chars((9, 13), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
               (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
               (0xFEFF, 0xFEFF))
_DOT = complement(chars((10, 10), (13, 13), (0x2028, 0x2029)))
_CLASS_ESCAPES = {"d": _DIGIT, "D": complement(_DIGIT), "w": _WORD, "W": complement(_WORD),
                  "s": _SPACE, "S": complement(_SPACE)}
_CHAR_ESCAPES = {"n": 10, "r": 13, "t": 9, "f": 12, "v": 11, "0": 0}


# -- a pattern's syntax tree ---------------------------------------------------------------

@dataclass(frozen=True)
class _Set:
    chars: Chars


@dataclass(frozen=True)
class _Seq:
    items: tuple[_Node, ...]


@dataclass(frozen=True)
class _Alt:
    alts: tuple[_Node, ...]


@dataclass(frozen=True)
class _Rep:
    node: _Node
    lo: int
    hi: int | None


@dataclass(frozen=True)
class _Anchor:
    start: bool


_Node = _Set | _Seq | _Alt | _Rep | _Anchor


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{what} (at offset {self.i} of the pattern) cannot be enforced")

    def peek(self) -> str:
        return self.p[self.i] if self.i < len(self.p) else ""

    def alternation(self, depth: int) -> _Node:
        if depth > _MAX_GROUP_DEPTH:
            raise ValueError(f"pattern groups nest deeper than {_MAX_GROUP_DEPTH}")
        alts = [self.sequence(depth)]
        while self.peek() == "|":
            self.i += 1
            alts.append(self.sequence(depth))
        return alts[0] if len(alts) == 1 else _Alt(tuple(alts))

    def sequence(self, depth: int) -> _Node:
        items: list[_Node] = []
        while self.i < len(self.p) and self.peek() not in "|)":
            items.append(self.quantified(self.atom(depth)))
        return items[0] if len(items) == 1 else _Seq(tuple(items))

    def atom(self, depth: int) -> _Node:
        c = self.p[self.i]
        self.i += 1
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?<", self.i) and self.p[self.i + 2: self.i + 3] not in "=!":
                end = self.p.find(">", self.i)
                if end < 0:
                    raise self.fail("an unclosed group name")
                self.i = end + 1
            elif self.peek() == "?":
                raise self.fail("lookaround")
            node = self.alternation(depth + 1)
            if self.peek() != ")":
                raise ValueError("the pattern has an unbalanced '('")
            self.i += 1
            return node
        if c == ")":
            raise ValueError("the pattern has an unbalanced ')'")
        if c == "[":
            return _Set(self.char_class())
        if c == ".":
            return _Set(_DOT)
        if c == "^":
            return _Anchor(True)
        if c == "$":
            return _Anchor(False)
        if c == "\\":
            return _Set(self.escape(in_class=False))
        if c in "*+?":
            raise self.fail(f"a quantifier '{c}' with nothing before it")
        if c == "{" and self.quantifier_at(self.i - 1):
            raise self.fail("a quantifier with nothing before it")
        return _Set(chars((ord(c), ord(c))))

    def quantifier_at(self, i: int) -> tuple[int, int | None, int] | None:
        """A `{m}`, `{m,}` or `{m,n}` at i: (m, n, end); ECMA reads any other '{' as text."""
        end = self.p.find("}", i)
        if end < 0:
            return None
        parts = self.p[i + 1:end].split(",")
        if len(parts) > 2 or not parts[0].isdigit() or \
                (len(parts) == 2 and parts[1] and not parts[1].isdigit()):
            return None
        lo = int(parts[0])
        hi = lo if len(parts) == 1 else (int(parts[1]) if parts[1] else None)
        return lo, hi, end + 1

    def quantified(self, node: _Node) -> _Node:
        while True:
            c = self.peek()
            if c in ("*", "+", "?") and c:
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and (q := self.quantifier_at(self.i)) is not None:
                lo, hi, self.i = q
                if hi is not None and hi < lo:
                    raise self.fail("a quantifier {m,n} with n < m")
            else:
                return node
            if isinstance(node, _Anchor):
                raise self.fail("a quantified anchor")
            if self.peek() == "?":
                self.i += 1  # lazy: the same language
            node = _Rep(node, lo, hi)

    def escape(self, *, in_class: bool) -> Chars:
        if self.i >= len(self.p):
            raise ValueError("the pattern ends with a lone backslash")
        c = self.p[self.i]
        self.i += 1
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c in _CHAR_ESCAPES:
            if c == "0" and self.peek().isdigit():
                raise self.fail("an octal escape")
            return chars((_CHAR_ESCAPES[c],) * 2)
        if c == "b" and in_class:
            return chars((8, 8))
        if c in ("x", "u"):
            if c == "u" and self.peek() == "{":
                end = self.p.find("}", self.i)
                digits = self.p[self.i + 1:end] if end > 0 else ""
                width = len(digits) + 2
            else:
                width = 2 if c == "x" else 4
                digits = self.p[self.i:self.i + width]
            try:
                code = int(digits, 16)
            except ValueError:
                raise self.fail(f"a malformed '\\{c}' escape") from None
            if code > _TOP:
                raise self.fail(f"a '\\{c}' escape past U+10FFFF")
            self.i += width
            return chars((code, code))
        if c.isalnum():  # \b \B \1 \k \p \c …: no regular language, or not ECMA's
            raise self.fail(f"the escape '\\{c}'")
        return chars((ord(c), ord(c)))

    def char_class(self) -> Chars:
        negated = self.peek() == "^"
        self.i += negated
        out: Chars = ()
        first = True
        while True:
            if self.i >= len(self.p):
                raise ValueError("the pattern has an unclosed '['")
            c = self.p[self.i]
            if c == "]" and not first:
                self.i += 1
                break
            if c == "]":  # ECMA: `[]` matches nothing, `[^]` anything
                self.i += 1
                return ANY if negated else ()
            first = False
            lo = self.class_atom()
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.class_atom()
                if len(lo) != 1 or lo[0][0] != lo[0][1] or len(hi) != 1 or hi[0][0] != hi[0][1]:
                    raise self.fail("a class range with a class at one end")
                if hi[0][0] < lo[0][0]:
                    raise self.fail("a class range out of order")
                out = union(out, chars((lo[0][0], hi[0][0])))
            else:
                out = union(out, lo)
        return complement(out) if negated else out

    def class_atom(self) -> Chars:
        c = self.p[self.i]
        self.i += 1
        if c == "\\":
            return self.escape(in_class=True)
        return chars((ord(c), ord(c)))


def _parse(pattern: str) -> _Node:
    parser = _Parser(pattern)
    node = parser.alternation(0)
    if parser.i != len(pattern):
        raise ValueError("the pattern has an unbalanced ')'")
    return node


def _unanchored(node: _Node) -> list[tuple[bool, _Node, bool]]:
    """The top-level alternatives as (anchored at start, body, anchored at end)."""
    out: list[tuple[bool, _Node, bool]] = []
    for alt in node.alts if isinstance(node, _Alt) else (node,):
        items = list(alt.items) if isinstance(alt, _Seq) else [alt]
        start = end = False
        while items and items[0] == _Anchor(True):
            items.pop(0)
            start = True
        while items and items[-1] == _Anchor(False):
            items.pop()
            end = True
        body = _Seq(tuple(items))
        if _has_anchor(body):
            raise ValueError("an anchor inside the pattern (not at the start or end of a "
                             "top-level alternative) cannot be enforced")
        out.append((start, body, end))
    return out


def _has_anchor(node: _Node) -> bool:
    if isinstance(node, _Anchor):
        return True
    if isinstance(node, _Seq):
        return any(_has_anchor(n) for n in node.items)
    if isinstance(node, _Alt):
        return any(_has_anchor(n) for n in node.alts)
    return isinstance(node, _Rep) and _has_anchor(node.node)


# -- automata --------------------------------------------------------------------------------

class _Nfa:
    def __init__(self) -> None:
        self.moves: list[list[tuple[Chars, int]]] = []
        self.eps: list[list[int]] = []

    def state(self) -> int:
        if len(self.moves) >= MAX_NFA_STATES:
            raise ValueError(f"the pattern needs over {MAX_NFA_STATES} automaton states")
        self.moves.append([])
        self.eps.append([])
        return len(self.moves) - 1

    def build(self, node: _Node) -> tuple[int, int]:
        if isinstance(node, _Set):
            a, b = self.state(), self.state()
            if node.chars:
                self.moves[a].append((node.chars, b))
            return a, b
        if isinstance(node, _Seq):
            a = b = self.state()
            for item in node.items:
                s, e = self.build(item)
                self.eps[b].append(s)
                b = e
            return a, b
        if isinstance(node, _Alt):
            a, b = self.state(), self.state()
            for alt in node.alts:
                s, e = self.build(alt)
                self.eps[a].append(s)
                self.eps[e].append(b)
            return a, b
        if isinstance(node, _Rep):
            a = b = self.state()
            for _ in range(node.lo):
                s, e = self.build(node.node)
                self.eps[b].append(s)
                b = e
            if node.hi is None:
                s, e = self.build(node.node)
                self.eps[b].append(s)
                self.eps[e].append(b)
                return a, b
            end = self.state()
            self.eps[b].append(end)
            for _ in range(node.hi - node.lo):
                s, e = self.build(node.node)
                self.eps[b].append(s)
                self.eps[e].append(end)
                b = e
            return a, end
        raise ValueError("an anchor inside the pattern cannot be enforced")

    def closure(self, states: Iterable[int]) -> frozenset[int]:
        seen = set(states)
        stack = list(seen)
        while stack:
            for t in self.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)


@dataclass
class Dfa:
    """States 0..n-1, 0 the start; `moves[q]`: (chars, target) with disjoint chars; every
    state can reach an accepting one (dead states are removed, never written)."""

    moves: list[list[tuple[Chars, int]]]
    accepting: list[bool]

    @property
    def empty(self) -> bool:
        return not any(self.accepting)

    def shortest(self) -> int:
        """The length of the shortest text (0 for an empty language)."""
        dist, frontier = {0: 0}, [0]
        while frontier:
            if any(self.accepting[q] for q in frontier):
                return dist[frontier[0]]
            nxt = []
            for q in frontier:
                for _, t in self.moves[q]:
                    if t not in dist:
                        dist[t] = dist[q] + 1
                        nxt.append(t)
            frontier = nxt
        return 0

    def longest(self) -> int | None:
        """The length of the longest text, None when there is none (a loop)."""
        order: list[int] = []
        state = [0] * len(self.moves)  # 0 new, 1 on the path, 2 done
        stack = [(0, 0)]
        while stack:
            q, i = stack.pop()
            if i == 0:
                if state[q] == 1:
                    return None
                if state[q] == 2:
                    continue
                state[q] = 1
            if i < len(self.moves[q]):
                stack.append((q, i + 1))
                t = self.moves[q][i][1]
                if state[t] == 1:
                    return None
                if state[t] == 0:
                    stack.append((t, 0))
            else:
                state[q] = 2
                order.append(q)
        far = [0] * len(self.moves)
        for q in order:  # children before parents
            far[q] = max((far[t] + 1 for _, t in self.moves[q]), default=0)
        return far[0]

    def step(self, q: int, c: int) -> int | None:
        for cs, t in self.moves[q]:
            if _contains(cs, c):
                return t
        return None

    def matches(self, text: str) -> bool:
        q: int | None = 0
        for ch in text:
            q = self.step(q, ord(ch)) if q is not None else None
        return q is not None and self.accepting[q]


def _determinize(nfa: _Nfa, start: int, accept: int, tails: set[int]) -> Dfa:
    universal = nfa.closure(tails)
    first = nfa.closure([start])
    index = {first: 0}
    order = [first]
    moves: list[list[tuple[Chars, int]]] = []
    while len(moves) < len(order):
        subset = order[len(moves)]
        outgoing = [(cs, t) for q in subset for cs, t in nfa.moves[q]]
        cuts = sorted({lo for cs, _ in outgoing for lo, _ in cs} |
                      {hi + 1 for cs, _ in outgoing for _, hi in cs})
        by_target: dict[frozenset[int], list[tuple[int, int]]] = {}
        for lo, nxt in zip(cuts, cuts[1:], strict=False):
            targets = [t for cs, t in outgoing if _contains(cs, lo)]
            if not targets:
                continue
            closed = nfa.closure(targets)
            if not tails.isdisjoint(closed):
                closed = universal
            by_target.setdefault(closed, []).append((lo, nxt - 1))
        row = []
        for closed, ranges in by_target.items():
            if closed not in index:
                if len(order) >= MAX_DFA_STATES:
                    raise ValueError(f"the pattern needs over {MAX_DFA_STATES} automaton "
                                     "states")
                index[closed] = len(order)
                order.append(closed)
            row.append((chars(*ranges), index[closed]))
        moves.append(row)
    return _trim(Dfa(moves, [accept in s for s in order]))


def _trim(dfa: Dfa) -> Dfa:
    """Without the states that cannot reach acceptance (or be reached), minimized."""
    n = len(dfa.moves)
    back: list[list[int]] = [[] for _ in range(n)]
    for q, row in enumerate(dfa.moves):
        for _, t in row:
            back[t].append(q)
    live = {q for q in range(n) if dfa.accepting[q]}
    stack = list(live)
    while stack:
        for p in back[stack.pop()]:
            if p not in live:
                live.add(p)
                stack.append(p)
    if 0 not in live:
        return Dfa([[]], [False])
    moves = [[(cs, t) for cs, t in row if t in live] for row in dfa.moves]
    # Moore's refinement: states with the same acceptance and the same targets' blocks. It
    # takes a round per distinguishable depth: past _MINIMIZED states (a length's product,
    # already near minimal) the automaton is kept as built.
    block = [int(a) for a in dfa.accepting] if n <= _MINIMIZED else list(range(n))
    while n <= _MINIMIZED:
        signature: dict[tuple[object, ...], int] = {}
        new = []
        for q in range(n):
            key = (block[q], tuple(sorted(_merged(moves[q], block))))
            new.append(signature.setdefault(key, len(signature)))
        if len(signature) == len(set(block)):
            break
        block = new
    # Renumber from the start, keeping reachable live blocks only.
    order = {block[0]: 0}
    members = {b: q for q, b in reversed(list(enumerate(block)))}
    queue = collections.deque([block[0]])
    out_moves: list[list[tuple[Chars, int]]] = []
    accepting = []
    while queue:
        b = queue.popleft()
        q = members[b]
        row = []
        for cs, t in _merged(moves[q], block):
            if t not in order:
                order[t] = len(order)
                queue.append(t)
            row.append((cs, order[t]))
        out_moves.append(row)
        accepting.append(dfa.accepting[q])
    return Dfa(out_moves, accepting)


def _merged(row: list[tuple[Chars, int]], block: list[int]) -> list[tuple[Chars, int]]:
    by: dict[int, Chars] = {}
    for cs, t in row:
        by[block[t]] = union(by.get(block[t], ()), cs)
    return [(cs, b) for b, cs in by.items()]


def pattern(text: str) -> Dfa:
    """The strings `text` matches, searched as JSON Schema searches (ValueError when the
    pattern is outside the subset read here or too large)."""
    nfa = _Nfa()
    start, accept = nfa.state(), nfa.state()
    universal: set[int] = set()
    for anchored_start, body, anchored_end in _unanchored(_parse(text)):
        s, e = nfa.build(body)
        if not anchored_start:
            loop = nfa.state()
            nfa.moves[loop].append((ANY, loop))
            nfa.eps[loop].append(s)
            s = loop
        if not anchored_end:
            tail = nfa.state()
            nfa.moves[tail].append((ANY, tail))
            nfa.eps[tail].append(accept)
            nfa.eps[e].append(tail)
            universal.add(tail)
            e = tail
        nfa.eps[start].append(s)
        nfa.eps[e].append(accept)
    # Once a tail that takes anything has been reached, the text matches whatever follows:
    # one state stands for all such subsets (else `.*x.*` would count every way to be there).
    return _determinize(nfa, start, accept, universal)


def literals(words: Iterable[str]) -> Dfa:
    """Exactly the given texts."""
    moves: list[list[tuple[Chars, int]]] = [[]]
    accepting = [False]
    for word in words:
        q = 0
        for ch in word:
            c = ord(ch)
            t = next((t for cs, t in moves[q] if cs == ((c, c),)), None)
            if t is None:
                moves.append([])
                accepting.append(False)
                t = len(moves) - 1
                moves[q].append((((c, c),), t))
            q = t
        accepting[q] = True
    return _trim(Dfa(moves, accepting))


def anything(lo: int = 0, hi: int | None = None) -> Dfa:
    """Every text of lo to hi characters."""
    return with_length(Dfa([[(ANY, 0)]], [True]), lo, hi)


def with_length(dfa: Dfa, lo: int, hi: int | None) -> Dfa:
    """The texts of `dfa` of lo to hi characters (hi None: no upper bound)."""
    cap = hi if hi is not None else lo
    index: dict[tuple[int, int], int] = {(0, 0): 0}
    order = [(0, 0)]
    moves: list[list[tuple[Chars, int]]] = []
    while len(moves) < len(order):
        q, n = order[len(moves)]
        row = []
        if hi is None or n < hi:
            m = min(n + 1, cap) if hi is not None else min(n + 1, lo)
            for cs, t in dfa.moves[q]:
                key = (t, m)
                if key not in index:
                    if len(order) >= MAX_DFA_STATES * 4:
                        raise ValueError("the pattern and length together need too many "
                                         "automaton states")
                    index[key] = len(order)
                    order.append(key)
                row.append((cs, index[key]))
        moves.append(row)
    return _trim(Dfa(moves, [dfa.accepting[q] and n >= lo for q, n in order]))


def both(a: Dfa, b: Dfa) -> Dfa:
    """The texts of both."""
    return _product(a, b, lambda x, y: x and y)


def without(a: Dfa, b: Dfa) -> Dfa:
    """The texts of `a` that are not texts of `b`."""
    return _product(a, b, lambda x, y: x and not y)


def _product(a: Dfa, b: Dfa, keep: object) -> Dfa:
    assert callable(keep)
    index: dict[tuple[int, int | None], int] = {(0, 0): 0}
    order: list[tuple[int, int | None]] = [(0, 0)]
    moves: list[list[tuple[Chars, int]]] = []
    while len(moves) < len(order):
        p, q = order[len(moves)]
        row = []
        for cs, t in a.moves[p]:
            targets = [(intersect(cs, cs2), t2) for cs2, t2 in b.moves[q]] if q is not None \
                else []
            covered: Chars = ()
            for shared, t2 in targets:
                if shared:
                    row.append((shared, _at(index, order, (t, t2))))
                    covered = union(covered, shared)
            alone = intersect(cs, complement(covered))
            if alone:  # b has no move here: it is out for good
                row.append((alone, _at(index, order, (t, None))))
        moves.append(row)
    accepting = [keep(a.accepting[p], q is not None and b.accepting[q]) for p, q in order]
    return _trim(Dfa(moves, accepting))


def _at(index: dict[tuple[int, int | None], int], order: list[tuple[int, int | None]],
        key: tuple[int, int | None]) -> int:
    if key not in index:
        if len(order) >= MAX_DFA_STATES * 4:
            raise ValueError("the string rules together need too many automaton states")
        index[key] = len(order)
        order.append(key)
    return index[key]


# -- as grammar -----------------------------------------------------------------------------

_SHORT = {0x22: '"\\\\\\""', 0x5C: '"\\\\\\\\"', 8: '"\\\\b"', 12: '"\\\\f"', 10: '"\\\\n"',
          13: '"\\\\r"', 9: '"\\\\t"'}
# What JSON writes escaped: the quote, the backslash, control characters (and DEL, which
# the converter's string rule also escapes).
_ESCAPED = chars((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F))
_CONTROLS = chars((0, 0x1F))
_SHARED_CHOICE = 40  # a character choice longer than this is a rule of its own
_ANY_CONTROL = '"\\\\" ([bfnrt] | "u00" [01] [0-9a-fA-F])'  # exactly U+0000-U+001F


def json_pieces(cs: Chars) -> list[str]:
    """Grammar alternatives that write one character of `cs` as JSON writes it in a string:
    a class of the plain ones, and each escaped one as its escape."""
    out = []
    plain = intersect(cs, complement(_ESCAPED))
    if plain:
        out.append(char_class(plain))
    escaped = intersect(cs, _ESCAPED)
    if intersect(escaped, _CONTROLS) == _CONTROLS:
        out.append(_ANY_CONTROL)
        escaped = intersect(escaped, complement(_CONTROLS))
    for lo, hi in escaped:
        for c in range(lo, hi + 1):
            out.append(_SHORT.get(c) or f'"\\\\u{c:04x}"')
    return out


def char_class(cs: Chars) -> str:
    body = "".join(_class_char(lo) + ("" if lo == hi else "-" + _class_char(hi))
                   for lo, hi in cs)
    return f"[{body}]"


def _class_char(c: int) -> str:
    if c < 0x80 and chr(c).isalnum():
        return chr(c)
    if c <= 0xFF:
        return f"\\x{c:02X}"
    return f"\\u{c:04X}" if c <= 0xFFFF else f"\\U{c:08X}"


def rules(dfa: Dfa, names: list[str], shared: Callable[[str], str]) -> list[str]:
    """The body of each state's rule, `names[q]` naming state q's rule: a state writes one
    character and goes on, or (accepting) may stop. A move into a state that accepts and
    goes nowhere is written without its rule. `shared` names a rule for a long character
    choice, written once however many states use it."""
    out = []
    for q, row in enumerate(dfa.moves):
        alts = []
        for cs, t in row:
            pieces = json_pieces(cs)
            head = pieces[0] if len(pieces) == 1 else "(" + " | ".join(pieces) + ")"
            if len(head) > _SHARED_CHOICE:
                head = shared(head)
            alts.append(head if not dfa.moves[t] else f"{head} {names[t]}")
        body = " | ".join(alts)
        if dfa.accepting[q]:
            body = f"({body})?" if body else '""'
        out.append(body)
    return out
