"""Redaction: find personal data and secrets in text, offline, and replace them.

Detectors: e-mail, phone numbers (`phonenumbers`, configured regions, strict grouping so
order numbers and dates do not match), payment cards (brand prefix + length + Luhn),
IBANs and national IDs (`python-stdnum`, configured countries), IPv4/IPv6, MAC addresses,
and secrets (JWTs, known API-key prefixes, long high-entropy tokens). Operators: `tag`
(`<EMAIL>`), `mask` (`***`, cards keep their last four), `hmac` (a keyed token, stable per
device, so records can be correlated without the value). Spans are reported against the
redacted text. This module never logs or stores a raw value.

A lenient pass (`lenient=True`) adds shapes without checksums or strict grouping, for text
where a missed value costs more than an over-redacted one: model output (a phone number
repeated in another grouping, a truncated card or IBAN) and client-supplied identifiers
(`MetadataRedactor`: trace ids, unknown model names, paths). Prompts keep the strict pass,
whose precision is measured on the labelled fixture.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import math
import os
import re
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import phonenumbers
from stdnum import iban, luhn

from edge_agent.owner_only import FILE_MODE, private_dir

DETECTOR_VERSION = "2"  # 2: the lenient pass
Operator = Literal["tag", "mask", "hmac"]


@dataclass(frozen=True)
class Finding:
    start: int
    end: int
    entity: str
    detector: str


@dataclass(frozen=True)
class Span:
    """One redacted span, positions in the redacted text."""

    entity: str
    detector: str
    detector_version: str
    operator: str
    start: int
    end: int


_EMAIL = re.compile(
    r"(?<![\w.+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
_CARD = re.compile(r"(?<![\d-])(?:\d[ -]?){14,18}\d(?![\d-])")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b")
_IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?!\.?\d)")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")
_MAC = re.compile(r"(?<![\w:-])[0-9A-Fa-f]{2}(?:([:-])[0-9A-Fa-f]{2})(?:\1[0-9A-Fa-f]{2}){4}"
                  r"(?![\w:-])")
_JWT = re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")
_KEY_PREFIXES = re.compile(
    r"\b(?:sk|pk|rk)-(?:live-|test-|proj-)?[A-Za-z0-9_-]{16,}|\bghp_[A-Za-z0-9]{30,}"
    r"|\bAKIA[0-9A-Z]{16}\b|\bxox[abprs]-[A-Za-z0-9-]{10,}|\bea_[0-9a-f]{8}_[A-Za-z0-9_-]{20,}"
    r"|\bAIza[0-9A-Za-z_-]{35}")
_PHONE_CANDIDATE = re.compile(r"(?<![\w+])(?:\+|\()?\d[\d ()./-]{5,22}\d(?![\w])")
_TOKEN = re.compile(r"(?<![A-Za-z0-9+/_=-])[A-Za-z0-9+/_=-]{32,}(?![A-Za-z0-9+/_=-])")
# National IDs: (stdnum module, candidate pattern). Formats with letters or separators,
# so that bare order numbers do not pass a 1-in-10 checksum by chance.
_NATIONAL_IDS: dict[str, tuple[str, re.Pattern[str]]] = {
    "us": ("stdnum.us.ssn", re.compile(r"\b\d{3}-\d{2}-\d{4}\b")),
    "es": ("stdnum.es.dni", re.compile(r"\b\d{8}-?[A-Z]\b")),
    "it": ("stdnum.it.codicefiscale", re.compile(r"\b[A-Z]{6}\d{2}[A-Z]\d{2}[A-Z]\d{3}[A-Z]\b")),
    "nl": ("stdnum.nl.bsn", re.compile(r"\b\d{4}\.\d{2}\.\d{3}\b")),
    "fr": ("stdnum.fr.nir", re.compile(r"\b[12] ?\d{2} ?\d{2} ?\d{2} ?\d{3} ?\d{3} ?\d{2}\b")),
}
# The lenient shapes. Cards: 12-19 digits behind a brand's leading digit, no Luhn (a
# truncated number fails it). IBANs: a country that issues them, check digits and at least
# six more characters, no checksum. Phones: any grouping whose digits parse as a number.
_LOOSE_CARD = re.compile(r"(?<![\d-])(?:\d[ -]?){11,18}\d(?!\d)")
_LOOSE_CARD_BRAND = re.compile(r"^(?:4|5[1-5]|2[2-7]|3\d|6)")
_CARD_GROUPS = re.compile(r"^\d{4}(?:[ -]\d{4}){2,3}(?:[ -]\d{1,4})?$")
_LOOSE_IBAN = re.compile(r"\b([A-Z]{2})(\d{2})(?: ?[A-Z0-9]){6,30}")
_LOOSE_NATIONAL_IDS: dict[str, re.Pattern[str]] = {
    "us": re.compile(r"(?<!\d)\d{3}[- ]\d{2}[- ]\d{4}(?!\d)"),
}
_CARD_BRANDS = re.compile(r"^(?:4\d{15}(?:\d{3})?|5[1-5]\d{14}|2(?:2[2-9]|[3-6]\d|7[01])\d{13}"
                          r"|2720\d{12}|3[47]\d{13}|6(?:011|5\d{2})\d{12}(?:\d{3})?"
                          r"|35(?:2[89]|[3-8]\d)\d{12}(?:\d{3})?|3(?:0[0-5]|[68]\d)\d{11})$")


def _entropy(text: str) -> float:
    counts: dict[str, int] = {}
    for ch in text:
        counts[ch] = counts.get(ch, 0) + 1
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def _claim(taken: bytearray, findings: list[Finding]) -> None:
    for f in findings:
        taken[f.start:f.end] = b"\x01" * (f.end - f.start)


def _unclaimed(taken: bytearray, findings: list[Finding]) -> list[Finding]:
    """The findings that overlap no claimed character, now claimed in turn (overlapping
    ones among themselves are left to `find`'s longest-first pass)."""
    kept = [f for f in findings if taken.find(1, f.start, f.end) < 0]
    _claim(taken, kept)
    return kept


class Detectors:
    def __init__(self, regions: list[str], countries: list[str]) -> None:
        import importlib

        self.regions = regions
        self._plausible = {r: _national_shape(r) for r in regions}
        self._ids = []
        self._loose_ids = []
        for country in countries:
            module, pattern = _NATIONAL_IDS[country]
            self._ids.append((country, importlib.import_module(module), pattern))
            self._loose_ids.append((country, _LOOSE_NATIONAL_IDS.get(country, pattern)))
        _iban_countries()  # loaded now, not on the first response

    def find(self, text: str, *, lenient: bool = False) -> list[Finding]:
        # Every entity contains a digit or an "@" (a random 32-character secret without a
        # digit is a 1-in-1,000 case): the detectors scan only the runs of such words,
        # which keeps prose cheap. Phone numbers too lie inside one run.
        found: list[Finding] = []
        for start, end in _windows(text):
            lo = max(0, start - 1)
            window = text[lo:end + 1]
            local = list(self._regex(window))
            taken = bytearray(len(window))  # 1 where a finding already claims the character
            _claim(taken, local)
            local += self._phones(window, taken)
            if lenient:  # only where the strict detectors found nothing
                _claim(taken, local)
                local += self._loose(window, taken)
            found += [Finding(f.start + lo, f.end + lo, f.entity, f.detector) for f in local]
        # Longest first, then earliest; drop anything overlapping a kept finding.
        found.sort(key=lambda f: (-(f.end - f.start), f.start))
        claimed = bytearray(len(text))
        kept: list[Finding] = []
        for f in found:
            if claimed.find(1, f.start, f.end) < 0:
                claimed[f.start:f.end] = b"\x01" * (f.end - f.start)
                kept.append(f)
        return sorted(kept, key=lambda f: f.start)

    def _regex(self, text: str) -> Iterator[Finding]:
        # Each pattern needs a character most windows lack ("@", ".", ":"), or a length;
        # testing for it first skips most of the scans.
        if "@" in text:
            for m in _EMAIL.finditer(text):
                yield Finding(m.start(), m.end(), "EMAIL", "email")
        if len(text) < 5:
            return  # shorter than any card, IBAN, ID, address or key ("fe80::1" is 7)
        for m in _CARD.finditer(text):
            digits = re.sub(r"[ -]", "", m.group())
            if _CARD_BRANDS.match(digits) and luhn.is_valid(digits):
                yield Finding(m.start(), m.end(), "CARD", "card-luhn")
        for m in _IBAN.finditer(text):
            if iban.is_valid(m.group()):
                yield Finding(m.start(), m.end(), "IBAN", "stdnum-iban")
        for country, module, pattern in self._ids:
            for m in pattern.finditer(text):
                if module.is_valid(m.group()):
                    yield Finding(m.start(), m.end(), "NATIONAL_ID", f"stdnum-{country}")
        if "." in text:
            for m in _IPV4.finditer(text):
                if _is_ip(m.group()):
                    yield Finding(m.start(), m.end(), "IP_ADDRESS", "ipv4")
        if ":" in text:
            for m in _IPV6.finditer(text):
                if m.group().count(":") >= 2 and _is_ip(m.group()) and len(m.group()) > 4:
                    yield Finding(m.start(), m.end(), "IP_ADDRESS", "ipv6")
        if ":" in text or "-" in text:
            for m in _MAC.finditer(text):
                yield Finding(m.start(), m.end(), "MAC_ADDRESS", "mac")
        if "eyJ" in text:
            for m in _JWT.finditer(text):
                yield Finding(m.start(), m.end(), "SECRET", "jwt")
        for m in _KEY_PREFIXES.finditer(text):
            yield Finding(m.start(), m.end(), "SECRET", "api-key-prefix")
        if len(text) < 32:
            return
        for m in _TOKEN.finditer(text):
            token = m.group()
            classes = sum(bool(re.search(p, token)) for p in ("[a-z]", "[A-Z]", "[0-9]"))
            if classes >= 3 and _entropy(token) >= 4.0:
                yield Finding(m.start(), m.end(), "SECRET", "entropy")

    def _phones(self, text: str, taken: bytearray) -> list[Finding]:
        """phonenumbers' matcher is thorough but slow over long text: it runs only on
        digit runs that could be a phone number and that no other detector claimed."""
        out = []
        for cand in _PHONE_CANDIDATE.finditer(text):
            if taken.find(1, cand.start(), cand.end()) >= 0:
                continue
            digits = sum(ch.isdigit() for ch in cand.group())
            if not 7 <= digits <= 15:  # E.164 numbers have at most 15 digits
                continue
            chunk = text[max(0, cand.start() - 1):cand.end() + 1]
            offset = max(0, cand.start() - 1)
            raw = cand.group()
            if raw.startswith(("+", "00")):
                regions = self.regions[:1]  # international: the region does not matter
            else:
                regions = [r for r in self.regions if self._plausible[r].match(raw)]
            for region in regions:
                matches = list(phonenumbers.PhoneNumberMatcher(
                    chunk, region, leniency=phonenumbers.Leniency.STRICT_GROUPING))
                out += [Finding(offset + m.start, offset + m.end, "PHONE",
                                f"phonenumbers-{region}") for m in matches]
                if matches:
                    break
        return out

    def _loose(self, text: str, taken: bytearray) -> list[Finding]:
        """The lenient shapes, on characters no strict finding claimed, the most specific
        first: IBANs, IDs and card prefixes in groups of four, then phones (parsed), then
        other card prefixes (any 12+ digits behind a brand's leading digit)."""
        out: list[Finding] = []
        for m in _LOOSE_IBAN.finditer(text):
            if m.group(1) in _iban_countries() and 2 <= int(m.group(2)) <= 98:
                out.append(Finding(m.start(), m.end(), "IBAN", "loose-iban"))
        for country, pattern in self._loose_ids:
            out += [Finding(m.start(), m.end(), "NATIONAL_ID", f"loose-{country}")
                    for m in pattern.finditer(text)]
        cards = [Finding(m.start(), m.end(), "CARD", "loose-card")
                 for m in _LOOSE_CARD.finditer(text)
                 if _LOOSE_CARD_BRAND.match(digits := re.sub(r"[ -]", "", m.group()))
                 and len(digits) >= 12]
        grouped = [f for f in cards if _CARD_GROUPS.match(text[f.start:f.end])]
        out = _unclaimed(taken, out + grouped)
        out += _unclaimed(taken, [Finding(m.start(), m.end(), "PHONE", "loose-phone")
                                  for m in _PHONE_CANDIDATE.finditer(text)
                                  if self._loose_phone(m.group())])
        return out + _unclaimed(taken, cards)

    def _loose_phone(self, raw: str) -> bool:
        """Any grouping: with "+" or "00", a number of a possible length; otherwise (9+
        digits, so dates stay) a valid number with its country code and no "+" ("49
        3012345678") or a valid national number of a configured region."""
        digits = re.sub(r"\D", "", raw)
        international = raw.startswith(("+", "00"))
        if raw.startswith("00"):
            digits = digits[2:]
        if not (7 if international else 9) <= len(digits) <= 15:
            return False
        try:
            if international:
                return bool(phonenumbers.is_possible_number(phonenumbers.parse("+" + digits)))
            if phonenumbers.is_valid_number(phonenumbers.parse("+" + digits)):
                return True
        except phonenumbers.NumberParseException:
            pass
        for region in self.regions:
            try:
                if phonenumbers.is_valid_number(phonenumbers.parse(digits, region)):
                    return True
            except phonenumbers.NumberParseException:
                continue
        return False


@functools.cache
def _iban_countries() -> frozenset[str]:
    """The countries that issue IBANs (python-stdnum's registry)."""
    from stdnum import numdb

    db = numdb.get("iban")
    letters = string.ascii_uppercase
    return frozenset(a + b for a in letters for b in letters
                     if db.info(f"{a}{b}00")[0][1].get("bban"))


_INTERESTING = re.compile(r"(?<!\S)[^\s\d@]*[\d@]\S*")  # tried once per word


def _windows(text: str) -> Iterator[tuple[int, int]]:
    """Runs of words that contain a digit or "@", neighbours (up to 6 characters apart,
    as in "(415) 555-2671" or a spaced IBAN with a group of letters) merged."""
    start = end = -1
    for m in _INTERESTING.finditer(text):
        if end >= 0 and m.start() - end <= 6:
            end = m.end()
            continue
        if end >= 0:
            yield start, end
        start, end = m.start(), m.end()
    if end >= 0:
        yield start, end


_NANP = re.compile(r"^(?:1[ .-]?)?(?:\([2-9]\d{2}\)|[2-9]\d{2})[ .-]?\d{3}[ .-]?\d{4}$")
_ANY = re.compile(r"")


def _national_shape(region: str) -> re.Pattern[str]:
    """A cheap test of whether a digit run could be a national number of `region` (trunk
    prefix, or NANP's 3-3-4), so dates, prices and order numbers skip the slow matcher."""
    meta = phonenumbers.PhoneMetadata.metadata_for_region(region)
    if meta is None:
        return _ANY
    if meta.country_code == 1:
        return _NANP
    if meta.national_prefix:
        return re.compile(rf"^\(?{re.escape(meta.national_prefix)}")
    return _ANY


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def device_key(state_dir: Path) -> bytes:
    """The per-device HMAC key (created once, owner-only)."""
    path = state_dir / "redaction.key"
    if not path.exists():
        private_dir(state_dir)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(32))
    return path.read_bytes()


