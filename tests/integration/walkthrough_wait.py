"""Wait, as a user watching the UI would, for the build of deployment NAME to finish; print it as JSON.

Used between the Operate commands of docs/triggers.md by test_operate_walkthrough.py (reads PREFECT_API_URL and
its auth from the environment the section's `source` line set). Exit 1 unless the run completed.
"""

from __future__ import annotations

import json
import sys
import time


def main(name: str, timeout_s: float) -> int:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    deadline = time.monotonic() + timeout_s
    from prefect.exceptions import PrefectHTTPStatusError

    with get_client(sync_client=True) as client:
        while True:
            try:
                runs = client.read_flow_runs(deployment_filter=DeploymentFilter(
                    name=DeploymentFilterName(any_=["stoker-cpu"])))
            except PrefectHTTPStatusError as err:
                # A busy server's 500 (seen under a loaded CI): a user watching the UI would reload the page.
                if err.response.status_code < 500 or time.monotonic() > deadline:
                    raise
                time.sleep(2)
                continue
            mine = [r for r in runs if (r.parameters.get("spec") or {}).get("deploy", {}).get("name") == name]
            final = [r for r in mine if r.state is not None and r.state.is_final()]
            if final:
                run = final[0]
                print(json.dumps({"name": name, "flow_run_id": str(run.id), "state": run.state.type.value,
                                  "message": run.state.message, "created": run.created.timestamp(),
                                  "start": run.start_time.timestamp() if run.start_time else None,
                                  "end": run.end_time.timestamp() if run.end_time else None,
                                  "revision": run.parameters["spec"]["model"]["revision"],
                                  "runs": len(mine)}))
                return 0 if run.state.is_completed() else 1
            if time.monotonic() > deadline:
                print(json.dumps({"name": name, "state": "timeout", "runs": len(mine)}))
                return 1
            time.sleep(2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 900))
