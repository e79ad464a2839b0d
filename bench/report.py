"""What every benchmark does with its record: a timestamped JSON under bench/results/ and a
markdown summary beside the scripts, printed too."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def save(kind: str, record: dict, summary_name: str, summary: str, at: datetime | None = None) -> Path:
    """Write bench/results/<kind>-<UTC time ``at``, default now>.json and bench/<summary_name>;
    print the summary; return the JSON's path."""
    stamp = (at or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    results = BENCH_DIR / "results" / f"{kind}-{stamp}.json"
    results.parent.mkdir(exist_ok=True)
    results.write_text(json.dumps(record, indent=2) + "\n")
    (BENCH_DIR / summary_name).write_text(summary)
    print(summary)
    return results
