"""Reading the ledger for people and scripts: durations, stats, export formats."""

from __future__ import annotations

import csv
import io
import json
import math
import re
import time
from collections.abc import Iterable
from typing import Any

from edge_agent.ledger.store import COLUMNS

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str) -> float:
    """'1h', '30m', '7d' → an epoch timestamp that long ago."""
    m = _DURATION.match(text.strip())
    if not m:
        raise ValueError(f"'{text}' is not a duration like 30m, 1h or 7d")
    return time.time() - float(m.group(1)) * _SECONDS[m.group(2)]


def _pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def stats(rows: Iterable[dict[str, Any]], by: str) -> list[dict[str, Any]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row.get(by) or "-", []).append(row)
    out = []
    for key, items in sorted(groups.items()):
        ttft = [r["ttft_ms"] for r in items if r.get("ttft_ms") is not None]
        tpot = [r["tpot_ms"] for r in items if r.get("tpot_ms")]
        out.append({
            by: key, "requests": len(items),
            "errors": sum(1 for r in items if (r.get("status") or 0) >= 400),
            "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in items),
            "completion_tokens": sum(r.get("completion_tokens") or 0 for r in items),
            "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p95_ms": _pct(ttft, 0.95),
            "tpot_p50_ms": _pct(tpot, 0.5), "tpot_p95_ms": _pct(tpot, 0.95),
            # the apps' verdicts on the answers (`ledger.feedback`), the latest per request
            "feedback_good": sum(1 for r in items if r.get("feedback") == "good"),
            "feedback_bad": sum(1 for r in items if r.get("feedback") == "bad"),
        })
    return out


def export(rows: Iterable[dict[str, Any]], fmt: str) -> Iterable[str]:
    if fmt == "jsonl":
        for row in rows:
            yield json.dumps(row, ensure_ascii=False) + "\n"
        return
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(COLUMNS))
    writer.writeheader()
    yield buf.getvalue()
    for row in rows:
        buf.seek(0)
        buf.truncate()
        writer.writerow(row)
        yield buf.getvalue()


def line(row: dict[str, Any]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["ts"]))
    ttft = f"{row['ttft_ms']:.0f}ms" if row.get("ttft_ms") is not None else "-"
    tokens = f"{row.get('prompt_tokens') or 0}+{row.get('completion_tokens') or 0}"
    return (f"{when} {row['status']} {row.get('tenant') or '-':<8} {row.get('model') or '-':<16} "
            f"{row['endpoint']:<22} tokens {tokens:<9} ttft {ttft:<7} total "
            f"{row.get('total_ms') or 0:.0f}ms {row.get('error_type') or ''} {row['trace_id']}")
