"""`stoker webhook serve` as its own process, for the fuzzer (benchmarks/fuzz.py, tests/integration/test_fuzz_api.py):
plain HTTP on a free loopback port, over a specs folder holding the demo spec as ``tiny``. PREFECT_API_URL names a
port nothing listens on, so a valid signed trigger gets as far as starting its run and is answered the documented
503 ("could not start"); the rate limit is raised so a fuzzer is not answered 429 throughout."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WEBHOOK_SECRET = "fuzz-webhook-secret-0123456789"


@contextlib.contextmanager
def webhook_receiver(root: Path, secret: str = WEBHOOK_SECRET) -> Iterator[tuple[str, subprocess.Popen]]:
    """`stoker webhook serve` on a free loopback port over a specs folder with the demo spec as ``tiny``; yields
    (its /hooks/build URL, the process)."""
    import httpx
    import yaml

    from stoker.demo import DEMO_SPEC
    from stoker.stack.services import free_port

    specs = root / "specs"
    specs.mkdir(parents=True, exist_ok=True)
    spec = yaml.safe_load(DEMO_SPEC.read_text())
    base = free_port()
    spec["deploy"] = {"name": "fuzz-tiny", "ports": {"http": base, "grpc": base + 1, "metrics": base + 2}}
    (specs / "tiny.yaml").write_text(yaml.safe_dump(spec))
    port = free_port()
    log = open(root / "webhook.log", "wb")
    env = {**os.environ, "STOKER_WEBHOOK_SECRET": secret, "PYTHONPATH": str(ROOT),
           "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # nothing listens there: a run cannot start (503)
    proc = subprocess.Popen([sys.executable, "-m", "stoker.cli", "webhook", "serve", "--specs", str(specs),
                             "--deployment", "build_and_deploy/fuzz-never-started", "--port", str(port),
                             "--rate", "10000", "--burst", "10000", "--window", "300"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the webhook receiver exited: {(root / 'webhook.log').read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the webhook receiver did not answer within 60 s")
            time.sleep(0.2)
        yield f"{url}/hooks/build", proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)
