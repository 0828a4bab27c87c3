"""What the stand-in end-to-end tests share (test_standin_tensorrt.py, test_standin_pytorch.py): the demo spec turned
into a GPU target's spec on this machine's stack (`stoker` itself and the run's manifest: operate_helpers)."""

from __future__ import annotations

import uuid

import yaml
from operate_helpers import free_base_port

from stoker.demo import DEMO_SPEC

NGC_IMAGE = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"  # what the stand-in replaces


def gpu_spec_data(local_stack, target: str, prefix: str, **deploy) -> dict:
    """The demo spec as `target` on two H100s (surge), on the stack's Hub mirror and S3, on free ports."""
    data = yaml.safe_load(DEMO_SPEC.read_text())
    base = free_base_port()
    data.pop("adapters")  # the engine's adapters: test_lora_served; target pytorch refuses them
    data.update(target=target, gpus={"type": "h100-80gb", "count": 2, "rollout": "surge"})
    data["model"]["endpoint"] = local_stack["hub"]
    data["storage"].update(endpoint_url=local_stack["s3"], bucket=f"{prefix}-{uuid.uuid4().hex[:8]}")
    data["deploy"].update(name=f"{prefix}-{uuid.uuid4().hex[:6]}", ports={"http": base, "grpc": base + 1,
                                                                           "metrics": base + 2},
                          image=NGC_IMAGE, settle_s=1, watch_s=3, **deploy)
    data["benchmark"].update({"concurrency": [1], "requests_per_level": 4, "output_tokens": 8})
    return data




# Run inside a stand-in backend (python3 -c): ranks() maps OMPI_COMM_WORLD_RANK to the pid of each tritonserver
# process the stand-in's mpirun started (the image has no ps or kill).
RANK_PIDS = """
import os
def ranks():
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
            argv0 = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")[0]
        except OSError:
            continue
        rank = [e[len(b"OMPI_COMM_WORLD_RANK="):] for e in env if e.startswith(b"OMPI_COMM_WORLD_RANK=")]
        if rank and argv0.endswith(b"tritonserver"):
            out[int(rank[0])] = int(pid)
    return out
"""


def rank_pids(container) -> dict[int, int]:
    """{MPI rank: pid in the container} of the tritonserver processes running in ``container`` now."""
    import json

    import docker

    try:
        r = container.exec_run(["python3", "-c", f"{RANK_PIDS}\nimport json\nprint(json.dumps(ranks()))"])
    except docker.errors.APIError:  # restarting: between the exit and the next start nothing runs in it
        return {}
    if r.exit_code != 0:
        return {}
    return {int(k): v for k, v in json.loads(r.output.decode()).items()}


def rank_commands(container, pids: dict[int, int]) -> dict[int, str]:
    """{MPI rank: its whole command line}, read from /proc in ``container``. Not `docker top`: that is the host's `ps`
    run by dockerd, whose width follows dockerd's own environment (COLUMNS=80 cuts a tritonserver command short)."""
    import json

    code = ("import json\nprint(json.dumps({r: open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ')"
            f".decode().strip() for r, p in {dict(pids)!r}.items()}}))")
    r = container.exec_run(["python3", "-c", code])
    assert r.exit_code == 0, r.output
    return {int(k): v for k, v in json.loads(r.output.decode()).items()}
