"""A Triton python-backend LLM with scripted timing, for accuracy tests and the client-ceiling benchmark.

It has the TensorRT-LLM ensemble's interface (text_input, max_tokens, optional stream/min_tokens/end_id/
temperature → text_output), is decoupled, and answers each request from its own thread: it waits
`first_token_s` after execute() saw the request, then sends one word ("tok<k> ") every `interval_s` on an
absolute schedule, so the true TTFT and ITL are known. `interval_s` 0 streams as fast as it can.
Requests asking for more than `max_output_tokens` are cut there silently, as TensorRT-LLM does at its
sequence limit. A prompt containing FAIL is answered with an error. With `timing_log` set, every request
appends one JSON line {"id", "text", "recv", "sends"} of server-side perf_counter stamps (same clock as the client
on one host), so tests can split a measured latency into server time and transport.
"""

from __future__ import annotations

from pathlib import Path

MODEL_PY = '''
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _param(config, name, default):
    return config.get("parameters", {}).get(name, {}).get("string_value", default)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.first = float(_param(config, "first_token_s", "0.05"))
        self.interval = float(_param(config, "interval_s", "0.01"))
        self.limit = int(_param(config, "max_output_tokens", "4096"))
        self.log = _param(config, "timing_log", "")
        self.lock = threading.Lock()

    def execute(self, requests):
        # Inputs are read here: their memory is not guaranteed to outlive execute().
        for request in requests:
            start = time.perf_counter()
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().ravel()[0].decode()
            count = int(pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy().ravel()[0])
            args = (start, request.get_response_sender(), text, min(count, self.limit), request.request_id())
            threading.Thread(target=self._serve, args=args, daemon=True).start()
        return None

    def _serve(self, start, sender, text, count, request_id):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if "FAIL" in text:
            time.sleep(self.first)
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("scripted failure")), flags=final)
            return
        if count <= 0:
            sender.send(flags=final)
            return
        sends = []
        for k in range(count):
            # Absolute deadlines, so scheduling jitter does not accumulate into the ITL.
            delay = start + self.first + k * self.interval - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            word = pb_utils.Tensor("text_output", np.array([[("tok%d " % k).encode()]], dtype=object))
            sends.append(time.perf_counter())
            sender.send(pb_utils.InferenceResponse(output_tensors=[word]), flags=final if k == count - 1 else 0)
        if self.log:
            with self.lock, open(self.log, "a") as f:
                f.write(json.dumps({"id": request_id, "text": text, "recv": start, "sends": sends}) + "\\n")
'''

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 8
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "min_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "end_id" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "temperature" data_type: TYPE_FP32 dims: [ 1 ] optional: true }}
]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "first_token_s" value {{ string_value: "{first_token_s}" }} }}
parameters {{ key: "interval_s" value {{ string_value: "{interval_s}" }} }}
parameters {{ key: "max_output_tokens" value {{ string_value: "{max_output_tokens}" }} }}
parameters {{ key: "timing_log" value {{ string_value: "{timing_log}" }} }}
"""


def write_model(
    repo: Path,
    name: str = "ensemble",
    first_token_s: float = 0.05,
    interval_s: float = 0.01,
    max_output_tokens: int = 4096,
    timing_log: Path | None = None,
) -> Path:
    """Write the scripted model into a Triton model repository; returns its folder."""
    folder = Path(repo) / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.py").write_text(MODEL_PY)
    (folder / "config.pbtxt").write_text(CONFIG.format(
        name=name, first_token_s=first_token_s, interval_s=interval_s, max_output_tokens=max_output_tokens,
        timing_log=str(timing_log or "")))
    return folder
