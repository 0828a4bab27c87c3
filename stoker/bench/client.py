"""Closed-loop streaming benchmark of a Triton LLM endpoint (TensorRT-LLM ensemble interface) over gRPC.

Each request is its own `stream_infer` call, so a stream's end is that request's end, and a slow or failed
request never holds up another. `concurrency` workers each keep one request in flight until the level's
request count is reached (GenAI-Perf's "concurrency" mode). Raw per-request records are kept; statistics
come from stoker.bench.metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from stoker.bench.metrics import LevelSummary, RequestRecord, summarize
from stoker.bench.workload import Prompt

from ..errors import StokerError

TEXT_INPUT = "text_input"
MAX_TOKENS = "max_tokens"
STREAM = "stream"
TEXT_OUTPUT = "text_output"
_PREFLIGHT_TIMEOUT_S = 10.0


class BenchmarkError(StokerError):
    """A benchmark could not run; the message is one line saying why."""


class InvalidBenchmarkConfig(BenchmarkError, ValueError):
    """Arguments that cannot produce a measurement (no requests, no prompts, ...)."""


class EndpointUnreachable(BenchmarkError):
    """No live Triton server answers at the URL."""


class ModelUnavailable(BenchmarkError):
    """The model is not in the repository, not ready, or lacks the LLM ensemble's inputs/outputs."""


class StreamingUnsupported(BenchmarkError):
    """The model cannot answer a streaming (decoupled) request."""


@dataclass(frozen=True)
class BenchmarkResult:
    levels: list[LevelSummary]
    records: list[RequestRecord] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"levels": [lvl.to_dict() for lvl in self.levels], "records": [asdict(r) for r in self.records]}


@dataclass(frozen=True)
class _ModelInterface:
    """Datatypes and request shapes of the model's inputs, read from its metadata."""

    model: str
    inputs: Mapping[str, tuple[str, tuple[int, ...]]]

    def build(self, text: str, max_tokens: int, extra: Mapping[str, int | float | bool]) -> list[InferInput]:
        values: dict[str, Any] = {TEXT_INPUT: text.encode("utf-8"), MAX_TOKENS: max_tokens, **extra}
        if STREAM in self.inputs:
            values[STREAM] = True
        tensors = []
        for name, value in values.items():
            datatype, shape = self.inputs[name]
            tensor = InferInput(name, list(shape), datatype)
            dtype = object if datatype == "BYTES" else _NUMPY_TYPES[datatype]
            tensor.set_data_from_numpy(np.full(shape, value, dtype=dtype))
            tensors.append(tensor)
        return tensors


_NUMPY_TYPES = {
    "BOOL": np.bool_,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}


