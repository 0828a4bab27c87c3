"""How a client talks to what a layout serves: which Triton model to address, which input carries what, and how
the text of a streamed answer is assembled.

Two layouts, two interfaces. TensorRT-LLM's ensemble (reference and engine targets) takes `text_input`,
`max_tokens` and an optional `stream`, and streams the new part of the output in each response. Its LLM-API python
model (`llmapi`, the pytorch target) takes `text_input`, `streaming` (always sent: it defaults to false),
`sampling_param_max_tokens`, and answers with the prompt in front of the output unless
`sampling_param_exclude_input_from_output` is true; `return_finish_reason` asks it why each request ended; each
streamed response carries the output so far (TensorRT-LLM 1.2.1's llmapi model.py sends
`RequestOutput.outputs[i].text`, which grows), so a client takes the new part (``CumulativeStream``, the one rule
for that). Pure data and pure functions: the smoke test, the watch's counts, the benchmark, the evaluation and the
OpenAI service take an `Interface` from the target instead of naming a layout.

The OpenAI service runs where stoker is not installed; it reads this file through stoker/openai_api/_protocol.py,
a link to it, which the service's package carries as a file of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# What a text whose last character's bytes have not all come decodes to at its end (Python's and HF's
# errors="replace"); the LLM API's model sends such a text when a token ends inside a character.
INCOMPLETE = "\ufffd"


@dataclass(frozen=True)
class Part:
    """What one response of a cumulative stream adds (``CumulativeStream.push``)."""

    new: str  # to append: the output beyond every character already handed on ("" when nothing)
    # The part of the previous response's output that this response changed or withdrew ("" when none). It lies
    # wholly at positions already handed on: it was sent and is not sent again.
    revised: str = ""


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class CumulativeStream:
    """The one rule for a stream whose every response carries the whole output so far (the LLM API's
    ``RequestOutput.outputs[i].text``): each response's text in, what it adds out.

    A response usually extends the one before it, and what it adds is what lies beyond. A response can also revise
    what was already sent: detokenizing the whole output again completes a character whose bytes had not all come
    (U+FFFD), and a stop string streamed in part is cut from the final output (stoker's stand-in of the llmapi
    model does that: stoker/triton/models/llmapi.py sends ``new[:cut]`` last). What was handed on cannot be taken
    back, and handing the whole text on again would repeat it, so: what is added is only the output beyond every
    position already handed on (no position is handed on twice), and the part of the earlier output a response
    changed is kept in ``revisions`` for the caller to report, never dropped silently. ``output`` stays the
    model's own latest text: at the end, its answer with the revisions applied, for a caller that records rather
    than forwards. A trailing U+FFFD is taken only once a later response completes it, or at the end (``final``,
    ``flush``), so the commonest revision never reaches the receiver.
    """

    def __init__(self, received: str = "") -> None:
        self.received = received  # all text handed on: the parts push returned, joined
        self.output = received  # the latest response's text, as it came
        self.revisions: list[str] = []  # per revising response, what it changed or withdrew (Part.revised)
        self._taken = received  # the latest output as taken (a trailing U+FFFD held back)

    def push(self, text: str, final: bool = False) -> Part:
        """One response's text (the whole output so far); ``final``: nothing more will come."""
        taken = text if final else text.rstrip(INCOMPLETE)
        # startswith first: it is the usual case, and the benchmark's client pays for every response.
        revised = "" if taken.startswith(self._taken) else self._taken[_common_prefix(self._taken, taken):]
        new = taken[len(self.received):]  # empty when no longer than what was handed on
        self.received += new
        self.output, self._taken = text, taken
        if revised:
            self.revisions.append(revised)
        return Part(new, revised)

    def flush(self) -> Part:
        """The end of the output: what was held back (a trailing U+FFFD that nothing completed)."""
        return self.push(self.output, final=True)


class StreamedAnswer:
    """One streamed answer as a client that records it (the smoke test, the benchmark) assembles it from each
    response's text output as UTF-8 bytes, whichever way its layout streams: a new part per response (joined as
    bytes, since a token may end inside a character), or the whole output so far (``CumulativeStream``)."""

    def __init__(self, cumulative: bool) -> None:
        self._parts: list[bytes] = []
        self._stream = CumulativeStream() if cumulative else None

    def add(self, raw: bytes) -> bytes:
        """What one response adds to the answer (b"" when nothing)."""
        if self._stream is None:
            self._parts.append(raw)
            return raw
        # The LLM API's model sends whole Python strings, so each response decodes on its own.
        return self._stream.push(raw.decode("utf-8", "replace")).new.encode("utf-8")

    def end(self) -> bytes:
        """The stream ended: what was held back until then."""
        return b"" if self._stream is None else self._stream.flush().new.encode("utf-8")

    @property
    def text(self) -> bytes:
        """The answer: the parts joined, or the cumulative stream's latest output (the model's answer as it last
        stood, not the parts handed on, which keep what a revision changed)."""
        return b"".join(self._parts) if self._stream is None else self._stream.output.encode("utf-8")

    @property
    def revisions(self) -> list[str]:
        """What responses changed of text already received (always empty for a stream of new parts)."""
        return [] if self._stream is None else list(self._stream.revisions)


