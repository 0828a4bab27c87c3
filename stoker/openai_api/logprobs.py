"""Log probs in OpenAI's shapes: what a request asks for, whether the live backend can answer it, the bodies. Pure.

    OpenAI                            Triton `tensorrt_llm` (the ensemble's interface; triton_stream.triton_request)
    chat logprobs: true               return_log_probs BOOL → output_log_probs FP32: the sampled token's log prob
    chat top_logprobs: k (0..20)      return_top_log_probs INT32 = k → top_log_prob_ids INT32, top_log_probs FP32
    completions logprobs: k (0..5)    the same k; OpenAI's legacy shape adds the sampled token to the k

Per target (see docs/serving.md, "Log probs"):
- reference (stoker's CPU model, stoker/triton/models/tensorrt_llm.py): all of it. The values are the log-softmax
  of the distribution each token was drawn from, over the whole vocabulary (stoker/runtime/generate.py): under
  greedy decoding, of the model's own logits, so equal to transformers' log_softmax at the same positions.
- engine (TensorRT-LLM 1.2.1's C++ `tensorrt_llm` model): `return_log_probs` → `output_log_probs`, the sampled
  token's only; upstream declares no top-k output (its full tensor list: stoker/gpu/inflight.py TRTLLM_OUT, checked
  against upstream's config by tests/contract/test_contract_triton_repo.py). `logprobs` is served; `top_logprobs`
  above 0 (completions: `logprobs` above 0) is refused, naming the field.
- LLM API (`llmapi` layout, target pytorch): TensorRT-LLM 1.2.1's llmapi model returns no per-token log prob, only
  `cumulative_logprob` for `return_cumulative_logprob` (its inputs and outputs: /work/shared/FACTS.md, wave 4 facts,
  "Triton's `llmapi` model"), so any log probs are refused.
Which of the first two serves a build: whether its `tensorrt_llm` declares `top_log_probs` (the app asks Triton's
model metadata once per live build), so the service needs no list of targets.

Each token's text is its id decoded alone (special tokens shown; a token that ends inside a character reads U+FFFD,
as in vLLM), and ``bytes`` the token's own bytes (token_bytes.py), so a client can join a character's tokens.
``logprobs.content`` covers exactly the tokens counted in ``usage.completion_tokens`` (a matched stop id included;
the end id is never output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .mapping import ApiError, ChatRequest, CompletionRequest, bad_request, completion_chunk

MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI's
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions' logprobs, as OpenAI's
# The output only the reference model declares (stoker/triton/config.py TOP_LOG_PROBS_OUT).
TOP_OUTPUT = "top_log_probs"


@dataclass(frozen=True)
class Scored:
    """One generated token, its log prob, and the alternatives asked for ((id, log prob), …), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def asked(req: ChatRequest | CompletionRequest) -> int | None:
    """The number of alternatives per token the request asks for; None: no log probs. 400 for a bad value."""
    if isinstance(req, ChatRequest):
        k = req.top_logprobs
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise bad_request(f"Invalid value for 'top_logprobs': {k} is outside 0..{MAX_TOP_LOGPROBS}.",
                              "top_logprobs")
        if not req.logprobs:
            if k:
                raise bad_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
            return None
        return k or 0
    k = req.logprobs
    if k is not None and not 0 <= k <= MAX_COMPLETION_LOGPROBS:
        raise bad_request(f"Invalid value for 'logprobs': {k} is outside 0..{MAX_COMPLETION_LOGPROBS}.", "logprobs")
    return k


def refusal(req: ChatRequest | CompletionRequest, k: int | None, llmapi: bool, top_served: bool) -> ApiError | None:
    """Why this deployment cannot answer the log probs ``req`` asks for (None: it can). ``llmapi``: the backend is
    the LLM API's model; ``top_served``: its `tensorrt_llm` returns alternatives (the reference model)."""
    chat = isinstance(req, ChatRequest)
    if k is None:
        return None
    if llmapi:
        return bad_request("'logprobs' is not supported by this deployment: TensorRT-LLM's LLM-API model (target: "
                           "pytorch) returns no per-token log probs, only a cumulative one.", "logprobs",
                           "unsupported_parameter")
    if k > 0 and not top_served:
        name = "top_logprobs" if chat else "logprobs"
        return bad_request(f"'{name}' above 0 is not supported by this deployment: TensorRT-LLM's tensorrt_llm model "
                           f"returns only the sampled token's log prob (output_log_probs); set '{name}' to 0.",
                           name, "unsupported_value")
    return None


class Vocabulary(Protocol):
    """How tokens are named (served_model.ServedModel)."""

    def token_text(self, token: int) -> str: ...

    def token_bytes(self, token: int) -> bytes: ...


# A token a constraint masks has log prob -inf, which JSON cannot carry (the encoder refuses it: a 500). Reported as
# -9999.0, the floor vLLM's OpenAI server puts on every log prob it serializes (its chat and completion log-prob
# builders, vllm/entrypoints/openai/serving_chat.py and serving_completion.py), so clients see what they see there.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _entry(vocab: Vocabulary, token: int, logprob: float) -> dict:
    return {"token": vocab.token_text(token), "logprob": _finite(logprob), "bytes": list(vocab.token_bytes(token))}


def chat_content(scored: Sequence[Scored], vocab: Vocabulary) -> list[dict]:
    """``choices[].logprobs.content`` of chat: one ChatCompletionTokenLogprob per token."""
    return [{**_entry(vocab, s.token, s.logprob), "top_logprobs": [_entry(vocab, t, lp) for t, lp in s.top]}
            for s in scored]


def chat_logprobs(scored: Sequence[Scored], vocab: Vocabulary) -> dict:
    return {"content": chat_content(scored, vocab), "refusal": None}


def completion_logprobs(scored: Sequence[Scored], vocab: Vocabulary, offset: int = 0) -> dict:
    """OpenAI's legacy ``choices[].logprobs`` for these tokens: ``text_offset`` counts each token's text from
    ``offset`` (where the tokens before these ended), as vLLM counts it."""
    text = vocab.token_text
    tokens, offsets = [], []
    for s in scored:
        offsets.append(offset)
        tokens.append(text(s.token))
        offset += len(tokens[-1])
    tops = []
    for s in scored:
        # Reversed: where two ids read alike, the likelier stays.
        top = {text(t): _finite(lp) for t, lp in reversed(s.top)}
        top = dict(sorted(top.items(), key=lambda kv: -kv[1]))
        top.setdefault(text(s.token), _finite(s.logprob))  # the sampled token always: up to k + 1 (OpenAI's rule)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [_finite(s.logprob) for s in scored], "top_logprobs": tops,
            "text_offset": offsets}


def text_length(scored: Sequence[Scored], vocab: Vocabulary) -> int:
    """How far these tokens move ``text_offset``."""
    return sum(len(vocab.token_text(s.token)) for s in scored)


def completion_chunker(head, usage_on: bool, vocab: Vocabulary):
    """A maker of one completion stream's chunks (mapping.completion_chunk) whose log probs' ``text_offset`` runs
    on across the chunks, as a whole answer's would. One per stream (per choice, with n > 1)."""
    offset = 0

    def chunk(piece: str | None, finish: str | None, scored: Sequence[Scored] | None) -> dict:
        nonlocal offset
        logprobs = None
        if scored is not None:
            logprobs = completion_logprobs(scored, vocab, offset)
            offset += text_length(scored, vocab)
        return completion_chunk(head, piece or "", finish, usage_on, logprobs)

    return chunk

