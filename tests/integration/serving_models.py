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


# The pytorch target's layout (`llmapi`): one decoupled python model, `tensorrt_llm`, with the contract of
# TensorRT-LLM's LLM-API model (stoker/protocol.py LLMAPI; its config is the one stoker renders,
# stoker/gpu/llmapi.config): text_input, streaming, sampling_param_max_tokens, exclude_input_from_output,
# return_finish_reason; every streamed response carries the whole text so far, the last one flagged final.
# Scripted like the ensemble above: "<tag>:<i> " per token, the same modes, the same in-flight gauge.
LLMAPI_MODEL = """\
import os
import signal
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

TAG, MODE, ARG, INTERVAL = {tag!r}, {mode!r}, {arg!r}, {interval!r}
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _value(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    v = t.as_numpy().reshape(-1)[0]
    return v.decode() if isinstance(v, bytes) else v.item()


class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily(name="stoker_requests_in_flight", description="begun, not answered",
                                            kind=pb_utils.MetricFamily.GAUGE)
        self.in_flight = self.family.Metric(labels={{"model": "tensorrt_llm"}})
        if MODE == "hang":
            time.sleep(3600)
        if MODE == "exit_after":
            threading.Timer(ARG, lambda: os.kill(1, signal.SIGTERM)).start()

    def execute(self, requests):
        # Answered in execute, as the ensemble above (2 instances): no thread outlives the call.
        self.in_flight.increment(len(requests))
        for request in requests:
            got = {{"n": int(_value(request, "sampling_param_max_tokens", 32)),
                    "streaming": bool(_value(request, "streaming", False)),
                    "prefix": "" if _value(request, "sampling_param_exclude_input_from_output", False)
                    else _value(request, "text_input", ""),
                    "with_finish": bool(_value(request, "return_finish_reason", False))}}
            self._serve(got, request.get_response_sender())
        return None

    def _serve(self, got, sender):
        try:
            if MODE == "raise":
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("model raising on purpose")),
                            flags=FINAL)
                return
            n, streaming, with_finish = got["n"], got["streaming"], got["with_finish"]
            text = got["prefix"]
            for i in range(n):
                if INTERVAL:
                    time.sleep(INTERVAL)
                text += f"{{TAG}}:{{i}} "
                last = i == n - 1
                if streaming or last:
                    out = [pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))]
                    if with_finish:
                        out.append(pb_utils.Tensor("finish_reason",
                                                   np.array([b"length" if last else b"None"], dtype=np.object_)))
                    sender.send(pb_utils.InferenceResponse(output_tensors=out), flags=FINAL if last else 0)
            if n <= 0:
                sender.send(flags=FINAL)
        finally:
            self.in_flight.increment(-1)
"""


def write_llmapi_repo(root: Path, tag: str, mode: str = "ok", arg: float = 0.0, interval_s: float = 0.0,
                      instances: int = 2) -> Path:
    from google.protobuf import text_format

    from stoker.gpu import llmapi

    model = root / llmapi.MODEL_NAME
    (model / "1").mkdir(parents=True)
    from stoker.spec.load import parse_spec

    # The config stoker renders for a pytorch spec (decoupled, as its model.yaml's triton_config says too).
    cfg = llmapi.config(parse_spec({"model": {"repo_id": "a/b"}, "storage": {"bucket": "unused"}, "target": "pytorch",
                                    "gpus": {"type": "h100-80gb", "count": 1}}))
    assert cfg.model_transaction_policy.decoupled
    cfg.instance_group[0].count = instances
    (model / "config.pbtxt").write_text(text_format.MessageToString(cfg))
    (model / "1" / "model.py").write_text(LLMAPI_MODEL.format(tag=tag, mode=mode, arg=arg, interval=interval_s))
    return root
