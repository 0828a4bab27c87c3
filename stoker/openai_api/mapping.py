"""OpenAI's API ⇄ Triton's `tensorrt_llm` model: requests, streamed token ids, text, response bodies. Pure.

A request maps onto one streamed request to `tensorrt_llm` per choice (TensorRT-LLM's tensor interface,
stoker/triton/models/tensorrt_llm.py): the prompt's token ids in, one response per generated token
out. Token ids travel both ways, so ``usage`` counts what the model read and wrote, with no text
round trip; the end ids and stop ids of the build are the model's own defaults (its
stoker_runtime.json), exactly as through the ensemble.

    OpenAI                    Triton (tensorrt_llm, streaming)
    prompt / messages         input_ids INT32 [1, L], input_lengths INT32 [1, 1] (tokenized here)
    max_tokens                request_output_len INT32 [1, 1]
    temperature, top_p        temperature FP32, runtime_top_p FP32 [1, 1]; temperature 0 or top_p 0: greedy
    seed                      seed UINT64 [1, 1] (a fresh random seed when the request has none)
    stop                      matched in the detokenized text here; the stream is cancelled at a match
    min_tokens, ignore_eos    min_tokens INT32 [1, 1] (vLLM's extra fields; ignore_eos: min_tokens = max_tokens):
                              the end id cannot end the output sooner; stop ids and stop sequences still do
    n                         1..MAX_CHOICES: one such request per choice (choices.py), seed + index each
    presence_penalty,         presence_penalty, frequency_penalty FP32 [1, 1] (TensorRT-LLM's kernel: the prompt's
    frequency_penalty         tokens count too, unlike OpenAI's definition; sampling.py)
    logit_bias                embedding_bias FP32 [1, vocab]: each named token's bias, 0 elsewhere (sampling.py)
    logprobs, top_logprobs    return_log_probs BOOL [1, 1] → output_log_probs; k alternatives: return_top_log_probs
                              INT32 [1, 1] → top_log_prob_ids, top_log_probs (the reference model's own: logprobs.py)
    response_format           guided_decoding_guide_type, guided_decoding_guide BYTES [1, 1] (structured.py)
    tools, tool_choice        the chat template's tools; a forced call: a guide as response_format's (tools.py)
    usage                     len(input_ids), number of output_ids received

With TensorRT-LLM's LLM-API model (`llmapi` layout, triton_stream.llmapi_request) the prompt goes as text:

    OpenAI                    Triton (tensorrt_llm of the llmapi layout; every input [1])
    prompt / messages         text_input BYTES (chat template applied here); prompt tokens counted by encoding it
    max_tokens                sampling_param_max_tokens INT32
    temperature, top_p, seed  sampling_param_temperature FP32, sampling_param_top_p FP32, sampling_param_seed UINT64;
                              greedy (temperature or top_p 0): sampling_param_top_k INT32 = 1 and none of them
    presence_penalty,         sampling_param_presence_penalty, sampling_param_frequency_penalty FP32
    frequency_penalty
    logit_bias                refused (400): the model (1.2.1) has no bias input
    n                         one request per choice, as for the ensemble
    (always)                  streaming, sampling_param_exclude_input_from_output, return_finish_reason: true
    stop                      cut here from the text (not sent: see llmapi_request)
    min_tokens, ignore_eos    refused (400): the model has no such input
    logprobs, top_logprobs    refused (400): the model returns only a cumulative log prob (logprobs.py)
    response_format           refused (400) unless text: the model (1.2.1) has no guide input (structured.py)
    response                  text_output: the whole output so far (its new part taken); finish_reason
    usage                     completion tokens: the returned text encoded (the model returns no token ids)

Errors are ``ApiError``s carrying OpenAI's error body and the HTTP status. This module holds the OpenAI side
(requests, errors, response bodies); the Triton side, from a parsed request to streamed text, is triton_stream.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

MODEL_NAME = "tensorrt_llm"
# The legacy completions API's default, as OpenAI's and vLLM's.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Chat without max_tokens may use the whole context; without a known context, this many.
DEFAULT_CHAT_MAX_TOKENS = 1024
MAX_STOP_SEQUENCES = 4
# Each stop sequence is searched in the text as it streams, and text that could still begin one is held back
# (triton_stream.StopCut): a bound keeps one request from making that per-token work, and the held-back tail, large.
# OpenAI documents no bound; 256 characters hold any phrase a stop sequence is used for (issue 51).
MAX_STOP_CHARS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")
UINT64_MASK = (1 << 64) - 1
# The most choices (`n`) one request may ask for: each is a sequence of its own in the backend's in-flight batch
# (choices.py), and 8 is the reference model's default batch, so one request cannot queue behind itself there.
MAX_CHOICES = 8

# Parameters of OpenAI's API this server does not implement: refused unless they carry a value that
# means "off", so a client never silently gets something other than what it asked for.
UNSUPPORTED = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}


# ---------------------------------------------------------------- errors


class ApiError(Exception):
    """A request that fails with OpenAI's error body and an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unknown_model(name: str) -> ApiError:
    return ApiError(404, f"The model `{name}` does not exist or you do not have access to it.",
                    "invalid_request_error", "model", "model_not_found")


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "server_error", None, "backend_unavailable")


