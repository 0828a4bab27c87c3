"""A parsed OpenAI request ⇄ one streamed request to Triton's `tensorrt_llm`: the generation it asks for (lengths
checked, OpenAI's defaults filled), the gRPC request, each streamed response, and the text cut at stop sequences.

Two interfaces (stoker.protocol): the ensemble's `tensorrt_llm` takes token ids and streams token ids
(``triton_request``, ``parse_response``, ``TextStream``); TensorRT-LLM's LLM-API python model (`llmapi` layout,
the pytorch target) takes text and streams the whole output text so far (``llmapi_request``,
``parse_llmapi_response``, ``CumulativeText``). The LLM API's names, and the rule that takes the new part of its
cumulative text, are stoker.protocol's (``_protocol``). The mapping tables are in mapping.py, with the OpenAI side.
Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import service_pb2

# stoker.protocol itself: this package runs where stoker is not installed, so it reads that file through a link
# beside it (_protocol.py -> ../protocol.py), which its copy in the container holds as a file.
from . import _protocol as protocol
from . import logprobs
from .mapping import (DEFAULT_CHAT_MAX_TOKENS, DEFAULT_COMPLETION_MAX_TOKENS, MODEL_NAME, UINT64_MASK, ChatRequest,
                      _Request, bad_request, stop_sequences)
from .structured import Guide

# The serving interfaces by layout name, as live.json and --interface give them.
ENSEMBLE, LLMAPI = protocol.ENSEMBLE.layout, protocol.LLMAPI.layout
INTERFACES = tuple(protocol.INTERFACES)
LLMAPI_MODEL = protocol.LLMAPI.model


@dataclass(frozen=True)
class Generation:
    """One request to `tensorrt_llm`, decided: what goes in and how to sample."""

    input_ids: tuple[int, ...]
    max_tokens: int
    greedy: bool
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    min_tokens: int = 0  # the end id is held back this long (0: may end at once)
    prompt_text: str | None = None  # the prompt as text (the LLM API's model takes text; input_ids then count it)
    lora_task_id: int | None = None  # a LoRA adapter of the build (its task id); None: the base model
    log_probs: int | None = None  # log probs with this many alternatives per token (logprobs.asked); None: none
    guide: Guide | None = None  # structured output (response_format): TensorRT-LLM's guided-decoding inputs
    # TensorRT-LLM's penalties (0: off) and embedding_bias, FP32 little-endian [vocab] raw bytes (sampling.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    embedding_bias: bytes | None = None


def plan(req: _Request, input_ids: Sequence[int], context_len: int | None, *, seed: int,
         vocab_size: int | None = None, interface: str = ENSEMBLE, prompt_text: str | None = None,
         max_input_len: int | None = None) -> Generation:
    """Validate lengths against the model's context and fill OpenAI's defaults.

    ``seed`` is used when the request has none (OpenAI samples afresh each time unless seeded).
    ``interface``: the backend's (``ensemble`` or ``llmapi``); the LLM API's model has no input that holds the
    end id back, so min_tokens / ignore_eos asked of it are refused rather than ignored.
    """
    k = logprobs.asked(req)
    if interface == LLMAPI:
        _refuse_min_tokens(req)
        refused = logprobs.refusal(req, k, llmapi=True, top_served=False)
        if refused is not None:
            raise refused
    chat = isinstance(req, ChatRequest)
    where = "messages" if chat else "prompt"
    n_prompt = len(input_ids)
    if n_prompt == 0:
        raise bad_request(f"'{where}' is empty: it tokenizes to no tokens.", where)
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in input_ids):
        raise bad_request(f"'prompt' holds token ids outside the vocabulary (0..{vocab_size - 1}).", "prompt")
    asked = req.max_completion_tokens if chat and req.max_completion_tokens is not None else req.max_tokens
    name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
    if asked is not None and asked < 1:
        raise bad_request(f"Invalid value for '{name}': {asked} is less than the minimum of 1.", name)
    if context_len is not None and n_prompt >= context_len:
        raise bad_request(f"This model's maximum context length is {context_len} tokens. However, your "
                          f"{where} resulted in {n_prompt} tokens. Please reduce the length of the {where}.",
                          where, "context_length_exceeded")
    if max_input_len is not None and n_prompt > max_input_len:
        raise bad_request(f"This deployment accepts prompts of at most {max_input_len} tokens (its build's "
                          f"max_input_len). However, your {where} resulted in {n_prompt} tokens. Please reduce the "
                          f"length of the {where}.", where, "context_length_exceeded")
    if asked is None:
        if not chat:
            asked = DEFAULT_COMPLETION_MAX_TOKENS if context_len is None else min(DEFAULT_COMPLETION_MAX_TOKENS,
                                                                                  context_len - n_prompt)
        else:
            asked = DEFAULT_CHAT_MAX_TOKENS if context_len is None else context_len - n_prompt
    elif context_len is not None and n_prompt + asked > context_len:
        raise bad_request(f"This model's maximum context length is {context_len} tokens. However, you requested "
                          f"{n_prompt + asked} tokens ({n_prompt} in the {where}, {asked} in the completion). "
                          f"Please reduce the length of the {where} or completion.", name, "context_length_exceeded")
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    top_p = 1.0 if req.top_p is None else float(req.top_p)
    return Generation(input_ids=tuple(int(t) for t in input_ids), max_tokens=int(asked),
                      greedy=temperature == 0.0 or top_p == 0.0, temperature=temperature, top_p=top_p,
                      seed=(seed if req.seed is None else req.seed) & UINT64_MASK, stop=stop_sequences(req),
                      min_tokens=_min_tokens(req, int(asked)), prompt_text=prompt_text, log_probs=k)


def _refuse_min_tokens(req: _Request) -> None:
    for name, value, off in (("min_tokens", req.min_tokens, (None, 0)), ("ignore_eos", req.ignore_eos, (None, False))):
        if value not in off:
            raise bad_request(f"'{name}' is not supported by this deployment: it serves TensorRT-LLM's LLM-API model "
                              "(target: pytorch), which has no input that holds the end of the output back.", name,
                              "unsupported_parameter")


def _min_tokens(req: _Request, max_tokens: int) -> int:
    """How long the end id is held back: ``min_tokens``, or all of ``max_tokens`` with ``ignore_eos`` (vLLM's rules)."""
    if req.min_tokens is not None and req.min_tokens < 0:
        raise bad_request(f"Invalid value for 'min_tokens': {req.min_tokens} is less than the minimum of 0.",
                          "min_tokens")
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must be less than or equal to max_tokens ({max_tokens}).",
                          "min_tokens")
    return max_tokens if req.ignore_eos else (req.min_tokens or 0)