@dataclass(frozen=True)
class Interface:
    layout: str
    model: str  # the Triton model a client addresses
    max_tokens: str
    stream: str
    stream_always: bool  # send the stream flag on every request (else only where the model declares it)
    min_tokens: str | None = None  # an input that holds EOS back (None: the model has none)
    always: tuple[tuple[str, Any], ...] = field(default=())  # inputs every request carries
    text_input: str = "text_input"
    text_output: str = "text_output"
    finish_reason: str | None = None  # the output that says why a request ended, where the model has one
    # Sampling inputs a client sets per request, where the model has them (None: it has none by that name).
    temperature: str | None = None
    top_k: str | None = None
    top_p: str | None = None
    seed: str | None = None
    presence_penalty: str | None = None
    frequency_penalty: str | None = None
    # Each streamed response carries the whole output so far (the LLM API's RequestOutput.text), not the new part.
    cumulative_text: bool = False
    # The served repository has a model that takes and returns token ids (the ensemble's `tensorrt_llm`): the
    # evaluation scores through it; otherwise it scores through text and the tokenizer.
    token_ids: bool = False
    adapter: str | None = None  # the input that selects a LoRA adapter per request (None: the model takes none)

    def new_part(self, text: bytes, so_far: bytes) -> bytes:
        """What one streamed response adds to the output received so far, for a client that keeps nothing but that
        output; a client that keeps the stream uses ``answer()`` (or ``CumulativeStream``) and learns of revisions."""
        if not self.cumulative_text:
            return text
        # A cumulative response is a whole string: compare characters, since a revision may change a byte count.
        return CumulativeStream(so_far.decode("utf-8", "replace")).push(
            text.decode("utf-8", "replace"), final=True).new.encode("utf-8")

    def answer(self) -> StreamedAnswer:
        """An empty answer to assemble one streamed request's responses into."""
        return StreamedAnswer(self.cumulative_text)

    def text_of(self, response: Mapping[str, Any]) -> bytes:
        """The text output of one JSON response of Triton's generate extension, as UTF-8 (a [-1]-shaped output may
        come back as a list)."""
        value = response.get(self.text_output, "")
        if isinstance(value, list):
            value = "".join(str(v) for v in value)
        return str(value).encode("utf-8")

    def request(self, text: str, max_tokens: int, *, streaming: bool = True, min_tokens: int | None = None,
                declared: frozenset[str] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """One request's input values by name. ``declared``: the model's inputs (from its metadata), when known."""
        values: dict[str, Any] = {self.text_input: text, self.max_tokens: max_tokens, **dict(self.always),
                                  **(extra or {})}
        if min_tokens is not None:
            if self.min_tokens is None:
                raise ValueError(f"the {self.layout} interface has no input that holds EOS back (min_tokens)")
            values[self.min_tokens] = min_tokens
        if self.stream_always or declared is None or self.stream in declared:
            values[self.stream] = streaming
        return values

    def required_inputs(self) -> list[str]:
        return [self.text_input, self.max_tokens, *(k for k, _ in self.always),
                *([self.stream] if self.stream_always else [])]


ENSEMBLE = Interface(layout="ensemble", model="ensemble", max_tokens="max_tokens", stream="stream",
                     stream_always=False, min_tokens="min_tokens", token_ids=True, adapter="lora_task_id")
LLMAPI = Interface(layout="llmapi", model="tensorrt_llm", max_tokens="sampling_param_max_tokens", stream="streaming",
                   stream_always=True,
                   always=(("sampling_param_exclude_input_from_output", True), ("return_finish_reason", True)),
                   finish_reason="finish_reason", cumulative_text=True, temperature="sampling_param_temperature",
                   top_k="sampling_param_top_k", top_p="sampling_param_top_p", seed="sampling_param_seed",
                   presence_penalty="sampling_param_presence_penalty",
                   frequency_penalty="sampling_param_frequency_penalty")
INTERFACES = {i.layout: i for i in (ENSEMBLE, LLMAPI)}


def by_layout(layout: str) -> Interface:
    """The interface of a repository layout; a one-line error naming the known ones."""
    try:
        return INTERFACES[layout]
    except KeyError:
        raise ValueError(f"no serving interface for layout {layout!r} (known: {', '.join(INTERFACES)})") from None
