"""The lm-eval adapter's link to a served endpoint: the `tensorrt_llm` model over one persistent gRPC stream
(decoupled models answer only on stream_infer), and the scoring of a continuation from its logits.

Token ids in, token ids and logits out, in TensorRT-LLM's tensor interface, so the same client scores the CPU
reference and an engine built with gather_context_logits. Requests go one at a time.
"""

from __future__ import annotations

import itertools
import queue

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stoker.errors import StokerError, TransientError

MODEL = "tensorrt_llm"
_DTYPES = {np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL", np.dtype(np.uint64): "UINT64"}


class ServedModelError(StokerError):
    """The served model refused a request or answered something unusable."""


def continuation_log_prob(logits: np.ndarray, continuation: list[int]) -> tuple[float, bool]:
    """(sum of the continuation's log probs, whether each token is the argmax), from the logits rows that
    predict the continuation's tokens (row i predicts continuation[i]); float64 log-softmax over the vocab."""
    rows = np.asarray(logits, dtype=np.float64)
    if rows.shape[0] != len(continuation):
        raise ValueError(f"{rows.shape[0]} logits rows for {len(continuation)} continuation tokens")
    top = rows.max(axis=-1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(rows - top).sum(axis=-1))
    picked = rows[np.arange(len(continuation)), continuation]
    return float((picked - log_z).sum()), bool((rows.argmax(axis=-1) == np.asarray(continuation)).all())


class TritonLLMClient:
    """One gRPC connection and one open stream to a Triton server's `tensorrt_llm` model."""

    def __init__(self, grpc_url: str, model: str = MODEL, timeout_s: float = 300.0,
                 lora_task_id: int | None = None) -> None:
        # lora_task_id: every request asks for that LoRA adapter of the build (None: the base model)
        self.model, self.timeout_s, self.lora_task_id = model, timeout_s, lora_task_id
        self._client = grpcclient.InferenceServerClient(grpc_url)
        try:
            ready = self._client.is_model_ready(model)
        except InferenceServerException as exc:
            self._client.close()
            raise TransientError(f"Triton at {grpc_url} does not answer: {exc.message()}") from None
        if not ready:
            self._client.close()
            raise ServedModelError(f"model {model!r} is not ready on {grpc_url}")
        self._responses: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: self._responses.put((result, error)))
        self._ids = itertools.count()

    def close(self) -> None:
        self._client.stop_stream()
        self._client.close()

    def __enter__(self) -> TritonLLMClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _infer(self, inputs: dict[str, np.ndarray]):  # -> grpcclient.InferResult
        """Send one request on the stream; its one response with outputs, read up to the final flag."""
        tensors = []
        for name, data in inputs.items():
            tensor = grpcclient.InferInput(name, list(data.shape), _DTYPES[data.dtype])
            tensor.set_data_from_numpy(data)
            tensors.append(tensor)
        request_id = str(next(self._ids))
        self._client.async_stream_infer(self.model, tensors, request_id=request_id, enable_empty_final_response=True)
        answer = None
        while True:
            try:
                result, error = self._responses.get(timeout=self.timeout_s)
            except queue.Empty:
                raise TransientError(f"{self.model} sent nothing for {self.timeout_s:.0f}s") from None
            if error is not None:
                raise ServedModelError(f"{self.model}: {error.message() if hasattr(error, 'message') else error}")
            response = result.get_response()
            if response.id != request_id:
                continue  # the tail of an earlier request that ended in an error
            if response.outputs:
                answer = result
            if response.parameters["triton_final_response"].bool_param:
                if answer is None:
                    raise ServedModelError(f"{self.model} ended request {request_id} without outputs")
                return answer

    def _request(self, ids: list[int], max_new_tokens: int, **flags: bool) -> dict[str, np.ndarray]:
        if not ids:
            raise ValueError("empty prompt")
        adapter = {} if self.lora_task_id is None else {"lora_task_id": np.array([[self.lora_task_id]], np.uint64)}
        return {**adapter, "input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
                "request_output_len": np.array([[max_new_tokens]], np.int32),
                "runtime_top_k": np.array([[1]], np.int32),  # greedy, in the reference and in TensorRT-LLM
                "streaming": np.array([[False]]), "exclude_input_in_output": np.array([[True]]),
                **{name: np.array([[value]]) for name, value in flags.items()}}

    def context_logits(self, ids: list[int]) -> np.ndarray:
        """The model's logits for every prompt position, [len(ids), vocab] (row i predicts ids[i + 1])."""
        # One generated token is the least a request may ask for; it is ignored.
        result = self._infer(self._request(ids, 1, return_context_logits=True))
        logits = result.as_numpy("context_logits")
        if logits is None or logits.shape[:2] != (1, len(ids)):
            shape = None if logits is None else logits.shape
            raise ServedModelError(f"{self.model} returned context_logits of shape {shape} for {len(ids)} tokens")
        return logits[0]

    def generate(self, ids: list[int], max_new_tokens: int, min_tokens: int = 0) -> list[int]:
        """Greedy continuation of ``ids``, up to max_new_tokens or the model's end id (not returned);
        `min_tokens` holds the end id back that long (TensorRT-LLM's min_tokens; stop words still end it)."""
        request = self._request(ids, max_new_tokens)
        if min_tokens:
            request["min_tokens"] = np.array([[min_tokens]], np.int32)
        result = self._infer(request)
        n = int(result.as_numpy("sequence_length")[0, 0])
        return result.as_numpy("output_ids")[0, 0, :n].tolist()
