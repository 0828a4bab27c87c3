"""A parsed OpenAI request ⇄ one streamed request to Triton's `tensorrt_llm`: the generation it asks for (lengths
checked, OpenAI's defaults filled), the gRPC request, each streamed response, and the text cut at stop sequences.

The mapping table is in mapping.py, with the OpenAI side. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import service_pb2

from .mapping import (DEFAULT_CHAT_MAX_TOKENS, DEFAULT_COMPLETION_MAX_TOKENS, MODEL_NAME, UINT64_MASK, ChatRequest,
                      _Request, bad_request, stop_sequences)


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


def plan(req: _Request, input_ids: Sequence[int], context_len: int | None, *, seed: int,
         vocab_size: int | None = None) -> Generation:
    """Validate lengths against the model's context and fill OpenAI's defaults.

    ``seed`` is used when the request has none (OpenAI samples afresh each time unless seeded).
    """
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
                      min_tokens=_min_tokens(req, int(asked)))


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
    r.outputs.add().name = "output_ids"
    # The stream ends with an empty response flagged final, so the end is seen even without tokens.
    r.parameters["triton_enable_empty_final_response"].bool_param = True
    return r


@dataclass(frozen=True)
class Step:
    """One streamed response: new token ids, whether it is the last, or Triton's error."""

    token_ids: tuple[int, ...]
    final: bool
    error: str | None = None


def parse_response(resp: service_pb2.ModelStreamInferResponse) -> Step:
    if resp.error_message:
        return Step((), True, resp.error_message)
    r = resp.infer_response
    final = r.parameters["triton_final_response"].bool_param if "triton_final_response" in r.parameters else False
    ids: tuple[int, ...] = ()
    lengths = None
    for i, out in enumerate(r.outputs):
        if out.name == "output_ids":
            ids = tuple(np.frombuffer(r.raw_output_contents[i], "<i4").reshape(-1).tolist())
        elif out.name == "sequence_length":
            lengths = np.frombuffer(r.raw_output_contents[i], "<i4").reshape(-1)
    if lengths is not None and lengths.size == 1:
        ids = ids[: int(lengths[0])]
    return Step(ids, final)


class TextStream:
    """Generated token ids in, text out, one token at a time; stop sequences cut the text.

    Decoding a token on its own breaks characters that span tokens (byte-level BPE) and leading
    spaces (SentencePiece), so each step decodes a short window of ids and releases only what the
    new token added, holding back an incomplete character (TGI's and vLLM's offsets). Text that
    could still be the start of a stop sequence is held back too, so no part of a stop sequence is
    ever sent; at a match the text before it is released and ``stopped`` is set.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.ids: list[int] = []
        self._prefix = 0  # the window's start: ids already released, kept as context
        self._read = 0  # ids[:_read] are text (released or pending)
        self._pending = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        """The text that ``token_id`` lets out (often '', e.g. inside a character or a possible stop)."""
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._pending += now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def flush(self) -> str:
        """The rest, at the end of generation (an incomplete character comes out as U+FFFD)."""
        if not self.stopped and self._read < len(self.ids):
            before = self._decode(self.ids[self._prefix:self._read])
            self._pending += self._decode(self.ids[self._prefix:])[len(before):]
            self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        if hits:
            out, self._pending, self.stopped = self._pending[:min(hits)], "", True
            return out
        keep = 0 if final else min(self._hold, len(self._pending))
        out, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        return out


def finish_reason(stopped: bool, completion_tokens: int, max_tokens: int) -> str:
    """``length`` when the budget ran out, else ``stop`` (an end id, a stop id or a stop sequence)."""
    return "length" if not stopped and completion_tokens >= max_tokens else "stop"
