"""STAND-IN, NOT TensorRT-LLM: a Triton python model with the contract of TensorRT-LLM 1.2.1's `llmapi` model.

Installed in the stand-in image (infra/standin) where stoker's `llmapi` shim looks for upstream's model
(/app/all_models/llmapi/tensorrt_llm/1/model.py), so a `target: pytorch` repository rendered for a GPU host loads
unchanged: config.pbtxt, model.yaml and the shim that wraps `get_sampling_params_from_request` with the model's
stop ids. Where upstream starts `tensorrt_llm.LLM(**model.yaml)` on the checkpoint, this generates with stoker's
CPU reference runtime (the `stoker_runtime` package beside this file, in-flight batching) from the stand-in build
at model.yaml's `model` (the reference artifact, tokenizer.json included). It proves stoker around the LLM API,
never the LLM API.

The contract, as upstream's model.py and helpers.py define it (read at TensorRT-LLM 1.2.1):
- model.yaml (LLM_CONFIG_PATH, default model.yaml, in the model's version folder): `triton_config` gives
  `decoupled` and `max_batch_size` to Triton through auto_complete_config and `cancellation_check_period_ms`
  (default 100) to the model; the other keys are LLM(...) arguments, of which this reads `model` (the checkpoint)
  and `max_batch_size` (the in-flight batch, capped at 8 on a CPU).
- Inputs: text_input (one prompt), streaming (default false), sampling_param_{max_tokens, temperature, top_k,
  top_p, seed, stop, exclude_input_from_output (default false), frequency_penalty, presence_penalty, best_of,
  return_perf_metrics}, return_{finish_reason, stop_reason, cumulative_logprob} (default false), stop (true: cancel
  the requests of this request id).
- Outputs: text_output, the whole output so far in every response (RequestOutput.outputs[0].text), the prompt in
  front unless exclude_input_from_output; finish_reason / stop_reason / cumulative_logprob as str() when asked
  ("None" until the request ends, then "stop" or "length"). Streaming sends one response per generated token, the
  last flagged final; not streaming, one response at the end. A failure answers with an error response.
- Sampling: no top_k and no top_p (or both 0) is greedy, as TensorRT-LLM's sampling defaults; else temperature
  (default 1.0) with top-k / top-p. max_tokens defaults to 32 (SamplingParams' default). `stop` strings end the
  output before them; `stop_token_ids` (the shim's, from the model's other eos ids) and the end id end it too.
  frequency_penalty / presence_penalty go to the runtime, which applies them as TensorRT-LLM's sampling kernels do
  (stoker_runtime.generate's docstring). best_of > 1 is refused (the runtime returns one sequence per request).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

# The runtime (torch, transformers) is imported by initialize only: Triton auto-completes this model's config in
# a stub process of its own first (auto_complete_config), which needs model.yaml and nothing of torch.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
DEFAULT_MAX_TOKENS = 32
SAMPLING_ARGS = ("best_of", "temperature", "top_k", "top_p", "frequency_penalty", "presence_penalty", "max_tokens",
                 "seed", "exclude_input_from_output", "return_perf_metrics")
OUTPUT_FLAGS = ("return_finish_reason", "return_stop_reason", "return_cumulative_logprob")
IN_FLIGHT_METRIC = "stoker_requests_in_flight"


class RequestError(ValueError):
    """The request is invalid; its message goes back to the client."""


def _config_doc(name: str | None = None) -> dict:
    path = Path(pb_utils.get_model_dir()) / (name or os.environ.get("LLM_CONFIG_PATH", "model.yaml"))
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise pb_utils.TritonModelException(f"model.yaml unreadable at {path}: {exc}") from None
    if not isinstance(doc, dict) or "triton_config" not in doc:
        raise pb_utils.TritonModelException(f"{path} has no triton_config section")
    return doc


# The names upstream's model.py imports from its helpers.py; stoker's shim replaces the sampling one at module level,
# so requests look it up here each time.
def get_input_tensor_by_name(request: Any, name: str) -> Any:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _scalar(request: Any, name: str) -> Any:
    value = get_input_tensor_by_name(request, name)
    if value is None:
        return None
    if value.size != 1:
        raise RequestError(f"Expected a scalar tensor for tensor {name}")
    return value.reshape(-1)[0].item()


def get_sampling_params_from_request(request: Any) -> dict:
    params = {arg: v for arg in SAMPLING_ARGS if (v := _scalar(request, f"sampling_param_{arg}")) is not None}
    params.setdefault("best_of", 1)
    params.setdefault("exclude_input_from_output", False)
    params.setdefault("return_perf_metrics", False)
    params["stop"] = get_input_tensor_by_name(request, "sampling_param_stop")
    return params


def get_output_config_from_request(request: Any) -> dict:
    return {flag: bool(_scalar(request, flag) or False) for flag in OUTPUT_FLAGS}


def get_streaming_from_request(request: Any) -> bool:
    return bool(_scalar(request, "streaming") or False)


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _runtime_kwargs(params: dict) -> dict:
    """SamplingParams fields onto the reference runtime's `generate` arguments."""
    if int(params.get("best_of") or 1) != 1:
        raise RequestError("best_of > 1 is not served by the stand-in")
    penalties = {name: float(params.get(name) or 0.0) for name in ("frequency_penalty", "presence_penalty")}
    top_k = int(params.get("top_k") or 0)
    top_p = float(params.get("top_p") or 0.0)
    if top_k < 0 or not 0.0 <= top_p <= 1.0:
        raise RequestError(f"top_k must be >= 0 and top_p in [0, 1], got {top_k} and {top_p}")
    seed = int(params.get("seed") or 0)
    if top_k == 0 and top_p == 0.0:
        return {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": seed, **penalties}
    temperature = 1.0 if params.get("temperature") is None else float(params["temperature"])
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}")
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p or 1.0, "seed": seed, **penalties}


