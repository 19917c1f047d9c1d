"""Grammar text on its way to llama.cpp: audited here, then parsed in a bounded child.

llama.cpp does not fail politely on a grammar it cannot follow. A character element that no
token can produce (a NUL, a code point above U+10FFFF) leaves the sampler with no allowed
token, and the next accept kills the whole process ("Unexpected empty grammar stack"); its
parser has had crashes of its own. So a grammar passes two gates before a sampler sees it:

1. an audit of the text against the subset of GBNF our converter writes (rules, literals,
   character classes, groups, `*` `+` `?`), refusing any character element that no token
   can produce and anything outside that subset;
2. llama.cpp's own parser (`llama_sampler_init_grammar`), run in a child process with a
   memory and CPU limit: a refusal or a crash there costs the client a 400, not the daemon.

Verdicts are cached by grammar text in a bounded LRU, so each new schema pays for one child
(about 30-150 ms) and repeats pay nothing. What passes is a `CheckedGrammar`; the runtime
builds no sampler from any other string. The child never imports llama_cpp's Python package
(a second or more): it loads the shared library the daemon already uses through ctypes.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from collections import OrderedDict
from string import ascii_letters, digits, hexdigits

from edge_agent.errors import EdgeAgentError, InvalidRequest, ServiceUnavailable

MAX_GRAMMAR_BYTES = 512 * 1024
_CACHE_SIZE = 512
_CHILD_SLOTS = threading.BoundedSemaphore(2)  # concurrent checks: each is a process
_CHILD_TIMEOUT_S = 10
_CHILD_HEADROOM = 512 * 1024**2  # address space beyond what loading the library mapped
_CHILD = r"""
import ctypes, resource, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
lib = ctypes.CDLL(sys.argv[1])
try:
    with open("/proc/self/statm") as fh:
        mapped = int(fh.read().split()[0]) * resource.getpagesize()
except OSError:
    mapped = 4 << 30
cap = mapped + int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
resource.setrlimit(resource.RLIMIT_CPU, (int(sys.argv[3]), int(sys.argv[3])))
init = lib.llama_sampler_init_grammar
init.restype = ctypes.c_void_p
init.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
sys.exit(0 if init(None, sys.stdin.buffer.read(), b"root") else 3)
"""


class CheckedGrammar(str):
    """Grammar text that passed the audit and llama.cpp's parser in a child process."""

    __slots__ = ()


class _Refused(Exception):
    """Why a grammar cannot be used (the message goes to the client)."""


_verdicts: OrderedDict[str, str] = OrderedDict()  # sha256 -> "" (accepted) or the reason
_lock = threading.Lock()


def check(grammar: str, *, param: str) -> CheckedGrammar:
    """`grammar` as a CheckedGrammar, or InvalidRequest naming `param`."""
    key = hashlib.sha256(grammar.encode("utf-8", "surrogatepass")).hexdigest()
    verdict = _cached(key)
    if verdict is None:
        with _CHILD_SLOTS:
            verdict = _cached(key)  # another request may have checked it meanwhile
            if verdict is None:
                verdict = _verdict(grammar)
                with _lock:
                    _verdicts[key] = verdict
                    while len(_verdicts) > _CACHE_SIZE:
                        _verdicts.popitem(last=False)
    if verdict:
        raise InvalidRequest(f"the JSON schema gives a grammar llama.cpp cannot use: {verdict}",
                             param=param)
    return CheckedGrammar(grammar)


def _cached(key: str) -> str | None:
    with _lock:
        verdict = _verdicts.get(key)
        if verdict is not None:
            _verdicts.move_to_end(key)
        return verdict


def _verdict(grammar: str) -> str:
    try:
        audit(grammar)
        _parse_in_child(grammar)
    except _Refused as exc:
        return str(exc)
    return ""


