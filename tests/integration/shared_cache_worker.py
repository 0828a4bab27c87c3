"""A process reaching one shared-cache key (test_shared_cache.py starts several of these).

argv[1]: JSON {home, endpoint, bucket, prefix, ttl_s, step, key, counter, work_s, go}. Prints READY, waits for the
`go` file (so that processes reach the key together), then gets the entry through SharedStore; its produce
appends a line to `counter` (one line per real run), prints PRODUCING, works `work_s` seconds. Last line:
RESULT {"came_from": …, "digest": …}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from stoker.cache.shared import SharedStore  # noqa: E402
from stoker.spec.schema import Storage  # noqa: E402
from stoker.storage.store import StepStore  # noqa: E402


def main() -> None:
    a = json.loads(sys.argv[1])
    storage = Storage(bucket=a["bucket"], prefix=a["prefix"], endpoint_url=a["endpoint"], shared_cache=True,
                      cache_lease_s=a["ttl_s"])
    store = SharedStore(StepStore(Path(a["home"]) / "cache"), storage)

    def produce(out: Path) -> dict:
        with open(a["counter"], "a") as f:
            f.write(f"{os.getpid()}\n")
        print("PRODUCING", flush=True)
        time.sleep(a["work_s"])
        (out / "weights.bin").write_bytes(b"w" * 4096)
        (out / "sub").mkdir()
        (out / "sub" / "config.json").write_text('{"layers": 4}')
        (out / "ensemble" / "1").mkdir(parents=True)  # empty: Triton needs it, file records cannot carry it
        return {"made_by": os.getpid()}

    print("READY", flush=True)
    while not Path(a["go"]).exists():
        time.sleep(0.02)
    entry, came_from = store.get(a["step"], a["key"], produce, lambda line: print(line, flush=True))
    print("RESULT " + json.dumps({"came_from": came_from, "digest": entry.digest, "detail": entry.detail,
                                  "empty_dir": (entry.output_dir / "ensemble" / "1").is_dir()}), flush=True)


if __name__ == "__main__":
    main()