def _grpc_target(url: str) -> str:
    """tritonclient wants host:port; accept grpc:// URLs too."""
    return url.removeprefix("grpc://")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _describe_exception(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return _one_line(f"{exc.code().name}: {exc.details()}")
    if isinstance(exc, InferenceServerException):
        return _one_line(exc.message() or str(exc))
    return _one_line(f"{type(exc).__name__}: {exc}")


def _validate(prompts: Sequence[Prompt], max_tokens: int, concurrency: int, requests: int, timeout_s: float) -> None:
    if requests < 1:
        raise InvalidBenchmarkConfig(f"zero requests: requests per level must be >= 1, got {requests}")
    if not prompts:
        raise InvalidBenchmarkConfig("no prompts to send")
    if concurrency < 1:
        raise InvalidBenchmarkConfig(f"concurrency must be >= 1, got {concurrency}")
    if max_tokens < 1:
        raise InvalidBenchmarkConfig(f"max_tokens must be >= 1, got {max_tokens}")
    if timeout_s <= 0:
        raise InvalidBenchmarkConfig(f"timeout_s must be > 0, got {timeout_s}")


async def preflight(
    client: InferenceServerClient, url: str, model: str, extra_inputs: Mapping[str, Any] | None = None
) -> _ModelInterface:
    """Check the server is live and the model ready with the ensemble's interface; raise BenchmarkError if not."""
    try:
        live = await client.is_server_live(client_timeout=_PREFLIGHT_TIMEOUT_S)
    except InferenceServerException as exc:
        raise EndpointUnreachable(f"Triton at {url} is unreachable: {_describe_exception(exc)}") from None
    if not live:
        raise EndpointUnreachable(f"Triton at {url} answers but is not live")
    try:
        ready = await client.is_model_ready(model, client_timeout=_PREFLIGHT_TIMEOUT_S)
    except InferenceServerException:
        ready = False
    if not ready:
        raise ModelUnavailable(await _why_not_ready(client, url, model))
    try:
        meta = await client.get_model_metadata(model, as_json=True, client_timeout=_PREFLIGHT_TIMEOUT_S)
    except InferenceServerException as exc:
        raise ModelUnavailable(f"model '{model}' metadata unavailable: {_describe_exception(exc)}") from None
    inputs = {
        i["name"]: (i["datatype"], tuple(1 if int(d) < 0 else int(d) for d in i.get("shape", [])))
        for i in meta.get("inputs", [])
    }
    outputs = {o["name"] for o in meta.get("outputs", [])}
    wanted = [TEXT_INPUT, MAX_TOKENS, *(extra_inputs or {})]
    missing = [name for name in wanted if name not in inputs]
    if missing or TEXT_OUTPUT not in outputs:
        lacks = ", ".join(missing + ([] if TEXT_OUTPUT in outputs else [f"output {TEXT_OUTPUT}"]))
        raise ModelUnavailable(f"model '{model}' lacks the LLM ensemble interface: no {lacks}")
    return _ModelInterface(model=model, inputs=inputs)


async def _why_not_ready(client: InferenceServerClient, url: str, model: str) -> str:
    try:
        index = await client.get_model_repository_index(as_json=True, client_timeout=_PREFLIGHT_TIMEOUT_S)
    except InferenceServerException as exc:
        return f"model '{model}' is not ready at {url} ({_describe_exception(exc)})"
    entries = {m.get("name"): m for m in index.get("models", [])}
    if model not in entries:
        known = ", ".join(sorted(str(n) for n in entries)) or "none"
        return f"model '{model}' is not in the repository served at {url} (models: {known})"
    entry = entries[model]
    state = entry.get("state", "UNKNOWN")
    reason = _one_line(entry.get("reason", ""))
    return f"model '{model}' is not ready at {url}: state {state}" + (f" ({reason})" if reason else "")


async def _one_request(
    client: InferenceServerClient,
    interface: _ModelInterface,
    prompt: Prompt,
    request_id: int,
    concurrency: int,
    max_tokens: int,
    timeout_s: float,
    count_tokens: Callable[[str], int] | None,
    extra_inputs: Mapping[str, Any],
) -> RequestRecord:
    """Send one streaming request and time every response; never raises (errors go in the record).

    `chunk_times_s` holds the arrival of every response; a failed request's `end_s` is when the
    failure was seen, so its time in flight still counts in the level's duration.
    """
    attempted = time.perf_counter()
    sent: list[float] = []
    chunks: list[bytes] = []
    times: list[float] = []
    first: float | None = None
    error: str | None = None
    failed_at: float | None = None
    finished = False
    stream = None
    try:
        request = {
            "model_name": interface.model,
            "inputs": interface.build(prompt.text, max_tokens, extra_inputs),
            "outputs": [InferRequestedOutput(TEXT_OUTPUT)],
            "request_id": str(request_id),
        }

        async def request_stream() -> AsyncIterator[dict[str, Any]]:
            # Stamped as late as we can: gRPC serializes and writes the request right after this yield.
            sent.append(time.perf_counter())
            yield request

        async with asyncio.timeout(timeout_s):
            stream = client.stream_infer(request_stream())
            async for result, err in stream:
                now = time.perf_counter()
                if err is not None:
                    error, failed_at = _describe_exception(err), now
                    break
                piece = _text_bytes(result.as_numpy(TEXT_OUTPUT))
                times.append(now)
                if piece:
                    chunks.append(piece)
                    if first is None:
                        first = now
            else:
                finished = True
    except TimeoutError:
        error, failed_at = f"timed out after {timeout_s:g} s", time.perf_counter()
    except Exception as exc:  # noqa: BLE001 -- one request's failure must not stop the level
        error, failed_at = _describe_exception(exc), time.perf_counter()
    finally:
        if stream is not None and not finished:
            stream.cancel()  # frees the server slot of an abandoned request

    osl = 0
    if error is None:
        text = b"".join(chunks).decode("utf-8", errors="replace")
        try:
            osl = count_tokens(text) if count_tokens is not None else len(chunks)
        except Exception as exc:  # noqa: BLE001 -- caller code; recorded like any request failure
            error, failed_at = f"counting output tokens failed: {_describe_exception(exc)}", times[-1]
    end = failed_at if error is not None else (times[-1] if times else None)
    return RequestRecord(
        request_id=request_id,
        concurrency=concurrency,
        start_s=sent[0] if sent else attempted,
        first_response_s=first,
        end_s=end,
        chunk_times_s=tuple(times),
        input_tokens=prompt.input_tokens,
        output_tokens=osl if error is None else 0,
        ok=error is None,
        error=error,
    )


def _text_bytes(array: np.ndarray | None) -> bytes:
    """The response's text_output as raw bytes; joined before decoding, as a token may split a character."""
    if array is None:
        return b""
    return b"".join(v if isinstance(v, bytes) else str(v).encode("utf-8") for v in array.ravel())


async def _run_level(
    client: InferenceServerClient,
    interface: _ModelInterface,
    prompts: Sequence[Prompt],
    max_tokens: int,
    concurrency: int,
    requests: int,
    timeout_s: float,
    count_tokens: Callable[[str], int] | None,
    extra_inputs: Mapping[str, Any],
    first_prompt: int = 0,
) -> list[RequestRecord]:
    ids = itertools.count()
    records: list[RequestRecord] = []

    async def worker() -> None:
        while (i := next(ids)) < requests:
            prompt = prompts[(first_prompt + i) % len(prompts)]
            records.append(
                await _one_request(
                    client, interface, prompt, i, concurrency, max_tokens, timeout_s, count_tokens, extra_inputs
                )
            )

    await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))
    return sorted(records, key=lambda r: r.request_id)


