"""How a client talks to what a layout serves: which Triton model to address, which input carries what.

Two layouts, two interfaces. TensorRT-LLM's ensemble (reference and engine targets) takes `text_input`,
`max_tokens` and an optional `stream`. Its LLM-API python model (`llmapi`, the pytorch target) takes `text_input`,
`streaming` (always sent: it defaults to false), `sampling_param_max_tokens`, and answers with the prompt in front
of the output unless `sampling_param_exclude_input_from_output` is true; `return_finish_reason` asks it why each
request ended; each streamed response carries the output so far (TensorRT-LLM 1.2.1's llmapi model.py sends
`RequestOutput.outputs[i].text`, which grows), so a client takes the new part. Pure data: the smoke test, the watch's counts, the benchmark, the evaluation and
the OpenAI service take an `Interface` from the target instead of naming a layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    # Each streamed response carries the whole output so far (the LLM API's RequestOutput.text), not the new part.
    cumulative_text: bool = False
    # The served repository has a model that takes and returns token ids (the ensemble's `tensorrt_llm`): the
    # evaluation scores through it; otherwise it scores through text and the tokenizer.
    token_ids: bool = False
    adapter: str | None = None  # the input that selects a LoRA adapter per request (None: the model takes none)

    def new_part(self, text: bytes, so_far: bytes) -> bytes:
        """What a streamed response adds to the output received so far."""
        if not self.cumulative_text:
            return text
        return text[len(so_far):] if text.startswith(so_far) else text

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
                   finish_reason="finish_reason", cumulative_text=True)
INTERFACES = {i.layout: i for i in (ENSEMBLE, LLMAPI)}


def by_layout(layout: str) -> Interface:
    """The interface of a repository layout; a one-line error naming the known ones."""
    try:
        return INTERFACES[layout]
    except KeyError:
        raise ValueError(f"no serving interface for layout {layout!r} (known: {', '.join(INTERFACES)})") from None