class _Request:
    """One request, parsed: the prompt, its ids, the sampling, the stop strings, what to send back."""

    def __init__(self, request: Any, tokenizer: Any, defaults: tuple[int, list[list[int]]]) -> None:
        text = get_input_tensor_by_name(request, "text_input")
        if text is None:
            raise RequestError("text_input is missing from the request")
        if text.size != 1:
            raise RequestError("text_input must hold one prompt")
        self.prompt = _text(text.reshape(-1)[0])
        # A module global, looked up at each call: the shim replaces it with a wrapper that adds stop_token_ids.
        params = get_sampling_params_from_request(request)
        self.streaming = get_streaming_from_request(request)
        self.outputs = get_output_config_from_request(request)
        self.exclude_input = bool(params.get("exclude_input_from_output"))
        self.max_tokens = int(params.get("max_tokens") or DEFAULT_MAX_TOKENS)
        stop = params.get("stop")
        self.stop = [s for s in (_text(v) for v in np.asarray(stop).reshape(-1)) if s] if stop is not None else []
        end_id, stop_ids = defaults
        ids = params.get("stop_token_ids")
        self.stop_words = [[int(i)] for i in ids] if ids else stop_ids
        self.kwargs = _runtime_kwargs(params)
        self.input_ids = tokenizer.encode(self.prompt).ids
        self.end_id = end_id


