#!/usr/bin/env python3
"""Regenerates the JSONSchemaBench sample that `edge-agent bench structured-coverage` ships
(edge_agent/bench/serving/jsonschemabench/sample.jsonl) from a checkout of the dataset.

    git clone https://github.com/guidance-ai/jsonschemabench
    python tools/jsonschemabench_sample.py jsonschemabench --commit "$(git -C jsonschemabench
        rev-parse HEAD)"

Per category (each folder under data/), the files whose sha256 of "SEED/CATEGORY/NAME" is
smallest are taken, in that order: a seeded choice that a file added to or missing from a
copy of the dataset moves only if it would itself be chosen (the copy the shipped sample
was made from lacked one file; see the sample's README.md). The order is kept, so the
first N of a category are themselves a seeded sample (`--per-category N`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "edge_agent" / "bench" / "serving" / "jsonschemabench"
SEED = "edge-agent"
PER_CATEGORY = 25


def rank(seed: str, category: str, name: str) -> str:
    return hashlib.sha256(f"{seed}/{category}/{name}".encode()).hexdigest()


def choose(data: Path, per_category: int, seed: str) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for folder in sorted(p for p in data.iterdir() if p.is_dir()):
        names = sorted(p.name for p in folder.glob("*.json"))
        names.sort(key=lambda name: rank(seed, folder.name, name))
        for name in names[:per_category]:
            schema = json.loads((folder / name).read_text(encoding="utf-8"))
            rows.append({"category": folder.name, "file": f"data/{folder.name}/{name}",
                         "schema": schema})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a checkout of the dataset (holds data/)")
    parser.add_argument("--commit", required=True, help="the checkout's commit, recorded")
    parser.add_argument("--per-category", type=int, default=PER_CATEGORY)
    parser.add_argument("--seed", default=SEED)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    rows = choose(args.checkout / "data", args.per_category, args.seed)
    if not rows:
        print(f"no data/<category>/*.json under {args.checkout}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "sample.jsonl").open("w", encoding="utf-8") as f:
        # The first line says where the rest came from; every other line is one schema.
        f.write(json.dumps({"source": "https://github.com/guidance-ai/jsonschemabench",
                            "commit": args.commit, "seed": args.seed,
                            "per_category": args.per_category}) + "\n")
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"{len(rows)} schemas written to {args.out / 'sample.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