async def run_level(
    url: str,
    model: str,
    prompts: Sequence[Prompt],
    max_tokens: int,
    concurrency: int,
    requests: int,
    timeout_s: float,
    count_tokens: Callable[[str], int] | None = None,
    extra_inputs: Mapping[str, int | float | bool] | None = None,
) -> list[RequestRecord]:
    """Run `requests` streaming requests, `concurrency` in flight at a time; one record per request.

    `extra_inputs` sets optional scalar inputs (end_id, pad_id, temperature, ...), typed from model metadata.
    Raises BenchmarkError subclasses only for arguments or preflight; request failures are recorded.
    """
    _validate(prompts, max_tokens, concurrency, requests, timeout_s)
    extra = dict(extra_inputs or {})
    async with InferenceServerClient(_grpc_target(url)) as client:
        interface = await preflight(client, url, model, extra)
        return await _run_level(
            client, interface, prompts, max_tokens, concurrency, requests, timeout_s, count_tokens, extra
        )


async def warmup(
    url: str,
    model: str,
    prompts: Sequence[Prompt],
    max_tokens: int,
    requests: int,
    timeout_s: float,
    concurrency: int = 1,
    extra_inputs: Mapping[str, int | float | bool] | None = None,
) -> list[RequestRecord]:
    """Unmeasured requests that bring the server to steady state; raises StreamingUnsupported/BenchmarkError
    when the first one fails, since every measured request would fail the same way."""
    _validate(prompts, max_tokens, concurrency, max(requests, 1), timeout_s)
    extra = dict(extra_inputs or {})
    async with InferenceServerClient(_grpc_target(url)) as client:
        interface = await preflight(client, url, model, extra)
        return await _warmup(client, interface, prompts, max_tokens, requests, timeout_s, concurrency, extra)


