"""A tiny ``ensemble`` (TensorRT-LLM's text interface) whose behaviour a test chooses, for promotion tests.

It streams ``max_tokens`` responses ``"<tag>:<i> "`` at ``interval_s``, so a client can tell which
backend answered. Modes make the faults real: ``raise`` answers every request with an error,
``exit_after`` makes Triton itself exit that many seconds after the model loaded (ready, then gone),
``hang`` never finishes loading (never ready). Like stoker's reference ``tensorrt_llm`` model it reports the
requests it has begun and not yet answered as the gauge ``stoker_requests_in_flight``, which retire reads.
Also publishes repositories to a real S3 server.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CONFIG = """\
name: "ensemble"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] }},
  {{ name: "max_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true }},
  {{ name: "stream", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }}
]
output [ {{ name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: {instances} }} ]
"""

MODEL = """\
import os
import signal
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

TAG, MODE, ARG, INTERVAL = {tag!r}, {mode!r}, {arg!r}, {interval!r}


class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily(name="stoker_requests_in_flight", description="begun, not answered",
                                            kind=pb_utils.MetricFamily.GAUGE)
        self.in_flight = self.family.Metric(labels={{"model": "ensemble"}})
        if MODE == "hang":
            time.sleep(3600)
        if MODE == "exit_after":
            # tritonserver is PID 1 of the container: SIGTERM makes it shut down, as a crash would end it.
            threading.Timer(ARG, lambda: os.kill(1, signal.SIGTERM)).start()

    def execute(self, requests):
        self.in_flight.increment(len(requests))
        for request in requests:
            sender = request.get_response_sender()
            if MODE == "raise":
                self.in_flight.increment(-1)
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("model raising on purpose")),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            n = pb_utils.get_input_tensor_by_name(request, "max_tokens")
            n = int(n.as_numpy().reshape(-1)[0]) if n is not None else 4
            for i in range(n):
                if INTERVAL:
                    time.sleep(INTERVAL)
                out = pb_utils.Tensor("text_output", np.array([f"{{TAG}}:{{i}} ".encode()], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            self.in_flight.increment(-1)
        return None
"""


# Stand-ins for the other models of TensorRT-LLM's layout, so a `reload` rollout (which loads
# preprocessing, tensorrt_llm, postprocessing, then ensemble) finds every name it loads.
STANDIN_CONFIG = """\
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""
STANDIN_MODEL = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""


def write_repo(root: Path, tag: str, mode: str = "ok", arg: float = 0.0, interval_s: float = 0.0,
               instances: int = 2, full_layout: bool = False) -> Path:
    model = root / "ensemble"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG.format(instances=instances))
    (model / "1" / "model.py").write_text(MODEL.format(tag=tag, mode=mode, arg=arg, interval=interval_s))
    for name in ("preprocessing", "tensorrt_llm", "postprocessing") if full_layout else ():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(STANDIN_CONFIG.format(name=name))
        (root / name / "1" / "model.py").write_text(STANDIN_MODEL)
    return root


def repo_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def publish(s3, bucket: str, s3_endpoint: str, root: Path) -> tuple[str, str]:
    """Upload ``root`` under its digest; returns (repository_uri, digest)."""
    digest = repo_digest(root)
    for p in sorted(root.rglob("*")):
        if p.is_file():
            s3.upload_file(str(p), bucket, f"{digest[:16]}/{p.relative_to(root).as_posix()}")
    return f"s3://{s3_endpoint.removeprefix('http://')}/{bucket}/{digest[:16]}", digest