class TritonPythonModel:
    """Generates with the reference runtime behind the LLM API model's contract (module docstring)."""

    @classmethod
    def auto_complete_config(cls, auto_complete_model_config: Any) -> Any:
        triton = _config_doc()["triton_config"]
        auto_complete_model_config.set_model_transaction_policy({"decoupled": bool(triton["decoupled"])})
        auto_complete_model_config.set_max_batch_size(int(triton["max_batch_size"]))
        return auto_complete_model_config

    def initialize(self, args: dict[str, str]) -> None:
        from stoker_runtime.batch import DEFAULT_MAX_BATCH, Batcher
        from stoker_runtime.model import RUNTIME_FILE, load_model
        from tokenizers import Tokenizer

        doc = _config_doc()
        triton = doc["triton_config"]
        self.decoupled = bool(triton["decoupled"])
        weights = Path(doc["model"])
        if not weights.is_absolute():
            weights = Path(pb_utils.get_model_dir()) / weights
        if not (weights / RUNTIME_FILE).is_file():
            raise pb_utils.TritonModelException(
                f"{weights} is not a stand-in build (no {RUNTIME_FILE}): the stand-in serves stoker's reference "
                "artifact, not a checkpoint for TensorRT-LLM")
        self.model = load_model(weights, num_threads=int(os.environ.get("STOKER_STANDIN_THREADS", "2")))
        self.tokenizer = Tokenizer.from_file(str(weights / "tokenizer.json"))
        stop_ids = json.loads((weights / RUNTIME_FILE).read_text()).get("stop_ids", [])
        self.defaults = (self.model.info.end_id, [[int(i)] for i in stop_ids])
        batch = max(1, min(int(doc.get("max_batch_size") or DEFAULT_MAX_BATCH), DEFAULT_MAX_BATCH))
        self.batcher = Batcher(self.model, max_batch=batch).start()
        self.pool = ThreadPoolExecutor(max_workers=4 * batch + 4, thread_name_prefix="stoker-llmapi")
        self.lock = threading.Lock()
        self.by_user_id: dict[str, set[Any]] = {}
        self.stopping = threading.Event()
        try:
            self.family = pb_utils.MetricFamily(name=IN_FLIGHT_METRIC, kind=pb_utils.MetricFamily.GAUGE,
                                                description="requests begun and not yet answered")
            self.gauge = self.family.Metric(labels={"model": args.get("model_name", "tensorrt_llm")})
        except Exception:  # noqa: BLE001 -- metrics off: serving goes on without the gauge
            self.gauge = None
        pb_utils.Logger.log_info(
            f"tensorrt_llm (llmapi STAND-IN, reference runtime): {weights}, {self.model.architecture}, decoupled "
            f"{self.decoupled}, in-flight batch {batch}, end_id {self.defaults[0]}, stop ids {stop_ids}")

    def _in_flight(self, n: int) -> None:
        if self.gauge is not None:
            with self.lock:
                self.gauge.increment(n)

    def _response(self, req: _Request, text: str, finish: str | None) -> Any:
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        if req.outputs["return_finish_reason"]:
            tensors.append(pb_utils.Tensor("finish_reason", np.array([str(finish)], dtype=np.object_)))
        if req.outputs["return_stop_reason"]:
            tensors.append(pb_utils.Tensor("stop_reason", np.array(["None"], dtype=np.object_)))
        if req.outputs["return_cumulative_logprob"]:
            tensors.append(pb_utils.Tensor("cumulative_logprob", np.array(["None"], dtype=np.object_)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _generate(self, request: Any, req: _Request, send) -> None:
        """Run one request; `send(text, finish)` for each response (finish None until the last)."""
        try:
            stream = self.batcher.submit(req.input_ids, req.max_tokens, req.end_id, stop_words=req.stop_words,
                                         **req.kwargs)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        user_id = request.request_id()
        if user_id:
            with self.lock:
                self.by_user_id.setdefault(user_id, set()).add(stream)
        ids: list[int] = []
        prefix = "" if req.exclude_input else req.prompt
        text, finish = "", "length"

        def check() -> None:
            if self.stopping.is_set() or request.is_cancelled():
                raise _Cancelled("Request cancelled by client" if not self.stopping.is_set() else "shutting down")

        try:
            for token in stream.tokens(check=check):
                ids.append(token)
                new = self.tokenizer.decode(ids, skip_special_tokens=True)
                cut = min((i for i in (new.find(s) for s in req.stop) if i >= 0), default=-1)
                if cut >= 0:
                    text, finish = new[:cut], "stop"
                    stream.cancel()
                    break
                text = new
                if req.streaming and not new.endswith("\ufffd"):
                    send(prefix + text, None)
            else:
                # The budget ran out (length) unless the end id or a stop id ended it first.
                finish = "length" if len(ids) >= req.max_tokens and not _stopped_by(ids, req) else "stop"
        finally:
            stream.cancel()
            if user_id:
                with self.lock:
                    self.by_user_id.get(user_id, set()).discard(stream)
        send(prefix + text, finish)

    def _serve(self, request: Any) -> None:
        sender = request.get_response_sender()
        try:
            if bool(_scalar(request, "stop") or False):
                self._stop_request(request)
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "Request cancelled by client", pb_utils.TritonError.CANCELLED)), flags=FINAL)
                return
            req = _Request(request, self.tokenizer, self.defaults)
            if req.streaming and not self.decoupled:
                raise RequestError("Streaming is only supported in decoupled mode.")
            if req.streaming:
                def send(text: str, finish: str | None) -> None:
                    sender.send(self._response(req, text, finish), flags=FINAL if finish is not None else 0)
            else:
                def send(text: str, finish: str | None) -> None:
                    if finish is not None:
                        sender.send(self._response(req, text, finish), flags=FINAL)
            self._generate(request, req, send)
        except Exception as exc:  # noqa: BLE001 -- every failure goes back as a response
            if isinstance(exc, _Cancelled):
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.CANCELLED)
            elif isinstance(exc, RequestError):
                error = pb_utils.TritonError(f"Error generating request: {exc}", pb_utils.TritonError.INVALID_ARG)
            else:
                pb_utils.Logger.log_error(f"tensorrt_llm (llmapi stand-in): {type(exc).__name__}: {exc}")
                error = pb_utils.TritonError(f"Error generating request: {type(exc).__name__}: {exc}")
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        finally:
            self._in_flight(-1)

    def _stop_request(self, request: Any) -> None:
        user_id = request.request_id()
        if not user_id:
            raise RequestError("A request id must be provided for request cancellation")
        with self.lock:
            streams = list(self.by_user_id.get(user_id, ()))
        for stream in streams:
            stream.cancel()

    def execute(self, requests: list[Any]) -> list[Any] | None:
        self._in_flight(len(requests))
        if not self.decoupled:
            return [self._answer(r) for r in requests]
        for request in requests:
            self.pool.submit(self._serve, request)
        return None

    def _answer(self, request: Any) -> Any:
        """A non-decoupled model's one response (no streaming)."""
        out: list[Any] = []
        try:
            req = _Request(request, self.tokenizer, self.defaults)
            if req.streaming:
                raise RequestError("Streaming is only supported in decoupled mode.")
            self._generate(request, req, lambda text, finish: out.append(self._response(req, text, finish))
                           if finish is not None else None)
            return out[-1]
        except Exception as exc:  # noqa: BLE001 -- every failure goes back as a response
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"Error generating request: {exc}"))
        finally:
            self._in_flight(-1)

    def finalize(self) -> None:
        self.stopping.set()
        self.pool.shutdown(wait=True)
        self.batcher.stop()


class _Cancelled(Exception):
    """The client cancelled the request or the model is shutting down."""


def _stopped_by(ids: list[int], req: _Request) -> bool:
    """The last token is a stop id (the end id is never yielded, so a shorter output already says stop)."""
    return bool(ids) and [ids[-1]] in req.stop_words