async def _warmup(
    client: InferenceServerClient,
    interface: _ModelInterface,
    prompts: Sequence[Prompt],
    max_tokens: int,
    requests: int,
    timeout_s: float,
    concurrency: int,
    extra: Mapping[str, Any],
) -> list[RequestRecord]:
    probe = await _one_request(client, interface, prompts[0], 0, 1, max_tokens, timeout_s, None, extra)
    if not probe.ok:
        raise _probe_error(interface.model, probe.error or "unknown error")
    if requests <= 1:
        return [probe]
    rest = await _run_level(
        client, interface, prompts, max_tokens, concurrency, requests - 1, timeout_s, None, extra, first_prompt=1
    )
    return [probe, *rest]


def _probe_error(model: str, error: str) -> BenchmarkError:
    if "UNIMPLEMENTED" in error or "decoupled" in error.lower():
        return StreamingUnsupported(
            f"model '{model}' cannot stream (needs a decoupled model behind it, or gRPC streaming): {error}"
        )
    return BenchmarkError(f"first request to model '{model}' failed: {error}")


def run_benchmark(
    url: str,
    model: str,
    prompts: Sequence[Prompt],
    max_tokens: int,
    concurrency_levels: Sequence[int],
    requests_per_level: int,
    warmup_requests: int,
    timeout_s: float,
    count_tokens: Callable[[str], int] | None = None,
    progress: Callable[[str], None] | None = None,
    extra_inputs: Mapping[str, int | float | bool] | None = None,
) -> BenchmarkResult:
    """Preflight, one probe request (always) plus warm-up, then each concurrency level in order.

    Raises BenchmarkError (one-line message) when nothing can be measured; per-request failures are
    counted in each level's `errors`.
    """
    if not concurrency_levels:
        raise InvalidBenchmarkConfig("no concurrency levels to measure")
    for level in concurrency_levels:
        _validate(prompts, max_tokens, level, requests_per_level, timeout_s)
    say = progress or (lambda _msg: None)
    extra = dict(extra_inputs or {})

    async def main() -> BenchmarkResult:
        async with InferenceServerClient(_grpc_target(url)) as client:
            interface = await preflight(client, url, model, extra)
            warm = await _warmup(
                client,
                interface,
                prompts,
                max_tokens,
                warmup_requests,
                timeout_s,
                max(1, min(concurrency_levels)),
                extra,
            )
            say(f"warm-up: {len(warm)} requests, {sum(not r.ok for r in warm)} errors")
            levels: list[LevelSummary] = []
            records: list[RequestRecord] = []
            for concurrency in concurrency_levels:
                level_records = await _run_level(
                    client,
                    interface,
                    prompts,
                    max_tokens,
                    concurrency,
                    requests_per_level,
                    timeout_s,
                    count_tokens,
                    extra,
                )
                summary = summarize(level_records, concurrency)
                say(_progress_line(summary))
                levels.append(summary)
                records.extend(level_records)
            return BenchmarkResult(levels=levels, records=records)

    return asyncio.run(main())


def _progress_line(s: LevelSummary) -> str:
    ttft = f"{s.ttft_ms.p50:.1f} ms" if s.ttft_ms else "n/a"
    itl = f"{s.itl_ms.p50:.2f} ms" if s.itl_ms else "n/a"
    return (
        f"concurrency {s.concurrency}: {s.completed}/{s.requests} ok, {s.errors} errors, "
        f"{s.output_tokens_per_s:.1f} output tok/s, TTFT p50 {ttft}, ITL p50 {itl}"
    )
