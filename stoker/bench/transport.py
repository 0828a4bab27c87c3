"""What a benchmark needs from a protocol: preflight, then one timed streaming request at a time.

Three transports implement it: gRPC `stream_infer` (grpc_transport), HTTP `generate_stream` SSE
(http_transport) and OpenAI's streamed `/v1/completions` (openai_transport). All time every response on
time.perf_counter, which is CLOCK_MONOTONIC on Linux and so comparable across the load generator's processes. A `TransportSpec` is the picklable recipe a
worker process rebuilds its transport from, after the main process has run the preflight. The implementations
import this module, so the choice among them lives in stoker.bench.transports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ..protocol import ENSEMBLE, Interface
from .errors import ModelUnavailable

API_KEY_ENV = "STOKER_API_KEY"  # an endpoint with deploy.api_keys: every request carries it (never printed)


def auth_headers() -> dict[str, str]:
    """``authorization: Bearer KEY`` from $STOKER_API_KEY, or nothing; HTTP headers and gRPC metadata alike."""
    import os

    key = os.environ.get(API_KEY_ENV, "").strip()
    return {"authorization": f"Bearer {key}"} if key else {}

TEXT_INPUT = "text_input"
MAX_TOKENS = "max_tokens"
MIN_TOKENS = "min_tokens"
STREAM = "stream"
TEXT_OUTPUT = "text_output"
PREFLIGHT_TIMEOUT_S = 10.0
Protocol_ = Literal["grpc", "http", "openai"]


@dataclass
class Exchange:
    """What the client saw of one request: send time, every response's arrival, the text, or an error."""

    start_s: float
    times: list[float] = field(default_factory=list)
    first_s: float | None = None  # first non-empty response
    text: bytes = b""
    chunks: int = 0  # non-empty responses
    error: str | None = None
    failed_s: float | None = None
    reported_tokens: int | None = None  # the server's own output count (OpenAI usage), where it gives one

    @property
    def end_s(self) -> float | None:
        if self.error is not None:
            return self.failed_s
        return self.times[-1] if self.times else None


@dataclass(frozen=True)
class TransportSpec:
    """Everything needed to open a transport in any process; `inputs` comes from the preflight."""

    protocol: Protocol_
    url: str
    model: str
    extra_inputs: Mapping[str, int | float | bool] = field(default_factory=dict)
    min_tokens: bool = False  # send min_tokens = max_tokens so EOS cannot cut the output short
    streaming: bool = True  # HTTP only: False uses /generate (one response)
    inputs: Mapping[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    interface: Interface = ENSEMBLE  # the layout's input names (stoker.protocol); OpenAI ignores it
    response_format: Mapping[str, Any] | None = None  # OpenAI only: sent as the request's response_format

    def request_values(self, text: str, max_tokens: int) -> dict[str, Any]:
        return self.interface.request(text, max_tokens, streaming=self.streaming,
                                      min_tokens=max_tokens if self.min_tokens else None,
                                      declared=frozenset(self.inputs) if self.inputs else None,
                                      extra=dict(self.extra_inputs))

    def wanted_inputs(self) -> list[str]:
        i = self.interface
        return [*i.required_inputs(), *self.extra_inputs,
                *([i.min_tokens or "min_tokens"] if self.min_tokens else [])]


class Transport(Protocol):
    spec: TransportSpec

    async def preflight(self) -> TransportSpec:
        """Check server, model and interface; return the spec completed with the model's inputs."""
        ...

    async def connect(self) -> None:
        """Open the connection now, so that the first measured request does not pay for it."""
        ...

    async def send(self, text: str, max_tokens: int, request_id: str, timeout_s: float) -> Exchange:
        """One request, timed; never raises (failures go in the Exchange)."""
        ...

    async def close(self) -> None: ...


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def check_interface(spec: TransportSpec, meta: Mapping[str, Any]) -> TransportSpec:
    """The spec with the model's input types, or ModelUnavailable naming what the model lacks."""
    inputs = {
        i["name"]: (i["datatype"], tuple(1 if int(d) < 0 else int(d) for d in i.get("shape", [])))
        for i in meta.get("inputs", [])
    }
    outputs = {o["name"] for o in meta.get("outputs", [])}
    missing = [name for name in spec.wanted_inputs() if name not in inputs]
    if missing or TEXT_OUTPUT not in outputs:
        lacks = ", ".join(missing + ([] if TEXT_OUTPUT in outputs else [f"output {TEXT_OUTPUT}"]))
        hint = (" (min_tokens makes the output length exact; drop --ignore-eos for this model)"
                if (spec.interface.min_tokens or "min_tokens") in missing else "")
        what = "LLM ensemble" if spec.interface.layout == "ensemble" else f"{spec.interface.layout} model's"
        raise ModelUnavailable(f"model '{spec.model}' lacks the {what} interface: no {lacks}{hint}")
    return TransportSpec(**{**spec.__dict__, "inputs": inputs})


def why_not_ready(index: Any, url: str, model: str) -> str:
    """One line saying why `model` is not ready, from a repository index (gRPC dict or HTTP list form)."""
    models = index.get("models", []) if isinstance(index, dict) else list(index or [])
    entries = {m.get("name"): m for m in models}
    if model not in entries:
        known = ", ".join(sorted(str(n) for n in entries)) or "none"
        return f"model '{model}' is not in the repository served at {url} (models: {known})"
    entry = entries[model]
    state = entry.get("state", "UNKNOWN")
    reason = one_line(entry.get("reason", ""))
    return f"model '{model}' is not ready at {url}: state {state}" + (f" ({reason})" if reason else "")