# What gRPC metadata may carry as an ASCII value (printable ASCII, space included): the service forwards the
# client's authorization header to Triton as metadata, and gRPC refuses the whole call for any other byte.
_METADATA_VALUE = re.compile(r"[\x20-\x7e]*")
# Twice the longest key a deployment takes (stoker/serving/api_keys.py: 512 characters) with its scheme: far below
# Triton's 8 KiB limit on a call's metadata, past which gRPC refuses the call (RESOURCE_EXHAUSTED).
MAX_AUTHORIZATION = 1024


def authorization(value: str | None) -> str | None:
    """The client's authorization header, to forward as gRPC metadata; 401 for one no API key can be (a byte
    outside printable ASCII, or over MAX_AUTHORIZATION characters: each a 500 from gRPC before, found by the
    fuzzer)."""
    if value is None:
        return None
    problem = ("holds characters outside printable ASCII" if not _METADATA_VALUE.fullmatch(value)
               else f"is over {MAX_AUTHORIZATION} characters" if len(value) > MAX_AUTHORIZATION else None)
    if problem:
        raise ApiError(401, f"Incorrect API key: the authorization header {problem}; send authorization: Bearer KEY.",
                       "invalid_request_error", None, "invalid_api_key")
    return value


def backend_error(message: str) -> ApiError:
    return ApiError(500, message, "server_error", None, "backend_error")


# ---------------------------------------------------------------- requests


class _Loose(BaseModel):
    # Unknown fields are ignored (as vLLM does); those that would change the answer are in UNSUPPORTED.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Loose):
    include_usage: StrictBool = False


class ContentPart(_Loose):
    type: StrictStr
    text: StrictStr | None = None


class Message(_Loose):
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: StrictStr | None = None  # a tool message's (tools.messages)


class _Request(_Loose):
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    # OpenAI's ranges; mapped onto TensorRT-LLM's presence_penalty / frequency_penalty / embedding_bias (sampling.py).
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[StrictStr, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # vLLM's extensions, honoured because benchmarks (AIPerf, stoker bench) send them for an exact output length.
    min_tokens: StrictInt | None = None
    ignore_eos: StrictBool | None = None


class ChatRequest(_Request):
    messages: list[Message]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None  # 0..20, with logprobs (logprobs.asked)


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None  # the legacy API's: 0..5 alternatives per token (logprobs.asked)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _where(loc: Sequence[Any]) -> str:
    """pydantic's error location as OpenAI names parameters (``messages[0].role``), without union branch tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out


def _from_validation(err: ValidationError) -> ApiError:
    first = err.errors()[0]
    where = _where(first["loc"])
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{where}'.", where, "missing_required_parameter")
    return bad_request(f"Invalid value for '{where}': {first['msg']}.", where,
                       "invalid_type" if first["type"].endswith("_type") else "invalid_value")


# A \uD800-\uDFFF escape: JSON's syntax allows one alone, but it is no Unicode text (see parse_json).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _is_unicode(obj: Any) -> bool:
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object."""
    try:
        obj = json.loads(raw)
    # RecursionError: nesting deeper than the parser's stack ("[" * 100_000) is malformed input, not a server fault.
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise bad_request("We could not parse the JSON body of your request. The body must be valid JSON "
                          "(Content-Type: application/json).", None, "invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_json")
    # A lone surrogate would fail the tokenizer, or the encoding of an error body that quotes it (a 500).
    # Checked only when the raw body holds such an escape, so an ordinary body costs one regex scan.
    if _SURROGATE_ESCAPE.search(raw) and not _is_unicode(obj):
        raise bad_request("The request body holds a string that is not valid Unicode (an unpaired surrogate "
                          "escape, \\uD800-\\uDFFF).", None, "invalid_json")
    return obj


def _common_checks(obj: dict, req: _Request) -> None:
    for name, allowed in UNSUPPORTED.items():
        if name in obj and obj[name] not in allowed:
            raise bad_request(f"'{name}' is not supported by this server.", name, "unsupported_parameter")
    if req.n is not None and req.n != 1:
        if req.n < 1:
            raise bad_request(f"Invalid value for 'n': {req.n} is less than the minimum of 1.", "n")
        if req.n > MAX_CHOICES:
            raise bad_request(f"n = {req.n} is not supported: this server returns at most {MAX_CHOICES} choices per "
                              "request.", "n", "unsupported_value")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"'stop' has {len(stops)} sequences; at most {MAX_STOP_SEQUENCES} are allowed.", "stop")
    for stop in stops:
        if isinstance(stop, str) and len(stop) > MAX_STOP_CHARS:
            raise bad_request(f"A 'stop' sequence is {len(stop)} characters; at most {MAX_STOP_CHARS} are allowed.",
                              "stop")
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")