class Redactor:
    def __init__(self, detectors: Detectors, key: bytes, *, operator: Operator = "tag",
                 policy_version: str = "1") -> None:
        self.detectors = detectors
        self.key = key
        self.operator = operator
        self.policy_version = policy_version
        self._ops: dict[str, Callable[[str, str], str]] = {
            "tag": lambda value, entity: f"<{entity}>",
            "mask": self._mask,
            "hmac": self._hmac,
        }

    def redact(self, text: str, *, lenient: bool = False) -> tuple[str, list[Span]]:
        """`lenient`: add the lenient pass (model output, identifiers); prompts keep the
        strict one."""
        return self.apply(text, self.detectors.find(text, lenient=lenient))

    def apply(self, text: str, findings: list[Finding]) -> tuple[str, list[Span]]:
        """Replaces `findings` (sorted, not overlapping) with the operator's tokens."""
        out: list[str] = []
        spans: list[Span] = []
        pos = 0
        length = 0
        op = self._ops[self.operator]
        for f in findings:
            out.append(text[pos:f.start])
            length += f.start - pos
            replacement = op(text[f.start:f.end], f.entity)
            spans.append(Span(f.entity, f.detector, DETECTOR_VERSION, self.operator, length,
                              length + len(replacement)))
            out.append(replacement)
            length += len(replacement)
            pos = f.end
        out.append(text[pos:])
        return "".join(out), spans

    @staticmethod
    def _mask(value: str, entity: str) -> str:
        if entity == "CARD":
            digits = re.sub(r"\D", "", value)
            return "*" * (len(digits) - 4) + digits[-4:]
        return "*" * len(value)

    def _hmac(self, value: str, entity: str) -> str:
        digest = hmac.new(self.key, value.encode(), hashlib.sha256).hexdigest()[:12]
        return f"<{entity}:{digest}>"


