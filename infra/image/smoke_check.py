"""Runs inside the freshly imported image (python3 -): waits for Triton, infers once."""
import json
import sys
import time
import urllib.error
import urllib.request

BASE = "http://127.0.0.1:8000"
deadline = time.monotonic() + 90
while True:
    try:
        with urllib.request.urlopen(f"{BASE}/v2/health/ready", timeout=2) as r:
            if r.status == 200:
                break
    except (urllib.error.URLError, OSError):
        pass
    if time.monotonic() > deadline:
        sys.exit("smoke: tritonserver not ready after 90 s")
    time.sleep(0.5)

body = json.dumps({"inputs": [{"name": "X", "shape": [3], "datatype": "FP32", "data": [1, 2, 3.5]}]})
req = urllib.request.Request(f"{BASE}/v2/models/smoke_imports/infer", data=body.encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=30) as r:
    outputs = {o["name"]: o["data"] for o in json.load(r)["outputs"]}
if outputs["SUM"] != [6.5]:
    sys.exit(f"smoke: wrong SUM {outputs['SUM']}")
print(f"smoke: ready, infer ok, {outputs['VERSIONS'][0]}")