def parse_chat(obj: dict) -> ChatRequest:
    try:
        req = ChatRequest.model_validate(obj)
    except ValidationError as err:
        raise _from_validation(err) from None
    _common_checks(obj, req)
    if not req.messages:
        raise bad_request("'messages' must contain at least one message.", "messages", "empty_array")
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise bad_request(f"Invalid value: '{m.role}'. Supported values are: "
                              + ", ".join(f"'{r}'" for r in ROLES) + ".", f"messages[{i}].role")
        if m.content is None and m.role != "assistant":
            raise bad_request(f"Missing required parameter: 'messages[{i}].content'.", f"messages[{i}].content",
                              "missing_required_parameter")
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type != "text" or part.text is None:
                raise bad_request(f"content part type '{part.type}' is not supported: only 'text' is.",
                                  f"messages[{i}].content[{j}].type", "unsupported_value")
    return req


def parse_completion(obj: dict) -> CompletionRequest:
    try:
        req = CompletionRequest.model_validate(obj)
    except ValidationError as err:
        raise _from_validation(err) from None
    _common_checks(obj, req)
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) != 1:
        raise bad_request(f"'prompt' holds {len(p)} prompts; this server takes one prompt per request.",
                          "prompt", "unsupported_value")
    return req


def chat_messages(req: ChatRequest) -> list[dict]:
    """Messages as chat templates read them: text content, `developer` as `system` (as for OpenAI's models)."""
    out = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text or "" for p in m.content or [])
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt: text, or token ids used as they are."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        p = p[0]
    return p


def stop_sequences(req: _Request) -> tuple[str, ...]:
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return tuple(s for s in stops if s)


# ---------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class Head:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str
    fingerprint: str | None

    def fields(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}


# ``logprobs`` below: the choice's log probs in OpenAI's shape (logprobs.py), None when not asked for.


def chat_response(head: Head, text: str, finish: str, use: dict, logprobs: dict | None = None) -> dict:
    return {**head.fields("chat.completion"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                         "logprobs": logprobs, "finish_reason": finish}],
            "usage": use}


def chat_chunk(head: Head, delta: dict, finish: str | None, with_usage: bool, logprobs: dict | None = None) -> dict:
    out = {**head.fields("chat.completion.chunk"),
           "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
    if with_usage:
        out["usage"] = None
    return out


def completion_response(head: Head, text: str, finish: str, use: dict, logprobs: dict | None = None) -> dict:
    return {**head.fields("text_completion"),
            "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
            "usage": use}


def completion_chunk(head: Head, text: str, finish: str | None, with_usage: bool,
                     logprobs: dict | None = None) -> dict:
    out = {**head.fields("text_completion"),
           "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}]}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(head: Head, obj: str, use: dict) -> dict:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    return {**head.fields(obj), "choices": [], "usage": use}


def model_card(name: str, created: int, extra: dict | None = None) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "stoker", **(extra or {})}


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
