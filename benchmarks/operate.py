"""Rollout and trigger numbers from the real-server integration tests; writes JSON.

    .venv/bin/python benchmarks/operate.py [OUT.json]   (default benchmarks/results/operate.json)

Runs tests/integration/test_operate_rollouts.py (failed requests per strategy under steady streamed load:
2 client threads, `reload` vs `replace`) and the signed-webhook end-to-end test (webhook → flow run
accepted / Running / Completed through a process worker), with STOKER_OPERATE_OUT pointing at the JSON.
Needs what those tests need: Docker + the CPU Triton image; ~8 min on 2 cores.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/integration/test_operate_rollouts.py::test_reload_and_replace_under_steady_load",
    "tests/integration/test_operate_triggers.py::test_signed_webhook_runs_build_and_deploy_on_the_worker",
]


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "benchmarks" / "results" / "operate.json").resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=ROOT,
                       env={**os.environ, "STOKER_OPERATE_OUT": str(out)})
    data = json.loads(out.read_text()) if out.exists() else {}
    data["meta"] = {"machine": f"{platform.node()} ({os.cpu_count()} CPUs)", "wall_s": round(time.time() - t0, 1),
                    "tests_passed": r.returncode == 0,
                    "note": "replace moves the endpoint to the standby ports; the load client follows it only "
                            "once the rollout returns (after the old container is stopped), so requests in that "
                            "window fail fast and are retried every 50 ms: its count is an upper bound."}
    out.write_text(json.dumps(data, indent=1, sort_keys=True))
    print(json.dumps(data, indent=1, sort_keys=True))
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
