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


