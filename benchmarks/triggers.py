"""The three triggers, timed from trigger to serving, on real servers; writes JSON.

    .venv/bin/python benchmarks/triggers.py [OUT.json]
    (default OUT: benchmarks/results/triggers.json; ~10 min on 2 cores)

Runs the tests that exercise each trigger as a user meets it, with STOKER_OPERATE_OUT set so that each records
its timings (tests/integration/operate_helpers.py `record`):
- scheduled: tests/integration/test_schedule_fires.py — a commit pushed to the Hub mirror until the build the
  *scheduler* started serves, on the PostgreSQL server (the test builds it only when STOKER_OPERATE_OUT is set; CI
  holds it), and until that build is started on the SQLite server, whose pool always holds it (watcher interval
  15 s here; 300 s in prefect.yaml, which adds up to one interval);
- manual and webhook: tests/integration/test_operate_walkthrough.py, the Operate section of docs/triggers.md verbatim —
  `prefect deployment run watch_revisions/watch` until the build it started serves, and the example CI job's
  POST until the webhook's build serves (its re-run answered with the first run).
Each is one run: a count of 1, reported as such. Builds differ (the walkthrough's are fp8 and int4_awq with
evaluation; the schedule test's is unquantized without evaluation), so compare each trigger with itself.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/integration/test_schedule_fires.py", "tests/integration/test_operate_walkthrough.py"]


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks" / "results" / "triggers.json"
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.json"
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=ROOT,
                           env={**os.environ, "STOKER_OPERATE_OUT": str(raw)})
        wall = time.monotonic() - t0
        measured = json.loads(raw.read_text()) if raw.exists() else {}
    result = {
        "what": "trigger → serving, seconds, one run each (see benchmarks/triggers.py)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "tests_passed": r.returncode == 0,
        "wall_s": round(wall, 1),
        "runs_per_trigger": 1,
        "scheduled": {db: measured.get(f"schedule_{db}") for db in ("sqlite", "postgres")},
        "manual_tick_to_serving_s": (measured.get("triggers_walkthrough") or {}).get("watcher_tick_to_serving_s"),
        "webhook_post_to_serving_s": (measured.get("triggers_walkthrough") or {}).get("webhook_post_to_serving_s"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if r.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
