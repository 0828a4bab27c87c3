"""The candidate, scored through its own served endpoint: Triton's `tensorrt_llm` model over gRPC.

Token ids go in as they are (no tokenizer round trip), so the candidate is scored on exactly the
positions the baseline was. The model is decoupled, so requests go over one bidirectional
stream_infer stream, kept open for the whole evaluation, one request at a time.
"""

from __future__ import annotations

import queue
from functools import partial

import numpy as np
import tritonclient.grpc as grpcclient

from .data import EvalSet
from .metrics import next_token_log_probs, perplexity

MODEL = "tensorrt_llm"
_TYPES = {np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL"}


class EndpointError(RuntimeError):
    pass


class Scorer:
    """One stream to the candidate's `tensorrt_llm`; use as a context manager."""

    def __init__(self, grpc_url: str, timeout_s: float = 120.0) -> None:
        self._client = grpcclient.InferenceServerClient(grpc_url)
        self._answers: queue.Queue = queue.Queue()
        self._timeout_s = timeout_s
        self._client.start_stream(callback=partial(_put, self._answers))

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc) -> None:
        self._client.stop_stream()
        self._client.close()

    def _ask(self, inputs: dict[str, np.ndarray]) -> list:
        tensors = []
        for name, data in inputs.items():
            t = grpcclient.InferInput(name, list(data.shape), _TYPES[data.dtype])
            t.set_data_from_numpy(data)
            tensors.append(t)
        self._client.async_stream_infer(MODEL, tensors, enable_empty_final_response=True)
        out = []
        while True:
            try:
                result, error = self._answers.get(timeout=self._timeout_s)
            except queue.Empty:
                raise EndpointError(f"{MODEL} gave no answer within {self._timeout_s:.0f} s") from None
            if error is not None:
                raise EndpointError(f"{MODEL}: {error}")
            if result.get_response().outputs:
                out.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out

    def window_log_probs(self, ids: list[int]) -> list[float]:
        """Next-token log probs of a window from its context logits (one generated token, not used)."""
        answers = self._ask({**_prompt(ids, 1), "return_context_logits": np.array([[True]])})
        logits = next((a.as_numpy("context_logits") for a in answers if a.as_numpy("context_logits") is not None),
                      None)
        if logits is None:
            raise EndpointError(f"{MODEL} returned no context_logits (does the build gather them?)")
        return next_token_log_probs(logits[0][: len(ids)], ids).tolist()

    def greedy(self, ids: list[int], tokens: int) -> list[int]:
        """`tokens` greedy tokens (min_tokens keeps end_id back; a stop id still ends early, as served)."""
        answers = self._ask({**_prompt(ids, tokens), "runtime_top_k": np.array([[1]], np.int32),
                             "min_tokens": np.array([[tokens]], np.int32), "streaming": np.array([[False]])})
        out: list[int] = []
        for a in answers:
            seq, n = a.as_numpy("output_ids"), a.as_numpy("sequence_length")
            out += seq.reshape(-1)[: int(n.reshape(-1)[0])].tolist()
        return out


def _put(answers: queue.Queue, result, error) -> None:
    answers.put((result, error))


def _prompt(ids: list[int], output_len: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
            "request_output_len": np.array([[output_len]], np.int32),
            "exclude_input_in_output": np.array([[True]])}


def score(grpc_url: str, evalset: EvalSet, log=None) -> dict:
    """Perplexity over the windows and greedy outputs for the prompts, from the candidate as served."""
    with Scorer(grpc_url) as scorer:
        windows = [scorer.window_log_probs(w) for w in evalset.windows]
        if log:
            log(f"evaluate: {len(windows)} perplexity windows scored through the endpoint")
        greedy = [scorer.greedy(p, evalset.greedy_tokens) for p in evalset.prompts]
    return {"window_log_probs": windows, "perplexity": perplexity(windows), "greedy": greedy}
