"""OpenAI's presence_penalty, frequency_penalty and logit_bias → the fields of a ``Generation``. Pure.

TensorRT-LLM's `tensorrt_llm` model takes presence_penalty and frequency_penalty (FP32 [1]) and embedding_bias
(FP32 [vocab], added to the logits before the temperature: its penaltyKernels.cu). logit_bias names tokens by id
strings; here it becomes that dense vector, 0 for every token it does not name. The LLM-API model (TRT-LLM 1.2.1
all_models/llmapi) takes the two penalties as sampling_param_* inputs and has no bias input, so logit_bias asked
of it is refused rather than ignored.

One difference from OpenAI's definition: TensorRT-LLM counts a token's occurrences over the prompt and the output
(its kernel's context phase counts the input ids), OpenAI's over the output only. The reference runtime follows
TensorRT-LLM, since it stands in for the engine (stoker/runtime/generate.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .mapping import _Request, bad_request


def fields(req: _Request, vocab_size: int | None, llmapi: bool = False) -> dict[str, Any]:
    """``Generation`` fields for the request's penalties and bias (none when it asks for neither)."""
    out: dict[str, Any] = {}
    if req.presence_penalty:
        out["presence_penalty"] = float(req.presence_penalty)
    if req.frequency_penalty:
        out["frequency_penalty"] = float(req.frequency_penalty)
    if req.logit_bias:
        if llmapi:
            raise bad_request("'logit_bias' is not supported by this deployment: it serves TensorRT-LLM's LLM-API "
                              "model (target: pytorch), which has no bias input.", "logit_bias",
                              "unsupported_parameter")
        out["embedding_bias"] = embedding_bias(req.logit_bias, vocab_size)
    return out


def embedding_bias(logit_bias: dict[str, float], vocab_size: int | None) -> bytes:
    """The dense bias, FP32 little-endian [vocab_size] as raw bytes (the request tensor's contents)."""
    if vocab_size is None:
        raise bad_request("'logit_bias' is not supported by this deployment: its vocabulary size is not known.",
                          "logit_bias", "unsupported_parameter")
    bias = np.zeros(vocab_size, "<f4")
    for key, value in logit_bias.items():
        token = int(key) if key.isascii() and key.isdigit() else None
        if token is None or token >= vocab_size:
            raise bad_request(f"Invalid value for 'logit_bias': key {key!r} is not a token id of this model's "
                              f"vocabulary (0..{vocab_size - 1}).", "logit_bias")
        bias[token] = value
    return bias.tobytes()