def audit(grammar: str) -> None:
    """Raises _Refused unless `grammar` stays inside the GBNF subset our converter writes
    and every character element in it matches at least one character a token can spell."""
    try:
        size = len(grammar.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise _Refused("the schema holds a lone surrogate, which UTF-8 cannot carry") from exc
    if "\x00" in grammar:
        raise _Refused("the schema puts a raw NUL character into the grammar")
    if size > MAX_GRAMMAR_BYTES:
        raise _Refused(f"the grammar is {size} bytes; the limit is {MAX_GRAMMAR_BYTES}")
    i, n = 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c == '"':
            i = _literal(grammar, i + 1)
        elif c == "[":
            i = _char_class(grammar, i + 1)
        elif c in _PLAIN:
            i += 1
        elif grammar.startswith("::=", i):
            i += 3
        else:
            raise _Refused(f"unexpected {c!r} at offset {i}")


# Word characters of rule names, spacing, grouping and repetition: nothing else appears
# outside literals and classes (no comments, tokens, `.` or {m,n}).
_PLAIN = frozenset(ascii_letters + digits + "- \n()|*+?")
_SIMPLE_ESCAPES = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
# What a token can spell: every Unicode scalar value but NUL, which ends llama.cpp's
# decoded strings. (Surrogates never come out of valid UTF-8.)
_SPELLABLE = ((1, 0xD7FF), (0xE000, 0x10FFFF))


def _char(text: str, i: int) -> tuple[int, int]:
    """One character as llama.cpp's parse_char reads it: (code point, next offset)."""
    if i >= len(text):
        raise _Refused("the grammar ends inside a literal or class")
    if text[i] != "\\":
        return ord(text[i]), i + 1
    kind = text[i + 1] if i + 1 < len(text) else ""
    if kind in _HEX_ESCAPES:
        hex_digits = text[i + 2 : i + 2 + _HEX_ESCAPES[kind]]
        if len(hex_digits) != _HEX_ESCAPES[kind] or not all(h in hexdigits for h in hex_digits):
            raise _Refused(f"malformed escape at offset {i}")
        return int(hex_digits, 16), i + 2 + len(hex_digits)
    if kind in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[kind], i + 2
    raise _Refused(f"unsupported escape '\\{kind}' (a JSON schema pattern's regex escape?)")


def _spellable(lo: int, hi: int) -> bool:
    return any(lo <= b and a <= hi for a, b in _SPELLABLE)


def _literal(text: str, i: int) -> int:
    while True:
        if i >= len(text):
            raise _Refused("a literal is not closed")
        if text[i] == '"':
            return i + 1
        cp, i = _char(text, i)
        if not _spellable(cp, cp):
            raise _Refused(f"the character U+{cp:04X} cannot be produced by any token")


def _char_class(text: str, i: int) -> int:
    negated = text.startswith("^", i)
    i += negated
    ranges: list[tuple[int, int]] = []
    while True:
        if i >= len(text):
            raise _Refused("a character class is not closed")
        if text[i] == "]":
            break
        lo, i = _char(text, i)
        hi = lo
        if text.startswith("-", i) and i + 1 < len(text) and text[i + 1] != "]":
            hi, i = _char(text, i + 1)
        ranges.append((lo, hi))
    if not ranges:
        raise _Refused("an empty character class")
    if negated:
        if _covers(ranges):
            raise _Refused("a character class excludes every character")
    elif not any(_spellable(lo, hi) for lo, hi in ranges):
        raise _Refused("a character class matches no character any token can produce")
    return i + 1


def _covers(ranges: list[tuple[int, int]]) -> bool:
    """Whether the ranges together include every spellable character."""
    for start, end in _SPELLABLE:
        reach = start
        for lo, hi in sorted(ranges):
            if lo > reach:
                break
            reach = max(reach, hi + 1)
        if reach <= end:
            return False
    return True


def _parse_in_child(grammar: str) -> None:
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _CHILD, _library(), str(_CHILD_HEADROOM),
             str(_CHILD_TIMEOUT_S)],
            input=grammar.encode("utf-8"), capture_output=True, timeout=_CHILD_TIMEOUT_S,
            check=False)
    except subprocess.TimeoutExpired as exc:
        raise _Refused(f"llama.cpp's parser took over {_CHILD_TIMEOUT_S}s") from exc
    except OSError as exc:
        raise ServiceUnavailable(f"cannot check a grammar now ({exc.strerror})",
                                 retry_after=1) from exc
    if done.returncode == 0:
        return
    if done.returncode < 0:
        raise _Refused(f"llama.cpp's parser crashed (signal {-done.returncode})")
    raise _Refused(_reason(done.stderr.decode("utf-8", errors="replace")))


def _reason(stderr: str) -> str:
    """llama.cpp's own words, without the grammar text it echoes after them."""
    for line in stderr.splitlines():
        if "error parsing grammar:" in line:
            return line.split("error parsing grammar:", 1)[1].strip()[:160]
        if "left recursion" in line or "Undefined rule" in line:
            return line.strip()[:160]
    return "llama.cpp's parser rejected it"


def _library() -> str:
    """The libllama the daemon itself loaded (so the child judges the same parser)."""
    import llama_cpp.llama_cpp as native

    path = getattr(getattr(native, "_lib", None), "_name", None)
    if not isinstance(path, str):
        raise EdgeAgentError("cannot locate llama.cpp's shared library")
    return path
