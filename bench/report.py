"""What every benchmark does with its record: a timestamped JSON under bench/results/ and a
markdown summary beside the scripts, printed too."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def save(
    kind: str, record: dict, summary_name: str, summarize: Callable[[dict], str], at: datetime | None = None
) -> Path:
    """Write bench/results/<kind>-<UTC time ``at``, default now>.json, with its own path in the
    record's ``results_file``, and bench/<summary_name>, written by ``summarize`` from the record;
    print the summary; return the JSON's path."""
    stamp = (at or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    results = BENCH_DIR / "results" / f"{kind}-{stamp}.json"
    record["results_file"] = str(results.relative_to(BENCH_DIR.parent))
    summary = summarize(record)
    results.parent.mkdir(exist_ok=True)
    results.write_text(json.dumps(record, indent=2) + "\n")
    (BENCH_DIR / summary_name).write_text(summary)
    print(summary)
    return results


BUSY_SECONDS = 2.0
OTHER_WORK_CORES = 0.25  # busier than this before a run, and its figures are not the machine's alone


def busy_cores(seconds: float = BUSY_SECONDS) -> float:
    """How many cores were busy over the next ``seconds``, from /proc/stat, while the caller waits:
    other work on the machine, where a 1-minute load average would still count the bench's own
    work of the minute before."""

    def busy_and_total() -> tuple[int, int]:
        ticks = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = ticks[3] + ticks[4]  # idle and iowait
        return sum(ticks) - idle, sum(ticks)

    busy_before, total_before = busy_and_total()
    time.sleep(seconds)
    busy_after, total_after = busy_and_total()
    return (busy_after - busy_before) / (total_after - total_before) * os.cpu_count()


def other_work_line(busy: list[float], when: str) -> str:
    """A results file's line on other work: the cores ``busy_cores`` found busy ``when``."""
    shown = ", ".join(f"{cores:.2f}" for cores in busy)
    competing = " (other work was competing for the cores)" if max(busy) > OTHER_WORK_CORES else ""
    return f"- cores busy in the {BUSY_SECONDS:.0f} s {when}, the bench waiting: {shown}{competing}"