def _tensor(request: service_pb2.ModelInferRequest, name: str, datatype: str, shape: list[int], raw: bytes) -> None:
    t = request.inputs.add()
    t.name, t.datatype = name, datatype
    t.shape.extend(shape)
    request.raw_input_contents.append(raw)


def triton_request(gen: Generation, request_id: str, model: str = MODEL_NAME) -> service_pb2.ModelInferRequest:
    """The streamed `tensorrt_llm` request for ``gen``; end ids and stop ids stay the build's defaults."""
    r = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    ids = np.asarray(gen.input_ids, "<i4")
    _tensor(r, "input_ids", "INT32", [1, ids.size], ids.tobytes())
    _tensor(r, "input_lengths", "INT32", [1, 1], np.int32(ids.size).astype("<i4").tobytes())
    _tensor(r, "request_output_len", "INT32", [1, 1], np.int32(gen.max_tokens).astype("<i4").tobytes())
    _tensor(r, "streaming", "BOOL", [1, 1], b"\x01")
    if not gen.greedy:
        _tensor(r, "temperature", "FP32", [1, 1], np.float32(gen.temperature).astype("<f4").tobytes())
        _tensor(r, "runtime_top_p", "FP32", [1, 1], np.float32(gen.top_p).astype("<f4").tobytes())
    _tensor(r, "seed", "UINT64", [1, 1], np.uint64(gen.seed).astype("<u8").tobytes())
    if gen.min_tokens:
        _tensor(r, "min_tokens", "INT32", [1, 1], np.int32(gen.min_tokens).astype("<i4").tobytes())
    if gen.lora_task_id is not None:
        _tensor(r, "lora_task_id", "UINT64", [1, 1], np.uint64(gen.lora_task_id).astype("<u8").tobytes())
    for name, value in (("presence_penalty", gen.presence_penalty), ("frequency_penalty", gen.frequency_penalty)):
        if value:
            _tensor(r, name, "FP32", [1, 1], np.float32(value).astype("<f4").tobytes())
    if gen.embedding_bias is not None:
        _tensor(r, "embedding_bias", "FP32", [1, len(gen.embedding_bias) // 4], gen.embedding_bias)
    for name, raw in gen.guide.tensors() if gen.guide is not None else ():
        _tensor(r, name, "BYTES", [1, 1], raw)
    r.outputs.add().name = "output_ids"
    if gen.log_probs is not None:
        _tensor(r, "return_log_probs", "BOOL", [1, 1], b"\x01")
        r.outputs.add().name = "output_log_probs"
    if gen.log_probs:  # only the reference model declares these (logprobs.py): the app checked it does
        _tensor(r, "return_top_log_probs", "INT32", [1, 1], np.int32(gen.log_probs).astype("<i4").tobytes())
        r.outputs.add().name = "top_log_prob_ids"
        r.outputs.add().name = logprobs.TOP_OUTPUT
    # The stream ends with an empty response flagged final, so the end is seen even without tokens.
    r.parameters["triton_enable_empty_final_response"].bool_param = True
    return r


def _bytes_tensor(request: service_pb2.ModelInferRequest, name: str, values: Sequence[str]) -> None:
    """A BYTES tensor [len(values)]: each element its 4-byte little-endian length, then its UTF-8 bytes."""
    raw = b"".join(len(b).to_bytes(4, "little") + b for b in (v.encode("utf-8") for v in values))
    _tensor(request, name, "BYTES", [len(values)], raw)


def _scalar(request: service_pb2.ModelInferRequest, name: str | None, datatype: str, value: bool | int | float) -> None:
    """One value as a [1] tensor (the LLM API's config declares dims [1] with max_batch_size 0)."""
    if name is None:
        raise ValueError(f"the {protocol.LLMAPI.layout} interface names no input for this {datatype} value")
    kind = {"BOOL": "?", "INT32": "<i4", "FP32": "<f4", "UINT64": "<u8"}[datatype]
    _tensor(request, name, datatype, [1], np.asarray([value], kind).tobytes())


def llmapi_request(gen: Generation, request_id: str, model: str = LLMAPI_MODEL) -> service_pb2.ModelInferRequest:
    """The streamed request to TensorRT-LLM's LLM-API model (TRT-LLM 1.2.1 all_models/llmapi) for ``gen``.

    Its config declares every input with dims [1] and max_batch_size 0, so each scalar is a [1] tensor. The prompt
    goes as text (the model tokenizes it, with its tokenizer's special tokens). Greedy is asked as top_k = 1 with no
    temperature and no top_p: TensorRT-LLM decodes greedily when top_k is 1 in every sampler it has (a temperature
    of 0 is not accepted by all of them). Stop sequences are not sent as ``sampling_param_stop``: stoker's shim
    (stoker/gpu/llmapi.py) adds the model's extra end ids only to requests that name no stop strings of their own,
    so sending them would let e.g. Llama 3.1's <|eot_id|> run on; they are cut here, from the text, as for the
    ensemble. No min_tokens: the model has no such input (``plan`` refuses it).
    """
    if gen.prompt_text is None:
        raise ValueError("the LLM API's model takes the prompt as text: the generation has none")
    i = protocol.LLMAPI
    r = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    _bytes_tensor(r, i.text_input, [gen.prompt_text])
    _scalar(r, i.stream, "BOOL", True)
    _scalar(r, i.max_tokens, "INT32", gen.max_tokens)
    for name, value in i.always:  # the prompt left out of the output, the finish reason asked for: flags
        if not isinstance(value, bool):
            raise ValueError(f"{name}: the {i.layout} interface's fixed inputs are flags, not {value!r}")
        _scalar(r, name, "BOOL", value)
    if gen.greedy:
        _scalar(r, i.top_k, "INT32", 1)
    else:
        _scalar(r, i.temperature, "FP32", gen.temperature)
        _scalar(r, i.top_p, "FP32", gen.top_p)
        _scalar(r, i.seed, "UINT64", gen.seed)
    for name, value in ((i.presence_penalty, gen.presence_penalty), (i.frequency_penalty, gen.frequency_penalty)):
        if value:
            _scalar(r, name, "FP32", value)
    if gen.embedding_bias is not None:
        raise ValueError(f"the {i.layout} interface has no bias input (sampling.fields refuses logit_bias for it)")
    r.outputs.add().name = i.text_output
    if i.finish_reason:
        r.outputs.add().name = i.finish_reason
    # A stream cancelled or ended without a last response still ends with an empty one flagged final.
    r.parameters["triton_enable_empty_final_response"].bool_param = True
    return r


@dataclass(frozen=True)
class Step:
    """One streamed response: new token ids, whether it is the last, or Triton's error.

    From the LLM API's model: ``text``, the whole output so far, and ``finish``, its finish_reason ("None" until
    the end, then TensorRT-LLM's: "stop", "length", "timeout", "cancelled")."""

    token_ids: tuple[int, ...]
    final: bool
    error: str | None = None
    text: str | None = None
    finish: str | None = None
    log_probs: tuple[float, ...] | None = None  # per token, when asked (output_log_probs)
    top: tuple[tuple[tuple[int, float], ...], ...] = ()  # per token, its alternatives (id, log prob), when asked


def _final(r) -> bool:
    return r.parameters["triton_final_response"].bool_param if "triton_final_response" in r.parameters else False


def parse_response(resp: service_pb2.ModelStreamInferResponse) -> Step:
    if resp.error_message:
        return Step((), True, resp.error_message)
    r = resp.infer_response
    final = _final(r)
    ids: tuple[int, ...] = ()
    lengths = scores = top_ids = top_values = None
    for i, out in enumerate(r.outputs):
        raw = r.raw_output_contents[i]
        if out.name == "output_ids":
            ids = tuple(np.frombuffer(raw, "<i4").reshape(-1).tolist())
        elif out.name == "sequence_length":
            lengths = np.frombuffer(raw, "<i4").reshape(-1)
        elif out.name == "output_log_probs":
            scores = np.frombuffer(raw, "<f4").reshape(-1)
        elif out.name == "top_log_prob_ids":
            top_ids = np.frombuffer(raw, "<i4").reshape(-1, out.shape[-1])
        elif out.name == logprobs.TOP_OUTPUT:
            top_values = np.frombuffer(raw, "<f4").reshape(-1, out.shape[-1])
    if lengths is not None and lengths.size == 1:
        ids = ids[: int(lengths[0])]
    n = len(ids)
    # A streamed response scores its own tokens; the last n values, should a backend send the output's so far.
    log_probs = None
    if scores is not None:  # fewer values than tokens stays visible: Generating refuses such a response
        log_probs = tuple(float(v) for v in scores[-n:]) if n else ()
    top: tuple = ()
    if top_ids is not None and top_values is not None and n:
        top = tuple(tuple(zip(row_ids.tolist(), (float(v) for v in row_values)))
                    for row_ids, row_values in zip(top_ids[-n:], top_values[-n:]))
    return Step(ids, final, log_probs=log_probs, top=top)


def _first_string(raw: bytes) -> str:
    """The first element of a BYTES tensor's raw contents, as text."""
    if len(raw) < 4:
        return ""
    n = int.from_bytes(raw[:4], "little")
    return raw[4:4 + n].decode("utf-8", errors="replace")


def parse_llmapi_response(resp: service_pb2.ModelStreamInferResponse) -> Step:
    """A response of the LLM API's model: its text (the output so far) and finish_reason; a finish reason other
    than "None" ends the output even where Triton's final flag comes in a response of its own."""
    if resp.error_message:
        return Step((), True, resp.error_message)
    r = resp.infer_response
    text = finish = None
    for i, out in enumerate(r.outputs):
        if i >= len(r.raw_output_contents):
            break
        if out.name == protocol.LLMAPI.text_output:
            text = _first_string(r.raw_output_contents[i])
        elif out.name == protocol.LLMAPI.finish_reason:
            finish = _first_string(r.raw_output_contents[i])
    done = finish not in (None, "", "None")
    return Step((), _final(r) or done, text=text, finish=finish if done else None)


class StopCut:
    """Text in, piece by piece; text out, cut at the first stop sequence.

    Text that could still be the start of a stop sequence is held back, so no part of a stop sequence is ever
    sent; at a match the text before it is released and ``stopped`` is set."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.stopped = False

    def push(self, text: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        if hits:
            out, self._pending, self.stopped = self._pending[:min(hits)], "", True
            return out
        keep = 0 if final else min(self._hold, len(self._pending))
        out, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        return out


class TextStream:
    """Generated token ids in, text out, one token at a time; stop sequences cut the text.

    Decoding a token on its own breaks characters that span tokens (byte-level BPE) and leading
    spaces (SentencePiece), so each step decodes a short window of ids and releases only what the
    new token added, holding back an incomplete character (TGI's and vLLM's offsets). Text that
    could still be the start of a stop sequence is held back too (``StopCut``).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._cut = StopCut(stop)
        self.ids: list[int] = []
        self._prefix = 0  # the window's start: ids already released, kept as context
        self._read = 0  # ids[:_read] are text (released or pending)

    @property
    def stopped(self) -> bool:
        return self._cut.stopped

    def push(self, token_id: int) -> str:
        """The text that ``token_id`` lets out (often '', e.g. inside a character or a possible stop)."""
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        added = ""
        if len(now) > len(before) and not now.endswith("\ufffd"):
            added = now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._cut.push(added)

    def flush(self) -> str:
        """The rest, at the end of generation (an incomplete character comes out as U+FFFD)."""
        added = ""
        if not self.stopped and self._read < len(self.ids):
            before = self._decode(self.ids[self._prefix:self._read])
            added = self._decode(self.ids[self._prefix:])[len(before):]
            self._read = len(self.ids)
        return self._cut.push(added, final=True)


class CumulativeText:
    """The LLM API's streamed text in (each response the whole output so far), the new text out, cut at stop
    sequences (``StopCut``). ``sent``: all the text let out.

    The new part of each response is stoker.protocol's ``CumulativeStream`` rule: a trailing U+FFFD waits for the
    response that completes it; a response that revises text already let out adds only what lies beyond it (text
    sent cannot be taken back, and is never sent twice), and what it changed is kept in ``revisions``."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._cut = StopCut(stop)
        self._stream = protocol.CumulativeStream()
        self.sent = ""

    @property
    def stopped(self) -> bool:
        return self._cut.stopped

    @property
    def revisions(self) -> list[str]:
        """Per response that revised the output already taken, what it changed or withdrew."""
        return self._stream.revisions

    def push(self, text: str, final: bool = False) -> str:
        """The new text that the output so far, ``text``, lets out; ``final``: nothing more will come."""
        if self.stopped:
            return ""
        return self._let_out(self._stream.push(text, final=final).new, final)

    def flush(self) -> str:
        """The rest, at the end of the output (what was held back as a possible stop sequence or character)."""
        if self.stopped:
            return ""
        return self._let_out(self._stream.flush().new, True)

    def _let_out(self, new: str, final: bool) -> str:
        out = self._cut.push(new, final=final)
        self.sent += out
        return out


def llmapi_finish(model_reason: str | None, stopped: bool, completion_tokens: int, max_tokens: int) -> str:
    """OpenAI's finish_reason for an LLM-API output: ``stop`` at a stop sequence cut here; else the model's
    ("length" when max_tokens ran out; "stop" at an end id or stop string); a model that said nothing (no finish
    output), or ended otherwise ("timeout", "cancelled"), is judged by the count as for the ensemble."""
    if stopped:
        return "stop"
    if model_reason in ("stop", "length"):
        return model_reason
    return finish_reason(False, completion_tokens, max_tokens)


def finish_reason(stopped: bool, completion_tokens: int, max_tokens: int) -> str:
    """``length`` when the budget ran out, else ``stop`` (an end id, a stop id or a stop sequence)."""
    return "length" if not stopped and completion_tokens >= max_tokens else "stop"