_SURROGATE = re.compile("[\ud800-\udfff]")
# Separators an identifier uses where text has spaces ("user-DE81-6307-…"): scanned again
# with them as spaces (one character for one, so positions hold).
_ID_SEPARATORS = re.compile(r"[-_:/]")
# Shapes a trace id keeps without the lenient pass: UUID, hex (W3C trace and span ids,
# uuid4().hex, digests) and ULID.
_ID_SHAPE = re.compile(r"^(?:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
                       r"|[0-9a-f]{16,64}|[0-7][0-9a-hjkmnp-tv-z]{25})$", re.IGNORECASE)
MAX_MODEL_NAME_CHARS = 256
MAX_PATH_CHARS = 2048
LONG_MODEL_NAME = "<LONG_MODEL_NAME>"


class MetadataRedactor:
    """Client-supplied identifiers on their way into the access log and the ledger.

    A trace id shaped like an id gets the strict pass, any other the lenient one; if either
    finds something the whole id is replaced by `redacted-<keyed digest>` (stable per
    device, so a client's repeated id still correlates). Installed model names are the
    operator's and kept; any other name gets the lenient pass with the configured operator.
    Paths (access log only) get the lenient pass too. Over-long values are cut before
    scanning, at a boundary that cannot split a value in two."""

    def __init__(self, redactor: Redactor, is_known_model: Callable[[str], bool]) -> None:
        self.redactor = redactor
        self.is_known_model = is_known_model

    def trace_id(self, value: str) -> str:
        value = _SURROGATE.sub("\ufffd", value)
        find = self.redactor.detectors.find
        if _ID_SHAPE.match(value):
            found = bool(find(value))
        else:
            found = bool(find(value, lenient=True)
                         or find(_ID_SEPARATORS.sub(" ", value), lenient=True))
        if not found:
            return value
        digest = hmac.new(self.redactor.key, value.encode(), hashlib.sha256).hexdigest()
        return f"redacted-{digest[:24]}"

    def model(self, value: str) -> str:
        try:
            if self.is_known_model(value):
                return value
        except Exception:  # an invalid name (too long, unencodable) is not installed
            pass
        value = _SURROGATE.sub("\ufffd", value)
        if len(value) > MAX_MODEL_NAME_CHARS:
            return LONG_MODEL_NAME  # a name is one word: no safe place to cut it
        return self._identifier(value)

    def path(self, value: str) -> str:
        value = _SURROGATE.sub("\ufffd", value)
        if len(value) > MAX_PATH_CHARS:  # cut at a "/" so no segment is split
            value = value[:value.rfind("/", 0, MAX_PATH_CHARS) + 1] + "..."
        return self._identifier(value)

    def _identifier(self, value: str) -> str:
        """The lenient pass, then again with separators read as spaces."""
        text = self.redactor.redact(value, lenient=True)[0]
        findings = self.redactor.detectors.find(_ID_SEPARATORS.sub(" ", text), lenient=True)
        return self.redactor.apply(text, findings)[0] if findings else text


def evaluate(detectors: Detectors, samples: list[dict[str, object]]
             ) -> dict[str, dict[str, float]]:
    """Per entity type: precision and recall of `detectors` on labelled samples, where a
    finding counts when its type matches and it covers exactly the labelled value."""
    tp: dict[str, int] = {}
    fp: dict[str, int] = {}
    fn: dict[str, int] = {}
    for sample in samples:
        text = str(sample["text"])
        labels = [(str(e["type"]), str(e["value"]))  # type: ignore[index]
                  for e in sample["entities"]]  # type: ignore[attr-defined]
        found = [(f.entity, text[f.start:f.end]) for f in detectors.find(text)]
        for item in found:
            bucket = tp if item in labels else fp
            bucket[item[0]] = bucket.get(item[0], 0) + 1
        for item in labels:
            if item not in found:
                fn[item[0]] = fn.get(item[0], 0) + 1
    out = {}
    for entity in sorted(set(tp) | set(fp) | set(fn)):
        t, p, n = tp.get(entity, 0), fp.get(entity, 0), fn.get(entity, 0)
        out[entity] = {"precision": t / (t + p) if t + p else 1.0,
                       "recall": t / (t + n) if t + n else 1.0, "tp": t, "fp": p, "fn": n}
    return out
